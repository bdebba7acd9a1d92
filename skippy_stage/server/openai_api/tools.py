"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and
the assistant ``tool_calls`` and ``role: "tool"`` results in a chat's history.

A call, whichever way the prompt was rendered, is written in one syntax (Hermes', which Qwen 2.5
and 3 use too), one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering (:meth:`ToolUse.render`): a chat template that renders ``tools``, assistant
``tool_calls`` in this syntax and tool results (found by rendering a probe chat with it,
:func:`template_knows_tools`) gets them as they are, through the head's own Jinja renderer, as
llama-server's ``--jinja`` does. Any other template gets the generic format, plain messages it
can render: a ``# Tools`` section in the system message listing the functions (their JSON, one a
line, inside ``<tools></tools>``) and the syntax above; past calls as assistant text in that
syntax; tool results as user turns of ``<tool_response>`` blocks (consecutive results joined).

Generation: with ``tool_choice`` ``required`` or a named function, sampling is constrained by a
grammar built from the functions' JSON schemas (llama-cpp-python's converter), so every answer is
one call (or several, ``parallel_tool_calls``) whose ``arguments`` validate. With ``auto`` the
model writes freely and the calls are read out of its text: a block that does not parse, or
names no offered function, stays text. With ``none`` the tools are rendered and nothing is read.

:class:`CallReader` turns generated text into OpenAI's message deltas as it comes (content, then
each call's id and name, then its ``arguments`` in fragments); the non-streamed message is the
same deltas joined, so a stream and a whole answer agree by construction.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from skippy_stage.errors import InvalidFieldError, InvalidRequestError
from skippy_stage.head.generator import GenerateSpec
from skippy_stage.model.sampling import check_grammar_text
from skippy_stage.server.openai_api.json_grammar import bounded_converter
from skippy_stage.server.openai_api.request import (
    _check_schema_bounds,
    _content,
    _json_kind,
    _show,
    strict_json_strings,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("auto", "none", "required")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    """One offered function: the tool as the template takes it, and its arguments' schema."""

    name: str
    tool: dict[str, Any]  # {"type": "function", "function": {name, description, parameters}}
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and tool turns, validated."""

    functions: tuple[Function, ...]
    choice: str  # auto, none, required, or function (``named``)
    named: str | None
    parallel: bool
    messages: tuple[dict[str, Any], ...]  # the whole chat as templates take it (tool_calls, tool_call_id)
    grammar: str  # every answer is a call: the calls' grammar; else ""

    @property
    def reads_calls(self) -> bool:
        """Whether answers are read for calls (not with ``none``, nor without tools)."""
        return bool(self.functions) and self.choice != "none"

    def render(self, spec: GenerateSpec, template: str | None) -> GenerateSpec:
        """``spec`` with the chat rendered for ``template`` (the model's own, when it knows tools;
        else the generic format) and the calls' grammar, if any."""
        if self.grammar:
            spec = dataclasses.replace(spec, sampling=dataclasses.replace(spec.sampling, grammar=self.grammar))
        if template and template_knows_tools(template):
            return dataclasses.replace(spec, chat_messages=self.messages,
                                       tools=tuple(f.tool for f in self.functions))
        return dataclasses.replace(spec, messages=generic_messages(self))

    def reader(self) -> CallReader:
        return CallReader(frozenset(f.name for f in self.functions), constrained=bool(self.grammar),
                          parallel=self.parallel)

    def answer(self, text: str, reason: str) -> tuple[dict[str, Any], str]:
        """A whole answer's message and finish_reason: what its stream's deltas join to."""
        reader = self.reader()
        reader.feed(text)
        reader.end()
        return reader.message(), reader.finish_reason(reason)


def parse_tools(body: dict[str, Any], *, chat: bool) -> ToolUse | None:
    """The request's tools and tool turns, checked field by field; None for a chat without either
    (rendered and answered as before). ``body`` has passed ``parse_request``."""
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) not in (None, []):
                raise InvalidFieldError(name, f"{name} is a chat completions option; /v1/completions does not take it")
        return None
    functions = _functions(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    # llama-server's default, not OpenAI's: a small model allowed several calls tends to go on
    # calling until max_tokens (SmolLM2 did, for a question that needs one call).
    parallel = False if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise InvalidFieldError("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got "
                                                       f"{_json_kind(parallel)} ({_show(parallel)})")
    choice, named = _choice(body.get("tool_choice"), functions)
    messages, has_turns = _turns(body["messages"])
    if not functions and not has_turns:
        return None
    grammar = ""
    if functions and choice != "none":
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            raise InvalidFieldError("response_format", f"response_format={_show(response_format)} cannot be combined "
                                                       f"with tools the model may call (tool_choice={choice!r})")
        if choice != "auto":
            offered = [f for f in functions if named is None or f.name == named]
            grammar = calls_grammar(offered, functions.index(offered[0]) if named else 0, parallel=parallel)
    return ToolUse(functions=functions, choice=choice, named=named, parallel=parallel, messages=messages,
                   grammar=grammar)


def _functions(value: object) -> tuple[Function, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidFieldError("tools", f"tools must be an array of {{type: function, function}} objects, got "
                                         f"{_json_kind(value)}")
    if len(value) > MAX_TOOLS:
        raise InvalidFieldError("tools", f"tools has {len(value)} tools, at most {MAX_TOOLS} are allowed")
    out: list[Function] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidFieldError(where, f"{where} must be a {{type: function, function}} object, got "
                                           f"{_json_kind(tool)}")
        if tool.get("type") != "function":
            raise InvalidFieldError(f"{where}.type", f"{where}.type={_show(tool.get('type'))} must be \"function\", "
                                                     f"the one tool type this server calls")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidFieldError(f"{where}.function", f"{where}.function must be an object "
                                                         f"{{name, description, parameters}}, got {_json_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidFieldError(f"{where}.function.name", f"{where}.function.name={_show(name)} must be 1 to 64 "
                                                              f"letters, digits, underscores or dashes")
        if any(f.name == name for f in out):
            raise InvalidFieldError(f"{where}.function.name", f"{where}.function.name={name!r} is offered twice")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidFieldError(f"{where}.function.description", f"{where}.function.description must be a "
                                                                     f"string, got {_json_kind(description)}")
        parameters = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            got = f"type {_show(parameters.get('type'))}" if isinstance(parameters, dict) else _json_kind(parameters)
            raise InvalidFieldError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON "
                                                                    f"schema of an object (type: object), got {got}")
        _check_schema_bounds(parameters, f"{where}.function.parameters", f"{where}.function.parameters")
        kept = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        out.append(Function(name=name, tool={"type": "function", "function": kept}, parameters=parameters))
    return tuple(out)


def _choice(value: object, functions: tuple[Function, ...]) -> tuple[str, str | None]:
    """``tool_choice``: OpenAI's default is auto with tools, none without."""
    if value is None:
        return ("auto" if functions else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidFieldError("tool_choice", f"tool_choice={value!r} must be auto, none, required or "
                                                   f'{{"type": "function", "function": {{"name": ...}}}}')
        if value == "required" and not functions:
            raise InvalidFieldError("tool_choice", "tool_choice=required needs tools to call")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise InvalidFieldError("tool_choice", f"tool_choice={_show(value)} must be auto, none, required or "
                                               f'{{"type": "function", "function": {{"name": ...}}}}')
    if not any(f.name == name for f in functions):
        offered = ", ".join(f.name for f in functions) or "none"
        raise InvalidFieldError("tool_choice", f"tool_choice names function {name!r}, which tools does not offer "
                                               f"(offered: {offered})")
    return "function", name


def _turns(value: list[Any]) -> tuple[tuple[dict[str, Any], ...], bool]:
    """The chat as templates take it, and whether it holds tool calls or results. The roles and
    contents are checked already (``request._messages``)."""
    out, has_turns = [], False
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message["role"]
        content = message.get("content")
        # image parts become the media marker, as in ``request._messages`` (which keeps their images)
        turn: dict[str, Any] = {"role": role, "content": "" if content is None else _content(content, where, [])}
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise InvalidFieldError(f"{where}.tool_calls", f"{where}.tool_calls must be an array, on an "
                                                               f"assistant message (this one is {role!r})")
            if calls:
                turn["tool_calls"] = [_past_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
                has_turns = True
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidFieldError(f"{where}.tool_call_id", f"{where}.tool_call_id is required on a tool "
                                                                 f"message: the id of the call it answers")
            turn["tool_call_id"] = call_id
            if isinstance(message.get("name"), str):
                turn["name"] = message["name"]
            has_turns = True
        out.append(turn)
    return tuple(out), has_turns


def _past_call(call: object, where: str) -> dict[str, Any]:
    """An assistant's earlier call, its arguments as an object (what chat templates expect) when
    they parse as one."""
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    arguments = fn.get("arguments", "{}") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, (str, dict)):
        raise InvalidFieldError(where, f"{where} must be {{id, type: function, function: {{name, arguments}}}} "
                                       f"with a name and arguments as a JSON string, got {_show(call)}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidFieldError(f"{where}.id", f"{where}.id must be a string, got {_json_kind(call_id)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # rendered as given
    return {"id": call_id or "", "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------------------------------------
# Rendering

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_offered_fn", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CHAT = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function", "function": {"name": "probe_called_fn", "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "call_probe", "content": "probe_result_text"},
]
_PROBE_CALL = re.compile(re.escape(OPEN) + r'\s*\{\s*"name":\s*"probe_called_fn",\s*"arguments":\s*\{\s*"x":\s*1\s*\}')


@functools.lru_cache(maxsize=8)
def template_knows_tools(template: str) -> bool:
    """Whether ``template`` renders offered tools, a past call in this module's syntax and a tool
    result: a probe chat rendered by the same Jinja renderer the head uses (minja's way of finding
    a template's capabilities)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    try:
        text = Jinja2ChatFormatter(template=template, eos_token="", bos_token="")(
            messages=copy.deepcopy(_PROBE_CHAT), tools=[_PROBE_TOOL]).prompt
    except Exception:  # noqa: BLE001 - a template that fails on tool turns does not know them
        return False
    return "probe_offered_fn" in text and "probe_result_text" in text and _PROBE_CALL.search(text) is not None


def tools_section(use: ToolUse) -> str:
    """The generic format's system-prompt section: the functions, the call syntax, the choice."""
    listed = "\n".join(json.dumps(f.tool, ensure_ascii=False) for f in use.functions)
    rules = []
    if use.choice == "required":
        rules.append("You must call one of these functions.")
    elif use.choice == "function":
        rules.append(f"You must call the function {use.named}.")
    elif use.choice == "none":
        rules.append("Do not call any of these functions now: answer in text.")
    if not use.parallel and use.choice != "none":
        rules.append("Call at most one function at a time.")
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{CLOSE}" + "".join("\n\n" + rule for rule in rules))


def call_text(name: str, arguments: object) -> str:
    """A call in this module's syntax (the arguments as given when they are a string)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def generic_messages(use: ToolUse) -> tuple[tuple[str, str], ...]:
    """The chat in the generic format: (role, content) turns any chat template renders."""
    out: list[tuple[str, str]] = []
    section = tools_section(use) if use.functions else ""
    turns = list(use.messages)
    if section:
        if turns and turns[0]["role"] == "system":
            first = turns.pop(0)["content"]
            out.append(("system", f"{first}\n\n{section}" if first else section))
        else:
            out.append(("system", section))
    after_tool = False
    for turn in turns:
        role, content = turn["role"], turn["content"]
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:  # consecutive results: one user turn
                out[-1] = ("user", f"{out[-1][1]}\n{block}")
            else:
                out.append(("user", block))
        elif turn.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]]
            out.append((role, "\n".join(([content] if content else []) + calls)))
        else:
            out.append((role, content))
        after_tool = role == "tool"
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The grammar of calls

def calls_grammar(functions: list[Function], first_index: int = 0, *, parallel: bool) -> str:
    """GBNF for one or more (``parallel``) call blocks, each naming one of ``functions`` with
    arguments their schema allows. A schema the converter cannot handle is refused naming it."""
    converter = bounded_converter()
    alternatives = []
    for i, fn in enumerate(functions, first_index):
        field = f"tools[{i}].function.parameters"
        try:
            parameters = converter.resolve_refs(copy.deepcopy(fn.parameters), f"tool-{fn.name}")
            schema = {"type": "object", "properties": {"name": {"const": fn.name}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False}
            alternatives.append(converter.visit(schema, f"call-{i}"))
        except Exception as exc:  # noqa: BLE001 - the converter's own failures, whatever their type: a 400
            raise InvalidFieldError(field, f"{field} cannot be turned into a grammar: {type(exc).__name__}: "
                                           f"{exc}") from None
    more = ' ( "\\n" call-block )*' if parallel else ""
    grammar = (strict_json_strings(converter.format_grammar()) + f"\ncall ::= {' | '.join(alternatives)}"
               f'\ncall-block ::= "{OPEN}\\n" call "\\n{CLOSE}"\nroot ::= call-block{more}\n')
    try:
        check_grammar_text(grammar)
    except InvalidRequestError as exc:
        raise InvalidFieldError("tools", f"the tools' parameter schemas give a grammar this server refuses: "
                                         f"{exc}") from None
    return grammar


# ---------------------------------------------------------------------------------------------
# Reading calls out of generated text

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_MAX_HEAD = 256  # past this, text after <tool_call> that is not a call's head is read as a whole block


class _Mode(enum.Enum):
    TEXT = "text"  # outside calls
    HEAD = "head"  # after <tool_call>, before the arguments (constrained: streamed)
    ARGUMENTS = "arguments"  # inside the arguments object, streamed as it comes
    TAIL = "tail"  # after the arguments, up to </tool_call>
    BLOCK = "block"  # a block read whole at its </tool_call> (auto: it may turn out to be text)


def _held(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class CallReader:
    """One choice's generated text in, OpenAI's chat message deltas out.

    ``constrained`` (the calls' grammar was used): a call's id and name go out as soon as its head
    is read and its arguments as they come. Otherwise a block goes out whole once closed and parsed,
    and a block that is not a call of an offered function is text. Whitespace between text and a
    call is not content. Without ``parallel``, text after the first call is content.
    """

    def __init__(self, names: frozenset[str], *, constrained: bool, parallel: bool) -> None:
        self._names = names
        self._constrained = constrained
        self._parallel = parallel
        self._mode = _Mode.TEXT
        self._buf = ""
        self._blank = ""  # trailing whitespace of the text outside calls, held until text follows
        self._content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def end(self) -> list[dict[str, Any]]:
        """The deltas held back at the end of the generation."""
        out: list[dict[str, Any]] = []
        if self._mode == _Mode.TEXT:
            self._text(self._buf, out)
        elif self._mode in (_Mode.HEAD, _Mode.BLOCK):  # never closed: a call if it parses, else text
            call = self._parse(self._buf)
            if call is not None:
                self._whole_call(*call, out)
            elif not self._constrained:
                self._text(OPEN + self._buf, out)
            # (under the calls' grammar an unfinished block is a call cut off before its name was
            # read: nothing of it is text)
        self._buf = ""
        if self._blank and not self.calls:
            self._emit_text(self._blank, out)
        self._blank = ""
        return out

    def message(self) -> dict[str, Any]:
        """The message the deltas so far join to."""
        content = "".join(self._content)
        if not self.calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None,
                "tool_calls": [copy.deepcopy(call) for call in self.calls]}

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _step(self, out: list[dict[str, Any]]) -> bool:
        """Advance over the buffer; True while there may be more to read in it."""
        if self._mode == _Mode.TEXT:
            at = self._buf.find(OPEN)
            if at >= 0 and (self._parallel or not self.calls):
                self._text(self._buf[:at], out)
                self._buf = self._buf[at + len(OPEN):]
                self._mode = _Mode.HEAD if self._constrained else _Mode.BLOCK
                return True
            keep = 0 if at >= 0 else _held(self._buf)
            self._text(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if self._mode == _Mode.HEAD:
            head = _HEAD.match(self._buf)
            if head is None or head.group(1) not in self._names:
                if head is not None or len(self._buf) > _MAX_HEAD:
                    self._mode = _Mode.BLOCK
                    return True
                return False
            self._start_call(head.group(1), out)
            self._buf = self._buf[head.end():]
            self._depth, self._in_string, self._escaped = 0, False, False
            self._mode = _Mode.ARGUMENTS
            return True
        if self._mode == _Mode.ARGUMENTS:
            end = self._scan()
            piece = self._buf if end is None else self._buf[:end]
            if piece:
                self._arguments(piece, out)
            self._buf = "" if end is None else self._buf[end:]
            if end is None:
                return False
            self._mode = _Mode.TAIL
            return True
        at = self._buf.find(CLOSE)
        if at < 0:
            if self._mode == _Mode.TAIL:  # only "}" and whitespace come before the close
                self._buf = self._buf[-(len(CLOSE) - 1):]
            return False
        block, self._buf = self._buf[:at], self._buf[at + len(CLOSE):]
        if self._mode == _Mode.BLOCK:
            call = self._parse(block)
            if call is not None:
                self._whole_call(*call, out)
            else:
                self._text(OPEN + block + CLOSE, out)
        self._mode = _Mode.TEXT
        return True

    def _scan(self) -> int | None:
        """Where the arguments object ends in the buffer (the index after its last character), or
        None if it goes on; the JSON nesting state carries over to the next piece."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1
        return None

    def _parse(self, block: str) -> tuple[str, str] | None:
        """A whole block's call (name, arguments JSON), or None if it is not a call of an offered function."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in self._names:
            return None
        arguments = call.get("arguments", call.get("parameters"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        """Text outside calls, but for its trailing whitespace: held until more text follows, it
        is dropped before a call (and after the last)."""
        self._blank += text
        kept = self._blank.rstrip()
        if kept:
            self._emit_text(kept, out)
            self._blank = self._blank[len(kept):]

    def _emit_text(self, text: str, out: list[dict[str, Any]]) -> None:
        self._content.append(text)
        out.append({"content": text})

    def _start_call(self, name: str, out: list[dict[str, Any]]) -> None:
        self._blank = ""
        call_id = "call_" + uuid.uuid4().hex[:24]
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, piece: str, out: list[dict[str, Any]]) -> None:
        self.calls[-1]["function"]["arguments"] += piece
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})

    def _whole_call(self, name: str, arguments: str, out: list[dict[str, Any]]) -> None:
        self._start_call(name, out)
        self._arguments(arguments, out)
