#!/usr/bin/env python3
"""Write docs/configuration.md from StageConfig's own definitions (or check it is current).

    python tools/config_reference.py          # write docs/configuration.md
    python tools/config_reference.py --check  # exit 1 if it is not what the config defines

Each field's type is its annotation, its default the dataclass default, and its description the
docstring written under it in ``skippy_stage/config.py``: the page cannot drift from the code
(tests/test_docs.py runs the check).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippy_stage import config  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration reference

Every field of a stage's config (`StageConfig`, `skippy_stage/config.py`), generated from the
config's own definitions by `python tools/config_reference.py`; a test fails when this page and
the code disagree.

A stage reads its config from a JSON file (`skippy-stage serve --config FILE`); `skippy-stage
check --config FILE` validates one and prints it with every default filled in. `null` means a
field's default. `up`, `demo` and `bench` set any field with `--set [STAGE_ID.]FIELD=VALUE`.
Field names follow the Rust seed (skippy-server's StageConfig), so a config the seed writes loads
as it is; the *seed* column says which fields it has, and fields only this project has are marked
*here*. The seed's fields that this stage does not act on are listed at the end: they are accepted
at their default and refused by name otherwise.

| field | type | default | seed | what it does |
| --- | --- | --- | --- | --- |
"""


def field_docs() -> dict[str, str]:
    """Each StageConfig field's docstring (the string literal written right under it)."""
    tree = ast.parse(inspect.getsource(config.StageConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def annotations() -> dict[str, str]:
    tree = ast.parse(inspect.getsource(config.StageConfig))
    return {s.target.id: ast.unparse(s.annotation) for s in tree.body[0].body  # type: ignore[attr-defined]
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else f"`{_json(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        if f.name == "n_threads":
            return "the host's cores"
        value = f.default_factory()  # type: ignore[misc]
        return f"`{_json(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)}`"
    return "required"


def _json(value: object) -> str:
    import json

    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    docs, types = field_docs(), annotations()
    lines = [HEADER.rstrip("\n")]
    for f in dataclasses.fields(config.StageConfig):
        seed = "yes" if f.name in config.SEED_FIELDS else "here"
        lines.append(f"| `{f.name}` | `{_cell(types[f.name])}` | {_cell(default_text(f))} | {seed} | "
                     f"{_cell(docs.get(f.name, ''))} |")
    lines += ["", "## Seed fields this stage does not act on", "",
              "| field | accepted | why |", "| --- | --- | --- |"]
    for name, spec in config.SEED_ONLY_FIELDS.items():
        accepted = ", ".join(dict.fromkeys(f"`{_json(v)}`" for v in (spec.default, *spec.also_accepted, None)))
        lines.append(f"| `{name}` | {accepted} | {_cell(spec.why or 'both values mean the same here')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is not what skippy_stage/config.py defines: run python tools/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
