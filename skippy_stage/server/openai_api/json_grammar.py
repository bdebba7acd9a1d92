"""JSON-schema grammars that enforce an integer's bounds.

llama-cpp-python's converter (``llama_grammar.SchemaConverter``) writes every integer as any
integer: ``{"type": "integer", "minimum": 0, "maximum": 150}`` let a sampled answer say 200. Here an
integer with ``minimum`` and/or ``maximum`` gets a grammar of exactly the numbers in range (digit by
digit, shortest first); a bound on a non-integer number, an exclusive bound or ``multipleOf`` is
refused by name (``unenforced``), never ignored. One side open: at least ``minimum`` (any length) or
at most ``maximum``.
"""

from __future__ import annotations

MAX_DIGITS = 18  # bounds beyond this many digits: llama.cpp's integers are no longer exact there

# Keywords a grammar of JSON text cannot keep (on numbers), refused rather than ignored.
UNENFORCED = ("exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def unenforced(node: dict) -> str | None:
    """The keyword of ``node`` (one schema, not its children) the grammar would ignore, or None."""
    for key in UNENFORCED:
        if key in node:
            return key
    if node.get("type") != "integer":
        for key in ("minimum", "maximum"):
            if key in node:
                return key
        return None
    for key in ("minimum", "maximum"):
        value = node.get(key)
        if key in node and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value)
                            or len(str(abs(int(value)))) > MAX_DIGITS):
            return key
    return None


def _alt(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives matching exactly the digit strings from ``low`` to ``high`` (equal lengths): the
    numbers under ``low``'s first digit, those between the first digits (any digits after), those under
    ``high``'s, so the grammar grows with the digits, not with the numbers."""
    if low == high:
        return [f'"{low}"']
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    rest = len(low) - 1
    if low[0] == high[0]:
        return [f'"{low[0]}" ' + _alt(_same_length(low[1:], high[1:]))]
    low_whole, high_whole = set(low[1:]) == {"0"}, set(high[1:]) == {"9"}
    first, last = int(low[0]) + (0 if low_whole else 1), int(high[0]) - (0 if high_whole else 1)
    out = []
    if not low_whole:
        out.append(f'"{low[0]}" ' + _alt(_same_length(low[1:], "9" * rest)))
    if first <= last:
        out.append(f"[{first}-{last}]" + " [0-9]" * rest)
    if not high_whole:
        out.append(f'"{high[0]}" ' + _alt(_same_length("0" * rest, high[1:])))
    return out


def _naturals(low: int, high: int | None) -> list[str]:
    """The non-negative integers from ``low`` to ``high`` (None: unbounded) as JSON writes them."""
    out: list[str] = []
    top = len(str(high)) if high is not None else MAX_DIGITS
    for length in range(len(str(low)), top + 1):
        first = str(low) if length == len(str(low)) else "1" + "0" * (length - 1)
        last = str(high) if high is not None and length == len(str(high)) else "9" * length
        if int(first) <= int(last):
            out.extend(_same_length(first, last))
    if high is None:  # longer than MAX_DIGITS digits
        out.append("[1-9]" + " [0-9]" * MAX_DIGITS + " [0-9]*")
    return out


def integer_range(minimum: int | None, maximum: int | None) -> str:
    """A GBNF expression for the integers within the bounds (either may be None)."""
    parts: list[str] = []
    if maximum is None or maximum >= 0:
        parts.extend(_naturals(max(minimum, 0) if minimum is not None else 0, maximum))
    if minimum is None or minimum < 0:
        # -1 .. -|minimum| (or every negative number): "-" and the magnitudes from max(1, -maximum)
        low = max(1, -maximum) if maximum is not None and maximum < 0 else 1
        high = -minimum if minimum is not None else None
        if high is None or low <= high:
            parts.append('"-" ' + _alt(_naturals(low, high)))
    return _alt(parts)


def bounded_converter():
    """A llama-cpp-python ``SchemaConverter`` whose integers keep their bounds."""
    from llama_cpp import llama_grammar

    class BoundedSchemaConverter(llama_grammar.SchemaConverter):
        def visit(self, schema, name):
            if isinstance(schema, dict) and schema.get("type") == "integer" and (
                    "minimum" in schema or "maximum" in schema):
                bounds = [None if schema.get(k) is None else int(schema[k]) for k in ("minimum", "maximum")]
                rule_name = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
                return self._add_rule(rule_name, integer_range(*bounds) + " space")  # the converter's own rule
            return super().visit(schema, name)

    return BoundedSchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def schema_grammar(schema: dict) -> str:
    """``llama_grammar.json_schema_to_gbnf`` with bounded integers."""
    converter = bounded_converter()
    resolved = converter.resolve_refs(schema, "stdin")
    converter.visit(resolved, "")
    return converter.format_grammar()
