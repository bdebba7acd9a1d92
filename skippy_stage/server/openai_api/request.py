"""What the OpenAI API accepts: a request body, checked field by field by :func:`parse_request`,
which names the field in its message and in the error's ``param``.

Where a request leaves a field out, OpenAI's default applies, not ``Generate``'s: sampling
at temperature 1, and 16 tokens for a completion (as many as the session holds for chat).
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from skippy_stage.config import MAX_STREAM_INTERVAL_MS
from skippy_stage.errors import InvalidFieldError, InvalidRequestError
from skippy_stage.head.drafting import SpeculativeRequest
from skippy_stage.head.generator import MAX_STOP_LEN, MAX_STOP_STRINGS, GenerateSpec
from skippy_stage.model.logprobs import MAX_TOP_LOGPROBS
from skippy_stage.model.projector import MAX_IMAGE_BYTES, MEDIA_PART
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams, check_grammar_text
from skippy_stage.server.openai_api.json_grammar import schema_grammar, unenforced

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's documented default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and llama-cpp-python's) default for /v1/completions
MAX_BODY_BYTES = 32 * 1024 * 1024  # room for a few images as data: URLs
MAX_CHOICES = 128  # n; the pipeline's lane_count bounds it further
# Fields this server does not implement, with the values that mean "not used": any other
# value is refused rather than silently ignored.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
}


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated completion or chat completion request."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    max_tokens: int | None  # None: as many as one session's context holds
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    speculative: SpeculativeRequest | None = None
    top_logprobs: int | None = None  # logprobs asked: each token's, and this many alternatives
    echo: bool = False  # completions: the prompt comes back before the completion
    n: int = 1  # independent choices of the same prompt
    images: tuple[ImagePart, ...] = ()  # the chat's image_url parts, in order (their markers are in messages)

    def spec(self, max_tokens_limit: int, limit_hint: str = "", media: tuple[bytes, ...] = ()) -> GenerateSpec:
        """The Generate spec, with max_tokens checked against the pipeline's session size; ``media``: the
        images' bytes (``images`` fetched, ``fetch_images``)."""
        max_tokens = max_tokens_limit if self.max_tokens is None else self.max_tokens
        if max_tokens > max_tokens_limit:
            raise InvalidFieldError("max_tokens", f"max_tokens={max_tokens} exceeds this pipeline's limit "
                                                  f"{max_tokens_limit} ({limit_hint})")
        return GenerateSpec(prompt=self.prompt, messages=self.messages, max_tokens=max_tokens,
                            sampling=self.sampling, stop=self.stop, speculative=self.speculative,
                            top_logprobs=self.top_logprobs, prompt_logprobs=self.top_logprobs if self.echo else None,
                            max_tokens_fit=self.max_tokens is None, stream_interval_ms=self.hold_ms,
                            media=media)

    @property
    def hold_ms(self) -> float | None:
        """How long the head may hold tokens back: a response that is not streamed is read whole at
        the end, so the handler need not wake for every token (about once a second instead). Stop
        strings are seen only as tokens arrive, so a request with them takes the head's default."""
        return None if self.stream or self.stop else float(MAX_STREAM_INTERVAL_MS)


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_field(body: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldError(name, f"{name} must be an integer, got {_json_kind(value)} ({_show(value)})")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidFieldError(name, f"{name}={value} must be {bound}")
    return value


def _float_field(body: dict[str, Any], name: str, default: float, ok: Callable[[float], bool], why: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidFieldError(name, f"{name} must be a number, got {_json_kind(value)} ({_show(value)})")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise InvalidFieldError(name, f"{name}={value!r} must be {why}")
    return value


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidFieldError(name, f"{name} must be a boolean, got {_json_kind(value)} ({_show(value)})")
    return value


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` part of a chat message: its bytes (a ``data:`` URL's), or an http(s) URL the head
    fetches only where its operator allows it (``media_url_fetch``); ``where`` names the field."""

    where: str
    data: bytes | None = None
    url: str | None = None


def _image_part(part: dict[str, Any], where: str) -> ImagePart:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    field = f"{where}.image_url.url" if isinstance(image, dict) else f"{where}.image_url"
    if not isinstance(url, str):
        raise InvalidFieldError(field, f"{field} must be a string (a data: or http(s) URL), got {_json_kind(url)}")
    if url.startswith(("http://", "https://")):
        return ImagePart(field, url=url)
    match = _DATA_URL.fullmatch(url[:256]) if url.startswith("data:") else None
    if match is None:
        raise InvalidFieldError(field, f"{field}={_show(url[:64])} must be a data: URL with base64 content "
                                       f"(data:image/png;base64,...) or an http(s) URL")
    try:
        data = base64.b64decode(url[match.end("head"):], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidFieldError(field, f"{field}: the data: URL's content is not valid base64") from None
    return ImagePart(field, data=data)


_DATA_URL = re.compile(r"(?P<head>data:[\w.+-]+/[\w.+-]+(;[\w-]+=[^;,]*)*;base64,).*", re.DOTALL)


def _content(value: object, where: str, images: list[ImagePart] | None = None) -> str:
    """A message's content: a string, or a list of text parts (joined). With ``images``, ``image_url``
    parts are taken too: each becomes the media marker in the text and its image goes to ``images``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if images is not None and isinstance(part, dict) and part.get("type") == "image_url":
                images.append(_image_part(part, f"{where}.content[{j}]"))
                texts.append(MEDIA_PART)
                continue
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kinds = "a text part {\"type\": \"text\", \"text\": \"...\"}" + (
                    " or an image part {\"type\": \"image_url\", \"image_url\": {\"url\": \"...\"}}"
                    if images is not None else "")
                raise InvalidFieldError(f"{where}.content[{j}]", f"{where}.content[{j}]={_show(part)} must be {kinds}")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidFieldError(f"{where}.content", f"{where}.content must be a string or an array of text parts, "
                            f"got {_json_kind(value)}")


def _messages(value: object, images: list[ImagePart] | None = None) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _json_kind(value)
        raise InvalidFieldError("messages", f"messages must be a non-empty array of {{role, content}} objects, got {got}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidFieldError(where, f"{where} must be a {{role, content}} object, got {_json_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidFieldError(f"{where}.role", f"{where}.role={_show(role)} must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""  # a turn of tool calls only (``tools`` checks them)
        out.append((role, _content(content, where, images)))
    return tuple(out)


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one prompt
    if not isinstance(value, str):
        raise InvalidFieldError("prompt", f"prompt must be a string (batches of prompts and token ids are not "
                                f"supported), got {_json_kind(value)}")
    if not value:
        raise InvalidFieldError("prompt", "prompt is empty")
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise InvalidFieldError("stop", f"stop must be a string or an array of strings, got {_json_kind(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidFieldError("stop", f"stop has {len(stops)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise InvalidFieldError("stop", f"stop[{i}]={_show(s)} must be a string of 1..{MAX_STOP_LEN} characters")
    return tuple(stops)


def _speculative(value: object) -> SpeculativeRequest | None:
    """This server's extension: ``speculative: {drafter, k, ngram, adaptive}`` (the head's settings
    for whatever is left out); checked against them when the generation starts. ``k`` a number is
    fixed drafting (llama-cpp-python's ``num_pred_tokens``), ``"auto"`` adaptive drafting."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidFieldError("speculative", f"speculative must be an object, got {_json_kind(value)}")
    unknown = sorted(set(value) - {"drafter", "k", "ngram", "adaptive"})
    if unknown:
        raise InvalidFieldError("speculative", f"speculative has unknown key(s) {', '.join(unknown)}")
    drafter = value.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise InvalidFieldError("speculative", f"speculative.drafter must be a string, got {_json_kind(drafter)}")
    adaptive = value.get("adaptive")
    if adaptive is not None and not isinstance(adaptive, bool):
        raise InvalidFieldError("speculative", f"speculative.adaptive must be a boolean, got {_json_kind(adaptive)}")
    k = value.get("k")
    try:
        if k != "auto":  # a number: fixed drafting
            k = _int_field(value, "k", low=1)
        ngram = _int_field(value, "ngram", low=1)
    except InvalidFieldError as exc:
        raise InvalidFieldError("speculative", f"speculative.{exc}") from None
    return SpeculativeRequest(drafter=drafter, k=k, ngram=ngram, adaptive=adaptive)


# llama-cpp-python's converter writes one grammar item (a nested group) per unit of these
MAX_SCHEMA_REPEAT = 256


def _check_schema_bounds(node: object, where: str, param: str = "response_format") -> None:
    """Refuse, before converting, the bounds the converter would expand into a grammar as large as
    they are (minLength/maxLength/minItems/maxItems, a pattern's {n,m}), naming the field (``param``)."""
    if isinstance(node, dict):
        ignored = unenforced(node)
        if ignored is not None:
            raise InvalidFieldError(param, f"{where}.{ignored}={_show(node[ignored])} is not kept by this server's "
                                           f"grammar (only an integer's minimum and maximum are): remove it")
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SCHEMA_REPEAT:
                raise InvalidFieldError(param, f"{where}.{key}={value} is more than this server's "
                                               f"{MAX_SCHEMA_REPEAT}")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for match in re.finditer(r"\{(\d+)(?:,(\d*))?\}", pattern):
                if any(int(n) > MAX_SCHEMA_REPEAT for n in match.groups() if n):
                    raise InvalidFieldError(param, f"{where}.pattern repeats {match.group(0)}: at most "
                                                   f"{MAX_SCHEMA_REPEAT}")
        for key, value in node.items():
            _check_schema_bounds(value, f"{where}.{key}", param)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_schema_bounds(value, f"{where}[{i}]", param)


# A JSON string's characters: no raw control characters (JSON parsers refuse them).
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def strict_json_strings(grammar: str) -> str:
    """``grammar`` (from llama-cpp-python's JSON-schema converter) with JSON strings that parse: its
    ``char`` rule lets raw control characters into strings (seen at temperature 0.9), which
    llama.cpp's own converter leaves out, and so does this."""
    return "\n".join(_JSON_CHAR if line.startswith("char ::= ") else line for line in grammar.splitlines())


def _response_format(value: object) -> str:
    """The GBNF grammar for ``response_format`` ("" for text): ``json_object`` is llama.cpp's JSON
    grammar, ``json_schema`` goes through llama-cpp-python's JSON-schema converter; a schema it
    cannot handle is refused by name, never ignored."""
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidFieldError("response_format", f"response_format must be an object with a type, got {_show(value)}")
    kind = value["type"]
    if kind == "text":
        return ""
    from llama_cpp import llama_grammar

    if kind == "json_object":
        return llama_grammar.JSON_GBNF
    if kind != "json_schema":
        raise InvalidFieldError("response_format", f"response_format.type={kind!r} must be text, json_object or "
                                                   f"json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidFieldError("response_format", "response_format.json_schema.schema must be a JSON schema object")
    _check_schema_bounds(spec["schema"], "response_format.json_schema.schema")
    try:
        grammar = strict_json_strings(schema_grammar(copy.deepcopy(spec["schema"])))
    except Exception as exc:  # noqa: BLE001 - the converter's own failures, whatever their type: a 400 naming it
        raise InvalidFieldError("response_format", f"response_format.json_schema.schema cannot be turned into a "
                                                   f"grammar: {type(exc).__name__}: {exc}") from None
    try:
        check_grammar_text(grammar)
    except InvalidRequestError as exc:
        raise InvalidFieldError("response_format", f"response_format.json_schema.schema gives a grammar this "
                                                   f"server refuses: {exc}") from None
    return grammar


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``; the ids are checked against the vocabulary at the final stage."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidFieldError("logit_bias", f"logit_bias must be an object of token ids, got {_json_kind(value)}")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit()) or abs(int(key)) >= 2**31:
            raise InvalidFieldError("logit_bias", f"logit_bias key {_show(key)} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidFieldError("logit_bias", f"logit_bias[{key}]={_show(bias)} must be a number in [-100, 100]")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _echo(body: dict[str, Any], *, chat: bool) -> bool:
    echo = _bool_field(body, "echo")
    if echo and chat:
        raise InvalidFieldError("echo", "echo is a completions option; chat completions do not take it")
    return echo


def parse_request(body: object, *, chat: bool) -> OpenAIRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body, field by field."""
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                         for v in neutral):
            raise InvalidFieldError(name, f"{name}={_show(value)} is not supported by this server")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidFieldError("model", f"model must be a string, got {_json_kind(body['model'])}")
    images: list[ImagePart] = []
    if chat:
        if "messages" not in body:
            raise InvalidFieldError("messages", "messages is required")
        prompt, messages = None, _messages(body["messages"], images)
        max_tokens = _int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_completion_tokens", low=1)
    else:
        if "prompt" not in body:
            raise InvalidFieldError("prompt", "prompt is required")
        prompt, messages = _prompt(body["prompt"]), ()
        max_tokens = _int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _float_field(body, "temperature", DEFAULT_TEMPERATURE, lambda t: t >= 0, ">= 0")
    top_p = _float_field(body, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]")
    seed = _int_field(body, "seed", low=0, high=RANDOM_SEED)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidFieldError("stream_options", f"stream_options must be an object, got {_json_kind(options)}")
    include_usage = _bool_field(options or {}, "include_usage")
    if chat:
        wants = _bool_field(body, "logprobs")
        top = _int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if top and not wants:
            raise InvalidFieldError("top_logprobs", "top_logprobs needs logprobs: true")
        top_logprobs = (top or 0) if wants else None
    else:
        value = body.get("logprobs")
        top_logprobs = None if value is None or value is False else _int_field(body, "logprobs", low=0,
                                                                                 high=MAX_TOP_LOGPROBS)
    in_range = lambda v: -2.0 <= v <= 2.0  # noqa: E731
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=RANDOM_SEED if seed is None else seed,
                              grammar=_response_format(body.get("response_format")),
                              frequency_penalty=_float_field(body, "frequency_penalty", 0.0, in_range, "in [-2, 2]"),
                              presence_penalty=_float_field(body, "presence_penalty", 0.0, in_range, "in [-2, 2]"),
                              logit_bias=_logit_bias(body.get("logit_bias")))
    return OpenAIRequest(prompt=prompt, messages=messages, max_tokens=max_tokens, sampling=sampling.validate(),
                         stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
                         speculative=_speculative(body.get("speculative")), top_logprobs=top_logprobs,
                         echo=_echo(body, chat=chat),
                         n=_int_field(body, "n", low=1, high=MAX_CHOICES) or 1, images=tuple(images))


FETCH_TIMEOUT_S = 10.0


def fetch_images(images: tuple[ImagePart, ...], *, allow_urls: bool) -> tuple[bytes, ...]:
    """Every image's bytes: a data: URL's as given, an http(s) URL's fetched (at most
    ``MAX_IMAGE_BYTES``, ``FETCH_TIMEOUT_S``) where ``allow_urls``, else refused naming the field.
    Blocking: run it off the event loop."""
    out = []
    for image in images:
        if image.data is not None:
            out.append(image.data)
            continue
        if not allow_urls:
            raise InvalidFieldError(image.where, f"{image.where}: this server does not fetch http(s) image URLs "
                                                 f"(media_url_fetch is off); send the image as a data: URL")
        out.append(_fetch(image))
    return tuple(out)


def _fetch(image: ImagePart) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(image.url, headers={"User-Agent": "skippy-stage"}),
                                    timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InvalidFieldError(image.where, f"{image.where}={_show(image.url)} could not be fetched: "
                                             f"{getattr(exc, 'reason', exc)}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidFieldError(image.where, f"{image.where}={_show(image.url)} is larger than {MAX_IMAGE_BYTES} bytes")
    return data


async def _read_json(request: Request) -> object:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise InvalidFieldError(None, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidFieldError(None, f"the request body is not valid JSON: {exc}") from None
