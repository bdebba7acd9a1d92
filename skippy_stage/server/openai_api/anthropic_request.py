"""What the Anthropic Messages API accepts: a /v1/messages (or /v1/messages/count_tokens) body,
checked field by field by :func:`parse_messages_request`, which names the field and the value.

Text conversations only: a ``system`` prompt and alternating user and assistant turns whose
content is a string or ``text`` blocks, rendered with the GGUF's chat template as chat
completions are. Every other field Anthropic's API knows (``tools``, ``thinking``, image or
``tool_use`` blocks, ...) is refused by name rather than ignored; ``metadata`` and
``cache_control`` are accepted and ignored, because they change nothing here (resident
prefixes cache every prompt without being asked).

Where a request leaves a field out, Anthropic's default applies: sampling at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skippy_stage.config import MAX_STREAM_INTERVAL_MS
from skippy_stage.errors import InvalidFieldError
from skippy_stage.head.generator import MAX_STOP_LEN, MAX_STOP_STRINGS, GenerateSpec
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams
from skippy_stage.server.openai_api.request import _bool_field, _float_field, _int_field, _json_kind, _show

DEFAULT_TEMPERATURE = 1.0  # Anthropic's documented default
ROLES = ("user", "assistant")
# The fields of a message request this server implements (``metadata``: accepted, ignored).
_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                     "top_k", "stream", "metadata", "cache_control"})
# /v1/messages/count_tokens takes the conversation only.
_COUNT_FIELDS = frozenset({"model", "messages", "system", "cache_control"})
# Fields this server does not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "tools": ([],),
    "thinking": ({"type": "disabled"},),
    "service_tier": ("auto", "standard_only"),
}
_TEXT_BLOCK_KEYS = frozenset({"type", "text", "cache_control", "citations"})


@dataclass(frozen=True)
class MessagesRequest:
    """A validated Messages request: the conversation as chat turns (the system prompt first)."""

    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool

    def spec(self, max_tokens_limit: int, limit_hint: str = "") -> GenerateSpec:
        """The Generate spec, with max_tokens checked against the pipeline's session size."""
        if self.max_tokens > max_tokens_limit:
            raise InvalidFieldError("max_tokens", f"max_tokens={self.max_tokens} exceeds this pipeline's limit "
                                                  f"{max_tokens_limit} ({limit_hint})")
        # A response that is not streamed is read whole: the head may hand its tokens over about once a
        # second (stop strings are seen only as tokens arrive, so a request with them takes the default).
        hold_ms = None if self.stream or self.stop else float(MAX_STREAM_INTERVAL_MS)
        return GenerateSpec(prompt=None, messages=self.messages, max_tokens=self.max_tokens, sampling=self.sampling,
                            stop=self.stop, stream_interval_ms=hold_ms)


def _cache_control(value: object, where: str) -> None:
    if not (isinstance(value, dict) and value.get("type") == "ephemeral"):
        raise InvalidFieldError(where, f'{where}={_show(value)} must be {{"type": "ephemeral"}}')


def _no_other_keys(value: dict[str, Any], keys: frozenset[str], where: str) -> None:
    other = sorted(set(value) - keys)
    if other:
        raise InvalidFieldError(f"{where}.{other[0]}", f"{where}.{other[0]} is not supported by this server")


def _text_block(block: object, where: str) -> str:
    if not isinstance(block, dict):
        raise InvalidFieldError(where, f"{where} must be a content block object, got {_json_kind(block)}")
    kind = block.get("type")
    if kind != "text":
        raise InvalidFieldError(f"{where}.type", f"{where}.type={_show(kind)}: only text blocks are supported by "
                                                 f"this server")
    _no_other_keys(block, _TEXT_BLOCK_KEYS, where)
    if block.get("citations"):
        raise InvalidFieldError(f"{where}.citations", f"{where}.citations is not supported by this server")
    if block.get("cache_control") is not None:
        _cache_control(block["cache_control"], f"{where}.cache_control")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidFieldError(f"{where}.text", f"{where}.text must be a string, got {_json_kind(text)}")
    return text


def _text(value: object, where: str) -> str:
    """A string, or an array of text blocks (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_block(block, f"{where}[{j}]") for j, block in enumerate(value))
    raise InvalidFieldError(where, f"{where} must be a string or an array of text blocks, got {_json_kind(value)}")


def _messages(value: object) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _json_kind(value)
        raise InvalidFieldError("messages", f"messages must be a non-empty array of {{role, content}} objects, got {got}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidFieldError(where, f"{where} must be a {{role, content}} object, got {_json_kind(message)}")
        _no_other_keys(message, frozenset({"role", "content"}), where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidFieldError(f"{where}.role", f"{where}.role={_show(role)} must be user or assistant")
        # user first, then alternating, the last a user turn: the model answers it (a final assistant
        # turn, Anthropic's prefill, would need the template to leave that turn open)
        expected = ROLES[i % 2]
        if role != expected:
            why = "the first turn must be the user's" if i == 0 else "user and assistant turns must alternate"
            raise InvalidFieldError(f"{where}.role", f"{where}.role={role!r}: {why}")
        out.append((role, _text(message.get("content"), f"{where}.content")))
    if out[-1][0] != "user":
        last = f"messages[{len(out) - 1}]"
        raise InvalidFieldError(f"{last}.role", f"{last}.role='assistant': the last turn must be the user's "
                                                f"(continuing an assistant turn, prefill, is not supported by "
                                                f"this server)")
    return out


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidFieldError("stop_sequences", f"stop_sequences must be an array of strings, got {_json_kind(value)}")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidFieldError("stop_sequences", f"stop_sequences has {len(value)} strings, at most "
                                                  f"{MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise InvalidFieldError("stop_sequences", f"stop_sequences[{i}]={_show(s)} must be a string of "
                                                      f"1..{MAX_STOP_LEN} characters")
    return tuple(value)


def _check_fields(body: dict[str, Any], accepted: frozenset[str]) -> None:
    for name in sorted(body):
        if name in accepted:
            continue
        value = body[name]
        if name in _NEUTRAL and (value is None or value in _NEUTRAL[name]):
            continue
        raise InvalidFieldError(name, f"{name}={_show(value)} is not supported by this server")


def parse_conversation(body: object, *, counting: bool = False) -> list[tuple[str, str]]:
    """The checked conversation of a body (``counting``: a count_tokens body, the conversation only)."""
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    _check_fields(body, _COUNT_FIELDS if counting else _FIELDS)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidFieldError("model", f"model must be a string, got {_json_kind(body['model'])}")
    if body.get("cache_control") is not None:
        _cache_control(body["cache_control"], "cache_control")
    if "messages" not in body:
        raise InvalidFieldError("messages", "messages is required")
    messages = _messages(body["messages"])
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            messages.insert(0, ("system", text))
    return messages


def parse_messages_request(body: object) -> MessagesRequest:
    """Validate a /v1/messages body, field by field."""
    messages = parse_conversation(body)
    assert isinstance(body, dict)  # parse_conversation checked it
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise InvalidFieldError("metadata", f"metadata must be an object, got {_json_kind(body['metadata'])}")
    if "max_tokens" not in body:
        raise InvalidFieldError("max_tokens", "max_tokens is required")
    max_tokens = _int_field(body, "max_tokens", low=1)
    if max_tokens is None:
        raise InvalidFieldError("max_tokens", "max_tokens must be an integer, got null")
    sampling = SamplingParams(
        temperature=_float_field(body, "temperature", DEFAULT_TEMPERATURE, lambda t: 0 <= t <= 1, "in [0, 1]"),
        top_p=_float_field(body, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]"),
        top_k=_int_field(body, "top_k", low=0) or 0,
        seed=RANDOM_SEED,
    )
    return MessagesRequest(messages=tuple(messages), max_tokens=max_tokens, sampling=sampling.validate(),
                           stop=_stop_sequences(body.get("stop_sequences")), stream=_bool_field(body, "stream"))
