"""What the Anthropic Messages API accepts: a /v1/messages (or /v1/messages/count_tokens) body,
checked field by field by :func:`parse_messages_request`, which names the field and the value.

A ``system`` prompt and alternating user and assistant turns whose content is a string or
``text`` blocks, rendered with the GGUF's chat template as chat completions are; with ``tools``
(``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool``,
``none``; ``disable_parallel_tool_use``), assistant ``tool_use`` blocks and user ``tool_result``
blocks, the conversation is turned into chat completions' tool chat and goes through the same
tool calls (``tools``: rendering, grammar, reading calls). Every other field Anthropic's API knows
(``thinking``, document blocks, ...) is refused by name rather than ignored; ``metadata`` and
``cache_control`` are accepted and ignored, because they change nothing here (resident
prefixes cache every prompt without being asked).

Where a request leaves a field out, Anthropic's default applies: sampling at temperature 1.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from skippy_stage.config import MAX_STREAM_INTERVAL_MS
from skippy_stage.errors import InvalidFieldError
from skippy_stage.head.generator import MAX_STOP_LEN, MAX_STOP_STRINGS, GenerateSpec
from skippy_stage.model.projector import MEDIA_PART
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams
from skippy_stage.server.openai_api.request import (
    ImagePart,
    _bool_field,
    _float_field,
    _int_field,
    _json_kind,
    _show,
)
from skippy_stage.server.openai_api.tools import ToolUse, parse_tools

DEFAULT_TEMPERATURE = 1.0  # Anthropic's documented default
ROLES = ("user", "assistant")
# The fields of a message request this server implements (``metadata``: accepted, ignored).
_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                     "top_k", "stream", "metadata", "cache_control", "tools", "tool_choice"})
# /v1/messages/count_tokens takes the conversation only.
_COUNT_FIELDS = frozenset({"model", "messages", "system", "cache_control", "tools", "tool_choice"})
# Fields this server does not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple[object, ...]] = {
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
    tools: ToolUse | None = None  # tools offered, or tool turns in the conversation
    images: tuple[ImagePart, ...] = ()  # the user turns' image blocks, in order (their markers are in messages)

    def spec(self, max_tokens_limit: int, limit_hint: str = "", media: tuple[bytes, ...] = ()) -> GenerateSpec:
        """The Generate spec, with max_tokens checked against the pipeline's session size; ``media``: the
        images' bytes (``fetch_images``)."""
        if self.max_tokens > max_tokens_limit:
            raise InvalidFieldError("max_tokens", f"max_tokens={self.max_tokens} exceeds this pipeline's limit "
                                                  f"{max_tokens_limit} ({limit_hint})")
        # A response that is not streamed is read whole: the head may hand its tokens over about once a
        # second (stop strings are seen only as tokens arrive, so a request with them takes the default).
        hold_ms = None if self.stream or self.stop else float(MAX_STREAM_INTERVAL_MS)
        return GenerateSpec(prompt=None, messages=self.messages, max_tokens=self.max_tokens, sampling=self.sampling,
                            stop=self.stop, stream_interval_ms=hold_ms, media=media)


def _cache_control(value: object, where: str) -> None:
    if not (isinstance(value, dict) and value.get("type") == "ephemeral"):
        raise InvalidFieldError(where, f'{where}={_show(value)} must be {{"type": "ephemeral"}}')


def _no_other_keys(value: dict[str, Any], keys: frozenset[str], where: str) -> None:
    """Refuse any key but ``keys`` that has a value: a block a client echoes back from an answer
    carries the fields its SDK knows, unset ones as null (a tool_use block's ``caller``)."""
    other = sorted(key for key in set(value) - keys if value[key] is not None)
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


def _tool_use_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's ``tool_use`` block as chat completions' past call."""
    _no_other_keys(block, frozenset({"type", "id", "name", "input", "cache_control"}), where)
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidFieldError(f"{where}.{key}", f"{where}.{key} must be a non-empty string, got "
                                                      f"{_show(block.get(key))}")
    if not isinstance(block.get("input"), dict):
        raise InvalidFieldError(f"{where}.input", f"{where}.input must be an object (the call's arguments), got "
                                                  f"{_json_kind(block.get('input'))}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A user's ``tool_result`` block as chat completions' tool message."""
    _no_other_keys(block, frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}), where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidFieldError(f"{where}.tool_use_id", f"{where}.tool_use_id must be the id of the tool_use it "
                                                        f"answers, got {_show(call_id)}")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _text(content, f"{where}.content")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise InvalidFieldError(f"{where}.is_error", f"{where}.is_error must be a boolean, got "
                                                     f"{_json_kind(block['is_error'])}")
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if block.get("is_error") else text}


def _image_block(block: dict[str, Any], where: str) -> ImagePart:
    """A user's ``image`` block: its bytes (``source`` base64) or its URL (``source`` url, fetched only
    where the head's ``media_url_fetch`` allows)."""
    _no_other_keys(block, frozenset({"type", "source", "cache_control"}), where)
    if block.get("cache_control") is not None:
        _cache_control(block["cache_control"], f"{where}.cache_control")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        _no_other_keys(source, frozenset({"type", "media_type", "data"}), f"{where}.source")
        data = source.get("data")
        if not isinstance(data, str):
            raise InvalidFieldError(f"{where}.source.data", f"{where}.source.data must be a base64 string, got "
                                                            f"{_json_kind(data)}")
        try:
            return ImagePart(f"{where}.source.data", data=base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidFieldError(f"{where}.source.data", f"{where}.source.data is not valid base64") from None
    if kind == "url":
        _no_other_keys(source, frozenset({"type", "url"}), f"{where}.source")
        url = source.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidFieldError(f"{where}.source.url", f"{where}.source.url={_show(url)} must be an http(s) URL")
        return ImagePart(f"{where}.source.url", url=url)
    raise InvalidFieldError(f"{where}.source", f"{where}.source={_show(source)} must be {{type: base64, media_type, "
                                               f"data}} or {{type: url, url}}")


def _turn(role: str, content: object, where: str, images: list[ImagePart]) -> tuple[str, list[dict[str, Any]]]:
    """A turn's text, and the turn as chat completions' messages (tool results as tool messages,
    an assistant's calls as its ``tool_calls``); a user's image blocks go to ``images``, each the media
    marker in the text."""
    if not isinstance(content, list):
        text = _text(content, where)
        return text, [{"role": role, "content": text}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if role != "assistant":
                raise InvalidFieldError(f"{at}.type", f"{at}.type='tool_use' belongs in an assistant turn")
            calls.append(_tool_use_block(block, at))
        elif kind == "tool_result":
            if role != "user":
                raise InvalidFieldError(f"{at}.type", f"{at}.type='tool_result' belongs in a user turn")
            results.append(_tool_result_block(block, at))
        elif kind == "image":
            if role != "user":
                raise InvalidFieldError(f"{at}.type", f"{at}.type='image' belongs in a user turn")
            images.append(_image_block(block, at))
            texts.append(MEDIA_PART)
        else:
            texts.append(_text_block(block, at))
    text = "".join(texts)
    if calls:
        return text, [{"role": "assistant", "content": text, "tool_calls": calls}]
    return text, [*results, *([{"role": role, "content": text}] if text or not results else [])]


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as chat completions' (checked there, ``tools.parse_tools``)."""
    tools = body.get("tools")
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidFieldError("tools", f"tools must be an array of {{name, description, input_schema}} "
                                             f"objects, got {_json_kind(tools)}")
        converted = []
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise InvalidFieldError(where, f"{where} must be a {{name, description, input_schema}} object, got "
                                               f"{_json_kind(tool)}")
            if tool.get("type") not in (None, "custom"):
                raise InvalidFieldError(f"{where}.type", f"{where}.type={_show(tool.get('type'))}: server tools are "
                                                         f"not supported by this server, only client tools")
            _no_other_keys(tool, frozenset({"type", "name", "description", "input_schema", "cache_control"}), where)
            if "input_schema" not in tool:
                raise InvalidFieldError(f"{where}.input_schema", f"{where}.input_schema is required")
            converted.append({"type": "function", "function": {
                **{k: tool[k] for k in ("name", "description") if k in tool}, "parameters": tool["input_schema"]}})
        out["tools"] = converted
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise InvalidFieldError("tool_choice", f"tool_choice={_show(choice)} must be {{type: auto | any | tool "
                                                   f"| none}} (tool with a name)")
        _no_other_keys(choice, frozenset({"type", "name", "disable_parallel_tool_use"}), "tool_choice")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise InvalidFieldError("tool_choice.name", "tool_choice.name is required with type tool")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None:
            if not isinstance(parallel, bool):
                raise InvalidFieldError("tool_choice.disable_parallel_tool_use",
                                        f"tool_choice.disable_parallel_tool_use must be a boolean, got "
                                        f"{_json_kind(parallel)}")
            out["parallel_tool_calls"] = not parallel
    return out


def _messages(value: object, images: list[ImagePart]) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    """The turns as (role, text), and as chat completions' messages (tool turns included); images to
    ``images``."""
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _json_kind(value)
        raise InvalidFieldError("messages", f"messages must be a non-empty array of {{role, content}} objects, got {got}")
    out = []
    chat: list[dict[str, Any]] = []
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
        text, turns = _turn(role, message.get("content"), f"{where}.content", images)
        out.append((role, text))
        chat.extend(turns)
    if out[-1][0] != "user":
        last = f"messages[{len(out) - 1}]"
        raise InvalidFieldError(f"{last}.role", f"{last}.role='assistant': the last turn must be the user's "
                                                f"(continuing an assistant turn, prefill, is not supported by "
                                                f"this server)")
    return out, chat


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


def parse_conversation(body: object, *, counting: bool = False,
                       images: list[ImagePart] | None = None) -> tuple[list[tuple[str, str]], ToolUse | None]:
    """The checked conversation of a body (``counting``: a count_tokens body, the conversation only),
    and its tools and tool turns (None: a text conversation); its image blocks go to ``images``."""
    images = [] if images is None else images
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    _check_fields(body, _COUNT_FIELDS if counting else _FIELDS)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidFieldError("model", f"model must be a string, got {_json_kind(body['model'])}")
    if body.get("cache_control") is not None:
        _cache_control(body["cache_control"], "cache_control")
    if "messages" not in body:
        raise InvalidFieldError("messages", "messages is required")
    messages, chat = _messages(body["messages"], images)
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            messages.insert(0, ("system", text))
            chat.insert(0, {"role": "system", "content": text})
    try:
        return messages, parse_tools({"messages": chat, **_tools(body)}, chat=True)
    except InvalidFieldError as exc:
        raise InvalidFieldError(_anthropic_name(exc.param), _anthropic_name(str(exc))) from None


# Chat completions' names for a tool's fields, as this API names them (a schema the grammar cannot
# take is refused by chat completions' tool code: the error names the field the client sent).
_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(parameters|name|description)")
_OURS = {"parameters": "input_schema", "name": "name", "description": "description"}


def _anthropic_name(text: str | None) -> str | None:
    return None if text is None else _TOOL_FIELD.sub(lambda m: f"tools[{m[1]}].{_OURS[m[2]]}", text)


def parse_messages_request(body: object) -> MessagesRequest:
    """Validate a /v1/messages body, field by field."""
    images: list[ImagePart] = []
    messages, tools = parse_conversation(body, images=images)
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
                           stop=_stop_sequences(body.get("stop_sequences")), stream=_bool_field(body, "stream"),
                           tools=tools, images=tuple(images))
