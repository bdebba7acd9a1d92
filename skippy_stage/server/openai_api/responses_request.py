"""What the OpenAI Responses API (POST /v1/responses) accepts: a body checked field by field by
:func:`parse_responses_request`, which names the field and the value in its message and in the
error's ``param``.

A Responses request is a chat completion in another shape, and is run as one: its conversation
becomes chat messages (``instructions`` a system turn first, ``developer`` turns system turns,
``function_call`` items an assistant turn's ``tool_calls``, ``function_call_output`` items
``role: "tool"`` turns), its flat function ``tools`` chat's ``{"type": "function", "function":
{...}}``, ``text.format`` chat's ``response_format``, and that chat body goes through the chat
path's own checks (``request.parse_request``, ``tools.parse_tools``): the same rendering, grammars
and limits, with the chat field names in any refusal put back in this API's (:func:`responses_names`).

A conversation is kept as *items*, plain dicts in one normal form, whatever shape the client sent
them in (a string, an ``EasyInputMessage``, a message with ``input_text`` parts, an output item of
an earlier response)::

    {"type": "message", "role": "user" | "assistant" | "system" | "developer", "content": str | list}
    {"type": "function_call", "call_id": str, "name": str, "arguments": str}
    {"type": "function_call_output", "call_id": str, "output": str}

A message with ``input_image`` parts keeps its content as chat's parts (``{"type": "text", ...}``,
``{"type": "image_url", "image_url": url}``), so a stored conversation holds its images (as the URLs
the client sent: a ``data:`` URL's bytes, an http(s) URL fetched again each turn) and every turn that
continues it reads them again, as the whole history sent as ``input`` would.

Every field the API knows and this server does not implement (``reasoning``, ``background``,
built-in tools, file and audio parts, ``include``, ``conversation``, ...) is refused by name unless
it holds its "not used" value; ``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``
and ``service_tier`` are accepted and change nothing (resident prefixes cache every prompt unasked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from skippy_stage.errors import InvalidFieldError
from skippy_stage.server.openai_api.request import (
    OpenAIRequest,
    _bool_field,
    _float_field,
    _int_field,
    _json_kind,
    _show,
    parse_request,
)
from skippy_stage.server.openai_api.tools import ToolUse, parse_tools

ROLES = ("user", "assistant", "system", "developer")
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
# The fields of a create request this server implements or accepts.
_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                     "tool_choice", "parallel_tool_calls", "text", "stream", "stream_options", "store",
                     "previous_response_id", "metadata", "user", "safety_identifier", "prompt_cache_key",
                     "service_tier", "truncation", "background", "include", "reasoning", "top_logprobs",
                     "max_tool_calls", "prompt_cache_retention"})
# Of those, the ones only accepted with the values that mean "not used" (None always is).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "include": ([],),
    "top_logprobs": (0,),
    "service_tier": ("auto", "default"),
    "prompt_cache_retention": ("in_memory",),
    "max_tool_calls": (),
    "reasoning": (),  # or an object of nulls: no reasoning asked for
}
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_TEXT_PARTS = ("input_text", "output_text")
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
_IMAGE_KEYS = frozenset({"type", "image_url", "file_id", "detail"})
_DETAILS = ("auto", "low", "high")
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated create request. ``body`` is the request as sent, for the fields the answer
    echoes; ``items`` its ``input`` in the normal form."""

    body: dict[str, Any]
    items: tuple[dict[str, str], ...]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    parallel_tool_calls: bool | None  # None: the chat path's default
    tools: tuple[dict[str, Any], ...]  # the function tools in the Responses shape, as the answer echoes them
    tool_choice: object  # as given (the answer echoes it); "auto" or "none" when left out
    text_format: dict[str, Any]  # {"type": "text"} when left out

    def chat(self, conversation: tuple[dict[str, str], ...]) -> tuple[OpenAIRequest, ToolUse | None]:
        """The chat completion that answers this request over ``conversation`` (a stored one's items,
        then this request's): checked by the chat path, refusals named in this API's fields."""
        calls = set()
        for i, item in enumerate(conversation):
            if item["type"] == "function_call":
                calls.add(item["call_id"])
            elif item["type"] == "function_call_output" and item["call_id"] not in calls:
                where = f"input[{i - (len(conversation) - len(self.items))}]"
                raise InvalidFieldError(f"{where}.call_id", f"{where}.call_id={item['call_id']!r}: no "
                                                            f"function_call before it has that call_id")
        origins: list[int] = []
        body: dict[str, Any] = {"messages": chat_messages(conversation, self.instructions, origins),
                                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
                                "max_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls,
                                "response_format": _response_format(self.text_format)}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {k: v for k, v in tool.items()
                                                               if k in ("name", "description", "parameters")
                                                               and v is not None}} for tool in self.tools]
        choice = self.body.get("tool_choice")
        if isinstance(choice, dict):  # {"type": "function", "name"} (checked): chat's shape
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice is not None:
            body["tool_choice"] = choice
        # A chat message's refusal (an image part's, say) names the input item it came from.
        at_input = _input_names(origins, len(conversation) - len(self.items))
        with responses_names():
            try:
                request = parse_request(body, chat=True)
            except InvalidFieldError as exc:
                raise InvalidFieldError(at_input(exc.param) if exc.param else None, at_input(str(exc))) from None
            images = tuple(dataclasses.replace(image, where=at_input(image.where)) for image in request.images)
            return dataclasses.replace(request, images=images), parse_tools(body, chat=True)


def _input_names(origins: list[int], history: int) -> Callable[[str], str]:
    """``messages[k]`` in a text renamed for the item chat message k came from: ``input[i]``, or
    ``previous_response_id`` for one of the stored conversation (``history`` items before the input)."""
    def item(match: re.Match[str]) -> str:
        k = int(match[1])
        if k >= len(origins) or origins[k] < 0:
            return match[0]
        return f"input[{origins[k] - history}]" if origins[k] >= history else "previous_response_id"

    return lambda text: re.sub(r"messages\[(\d+)\]", item, text)


def chat_messages(items: tuple[dict[str, str], ...], instructions: str | None,
                  origins: list[int] | None = None) -> list[dict[str, Any]]:
    """The conversation as chat messages: ``instructions`` a system turn first, a developer turn a
    system turn, each ``function_call`` an entry of an assistant turn's ``tool_calls`` (the turn
    before it when that is the assistant's: its text and the calls it made are one turn, and
    assistant text right after its calls joins its text, as chat's answer joins them), each
    ``function_call_output`` a ``tool`` turn. ``origins`` gets each message's item index (-1: the
    instructions)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    found = [-1] * len(messages)
    for index, item in enumerate(items):
        last = messages[-1] if messages else None
        if item["type"] == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant" and last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["content"] = (last["content"] or "") + item["content"]
            else:
                messages.append({"role": role, "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        found.extend([index] * (len(messages) - len(found)))
    if origins is not None:
        origins[:] = found
    return messages


# Chat field names in the chat path's refusals, and this API's for them (applied in this order).
_RENAMES = (
    (re.compile(r"response_format\.json_schema\."), "text.format."),
    (re.compile(r"response_format"), "text.format"),
    (re.compile(r"(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"max_tokens"), "max_output_tokens"),
    (re.compile(r"messages(\[\d+\])?"), "input"),
)


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """Refusals of the chat path (run on a chat body made from a Responses body) named in the
    Responses API's fields: ``text.format``, ``tools[i].parameters``, ``max_output_tokens``."""
    try:
        yield
    except InvalidFieldError as exc:
        param, message = exc.param, str(exc)
        for pattern, name in _RENAMES:
            param = pattern.sub(name, param) if param is not None else None
            message = pattern.sub(name, message)
        raise InvalidFieldError(param, message) from None


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` (checked) as chat's ``response_format``."""
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    spec = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
    return {"type": "json_schema", "json_schema": spec}


def _neutral(name: str, value: object) -> bool:
    if value is None:
        return True
    if name == "reasoning":  # {} or only nulls: no reasoning asked for
        return isinstance(value, dict) and all(v is None for v in value.values())
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in _NEUTRAL.get(name, ()))


def _check_fields(body: dict[str, Any]) -> None:
    for name in sorted(body):
        value = body[name]
        if name not in _FIELDS:
            if value is not None:
                raise InvalidFieldError(name, f"{name}={_show(value)} is not supported by this server")
        elif name in _NEUTRAL and not _neutral(name, value):
            raise InvalidFieldError(name, f"{name}={_show(value)} is not supported by this server")


def _string(body: dict[str, Any], name: str, where: str | None = None) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        field = f"{where}.{name}" if where else name
        raise InvalidFieldError(field, f"{field} must be a string, got {_json_kind(value)}")
    return value


def _required_string(body: dict[str, Any], name: str, where: str) -> str:
    value = _string(body, name, where)
    if value is None:
        raise InvalidFieldError(f"{where}.{name}", f"{where}.{name} is required")
    return value


def _no_other_keys(value: dict[str, Any], keys: frozenset[str], where: str) -> None:
    other = sorted(k for k in set(value) - keys if value[k] is not None)
    if other:
        raise InvalidFieldError(f"{where}.{other[0]}", f"{where}.{other[0]} is not supported by this server")


def _text_parts(value: object, where: str, *, images: bool = False) -> str | list[dict[str, Any]]:
    """A string, or an array of ``input_text`` / ``output_text`` parts (joined); with ``images``,
    ``input_image`` parts too, and then chat's parts in order (the images as ``image_url`` parts)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidFieldError(where, f"{where} must be a string or an array of input_text parts, got "
                                       f"{_json_kind(value)}")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise InvalidFieldError(at, f"{at} must be a content part object, got {_json_kind(part)}")
        kind = part.get("type")
        if kind == "input_image" and images:
            parts.append({"type": "image_url", "image_url": _image_url(part, at)})
            continue
        if kind not in _TEXT_PARTS:
            also = ", input_image" if images else ""
            raise InvalidFieldError(f"{at}.type", f"{at}.type={_show(kind)}: only input_text{also} and output_text "
                                                  f"parts are supported by this server")
        if part.get("annotations"):
            raise InvalidFieldError(f"{at}.annotations", f"{at}.annotations is not supported by this server")
        _no_other_keys(part, _PART_KEYS, at)
        parts.append({"type": "text", "text": _required_string(part, "text", at)})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_url(part: dict[str, Any], where: str) -> str:
    """An ``input_image`` part's URL (checked as an image by the chat path, where it is read)."""
    _no_other_keys(part, _IMAGE_KEYS, where)
    if part.get("file_id") is not None:
        raise InvalidFieldError(f"{where}.file_id", f"{where}.file_id: uploaded files are not supported by this "
                                                    f"server; send the image as image_url (a data: or http(s) URL)")
    detail = part.get("detail")
    if detail is not None and detail not in _DETAILS:
        raise InvalidFieldError(f"{where}.detail", f"{where}.detail={_show(detail)} must be one of "
                                                   f"{', '.join(_DETAILS)}")
    return _required_string(part, "image_url", where)


def _item(value: object, where: str) -> dict[str, str]:
    """One ``input`` item in the normal form."""
    if not isinstance(value, dict):
        raise InvalidFieldError(where, f"{where} must be an item object, got {_json_kind(value)}")
    kind = value.get("type", "message")
    if kind == "message":
        _no_other_keys(value, _MESSAGE_KEYS, where)
        role = value.get("role")
        if role not in ROLES:
            raise InvalidFieldError(f"{where}.role", f"{where}.role={_show(role)} must be one of {', '.join(ROLES)}")
        return {"type": "message", "role": role,
                "content": _text_parts(value.get("content"), f"{where}.content", images=role != "assistant")}
    if kind == "function_call":
        _no_other_keys(value, _CALL_KEYS, where)
        return {"type": "function_call", "call_id": _required_string(value, "call_id", where),
                "name": _required_string(value, "name", where),
                "arguments": _required_string(value, "arguments", where)}
    if kind == "function_call_output":
        _no_other_keys(value, _OUTPUT_KEYS, where)
        return {"type": "function_call_output", "call_id": _required_string(value, "call_id", where),
                "output": _text_parts(value.get("output"), f"{where}.output")}
    raise InvalidFieldError(f"{where}.type", f"{where}.type={_show(kind)}: only message, function_call and "
                                             f"function_call_output items are supported by this server")


def _input(value: object) -> tuple[dict[str, str], ...]:
    if isinstance(value, str):
        return ({"type": "message", "role": "user", "content": value},)
    if not isinstance(value, list):
        raise InvalidFieldError("input", f"input must be a string or an array of items, got {_json_kind(value)}")
    return tuple(_item(item, f"input[{i}]") for i, item in enumerate(value))


def _tools(value: object) -> tuple[dict[str, Any], ...]:
    """Function tools in the Responses shape ({"type": "function", "name", ...}, flat); their names and
    schemas are checked by the chat path."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidFieldError("tools", f"tools must be an array of function tools, got {_json_kind(value)}")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidFieldError(where, f"{where} must be a tool object, got {_json_kind(tool)}")
        if tool.get("type") != "function":
            raise InvalidFieldError(f"{where}.type", f"{where}.type={_show(tool.get('type'))}: only function tools "
                                                     f"are supported by this server")
        if "function" in tool:  # chat's shape
            raise InvalidFieldError(f"{where}.function", f"{where}.function: a Responses tool is flat, "
                                                         f'{{"type": "function", "name", "parameters"}}')
        _no_other_keys(tool, _TOOL_KEYS, where)
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidFieldError(f"{where}.strict", f"{where}.strict must be a boolean, got {_json_kind(strict)}")
        out.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), "strict": strict})
    return tuple(out)


def _tool_choice(value: object) -> None:
    """``auto``, ``none``, ``required`` or ``{"type": "function", "name"}``: other shapes (built-in
    tools, ``allowed_tools``, MCP) are refused; the rest is the chat path's to check."""
    if value is None or value in ("auto", "none", "required"):
        return
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str)):
        raise InvalidFieldError("tool_choice", f"tool_choice={_show(value)} must be auto, none, required or "
                                               f'{{"type": "function", "name": ...}}')


def _text_format(value: object) -> dict[str, Any]:
    """``text``: its ``format`` (text, json_object or json_schema), checked in shape here and as a
    grammar by the chat path; ``verbosity`` only as its default."""
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        raise InvalidFieldError("text", f"text must be an object {{format}}, got {_json_kind(value)}")
    _no_other_keys(value, frozenset({"format", "verbosity"}), "text")
    if value.get("verbosity") not in (None, "medium"):
        raise InvalidFieldError("text.verbosity", f"text.verbosity={_show(value['verbosity'])} is not supported by "
                                                  f"this server")
    fmt = value.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidFieldError("text.format", f"text.format={_show(fmt)} must be an object whose type is text, "
                                               f"json_object or json_schema")
    if fmt["type"] != "json_schema":
        _no_other_keys(fmt, frozenset({"type"}), "text.format")
        return {"type": fmt["type"]}
    _no_other_keys(fmt, frozenset({"type", "name", "schema", "strict", "description"}), "text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidFieldError("text.format.schema", "text.format.schema must be a JSON schema object")
    _required_string(fmt, "name", "text.format")
    _string(fmt, "description", "text.format")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise InvalidFieldError("text.format.strict", "text.format.strict must be a boolean")
    return {k: fmt[k] for k in ("type", "name", "schema", "strict", "description") if fmt.get(k) is not None}


def _metadata(value: object) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise InvalidFieldError("metadata", f"metadata={_show(value)} must be an object of at most "
                                            f"{MAX_METADATA_KEYS} string values (keys up to 64 characters, values up "
                                            f"to 512)")


def parse_responses_request(body: object) -> ResponsesRequest:
    """Validate a POST /v1/responses body, field by field (the conversation's own checks, which
    need the stored conversation it continues, come with :meth:`ResponsesRequest.chat`)."""
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    _check_fields(body)
    for name in ("model", "instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        _string(body, name)
    if "input" not in body:
        raise InvalidFieldError("input", "input is required")
    items = _input(body["input"])
    instructions = body.get("instructions") or None
    if not items and instructions is None and body.get("previous_response_id") is None:
        raise InvalidFieldError("input", "input is empty: there is nothing to answer")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_obfuscation"}):
        raise InvalidFieldError("stream_options", f"stream_options={_show(options)}: only include_obfuscation is "
                                                  f"known (and changes nothing here)")
    _metadata(body.get("metadata"))
    _tool_choice(body.get("tool_choice"))
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    store = body.get("store")
    return ResponsesRequest(
        body=body, items=items, instructions=instructions, previous_response_id=body.get("previous_response_id"),
        store=True if store is None else _bool_field(body, "store"),  # OpenAI's default: stored
        stream=_bool_field(body, "stream"),
        temperature=_float_field(body, "temperature", 1.0, lambda t: 0 <= t <= 2, "in [0, 2]"),
        top_p=_float_field(body, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]"),
        max_output_tokens=_int_field(body, "max_output_tokens", low=1),
        parallel_tool_calls=None if parallel is None else _bool_field(body, "parallel_tool_calls"),
        tools=tools, tool_choice=body.get("tool_choice") or ("auto" if tools else "none"),
        text_format=_text_format(body.get("text")))
