"""The Anthropic Messages API at the head (/v1/messages), checked with the official ``anthropic`` client.

Every test runs against real ``serve`` processes: SmolLM2 split 0:10 / 10:20 / 20:30 with the API
on the head and a token configured. The contract:

* with temperature 0, a message's text is what llama-cpp-python's ``create_chat_completion`` gives
  on the unsplit model for the same conversation (the system prompt as a system turn);
* a stream's text deltas concatenate to the message's text, in exactly Anthropic's event order;
* ``stop_sequences`` end the text before the sequence with ``stop_reason: "stop_sequence"``,
  ``max_tokens`` with ``"max_tokens"``, the end of the turn with ``"end_turn"``;
* with ``tools``, a call comes back as a ``tool_use`` block (``stop_reason: "tool_use"``) whose input
  validates against its schema and equals the call chat completions gives for the same conversation;
  streamed, its input arrives as ``input_json_delta`` fragments that join to it; a ``tool_result``
  turn is answered;
* every field this server does not implement is refused by name, in Anthropic's error shape;
* the token is accepted as ``x-api-key`` as well as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from skippy_stage.cli.local import free_ports
from skippy_stage.errors import CapacityError, DownstreamError, InvalidFieldError
from skippy_stage.model.loader import reference_llama
from skippy_stage.server.openai_api.anthropic_messages import anthropic_error_response

RANGES = [(0, 10), (10, 20), (20, 30)]
STAGE_OPTIONS = {"n_threads": 1, "kv_unified": False}
TOKEN = "s3cret-token"
MAX_TOKENS = 24
GREEDY = {"temperature": 0}  # anthropic 2.x's create() has no temperature argument: it goes in the body
# (system, messages) in Anthropic's form
CHATS = [
    (None, [{"role": "user", "content": "What is the capital of France?"}]),
    ("You answer in one short sentence.", [{"role": "user", "content": [{"type": "text", "text": "Why is the "},
                                                                         {"type": "text", "text": "sea salty?"}]}]),
    ([{"type": "text", "text": "You are terse."}],
     [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
      {"role": "user", "content": "Name another one."}]),
]


def openai_messages(system, messages) -> list[dict]:
    """The same conversation as chat completion messages."""
    def text(content):
        return content if isinstance(content, str) else "".join(block["text"] for block in content)
    out = [{"role": "system", "content": text(system)}] if system else []
    return out + [{"role": m["role"], "content": text(m["content"])} for m in messages]


@pytest.fixture(scope="module")
def reference(smollm2):
    """What llama-cpp-python answers on the unsplit model, greedy: each chat, and the first with a stop
    sequence taken from the middle of its own answer."""
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        chats = [llm.create_chat_completion(openai_messages(*chat), temperature=0, max_tokens=MAX_TOKENS)
                 for chat in CHATS]
        words = chats[0]["choices"][0]["message"]["content"].split()
        assert len(words) > 3, chats[0]
        stop = " " + words[2]
        stopped = llm.create_chat_completion(openai_messages(*CHATS[0]), temperature=0, max_tokens=MAX_TOKENS,
                                             stop=[stop])
        return {"chats": chats, "stop": stop, "stopped": stopped}
    finally:
        llm.close()


@pytest.fixture(scope="module")
def api(smollm2, start_pipeline, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, RANGES, http_port=[port, None, None], auth_token_path=str(token_file),
                              **STAGE_OPTIONS)
    yield f"http://127.0.0.1:{port}"
    pipeline.stop()


@pytest.fixture(scope="module")
def client(api):
    return anthropic.Anthropic(base_url=api, api_key=TOKEN, max_retries=0, timeout=60)


def create(client, system, messages, **kwargs):
    if system is not None:
        kwargs["system"] = system
    return client.messages.create(model="m", messages=messages, **kwargs)


def raw_post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def assert_error_shape(body: dict, error_type: str, *words: str) -> None:
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    for word in words:
        assert word in body["error"]["message"], body


def test_greedy_message_equals_llama_cpp_create_chat_completion(client, reference, smollm2):
    for (system, messages), expected in zip(CHATS, reference["chats"]):
        message = create(client, system, messages, max_tokens=MAX_TOKENS, extra_body=GREEDY)
        want = expected["choices"][0]
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == want["message"]["content"]
        assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want["finish_reason"]]
        assert message.stop_sequence is None
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
        assert usage.output_tokens == expected["usage"]["completion_tokens"]
        assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
        assert message.model == smollm2.name


def test_a_stream_concatenates_to_the_message_in_anthropics_event_order(client, api):
    system, messages = CHATS[1]
    whole = create(client, system, messages, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    with client.messages.stream(model="m", system=system, messages=messages, max_tokens=MAX_TOKENS,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The same prompt again: all of it but the last token comes from a resident prefix.
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    assert final.usage.cache_read_input_tokens == total - 1

    body = {"model": "m", "system": system, "messages": messages, "max_tokens": 6, "stream": True, **GREEDY}
    status, headers, raw = raw_post(f"{api}/v1/messages", body, {"x-api-key": TOKEN})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in raw.decode().split("\n\n"):
        if chunk:
            kind, data = chunk.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    kinds = [kind for kind, _ in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == kind for kind, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["delta"]["type"] for k, d in events if k == "content_block_delta"} == {"text_delta"}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 6


def test_stop_sequences_end_the_text_before_the_sequence(client, reference):
    system, messages = CHATS[0]
    stop = reference["stop"]
    expected = reference["stopped"]["choices"][0]["message"]["content"]
    message = create(client, system, messages, max_tokens=MAX_TOKENS, stop_sequences=["never here", stop],
                     extra_body=GREEDY)
    assert message.content[0].text == expected
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(model="m", messages=messages, max_tokens=MAX_TOKENS, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == (expected, "stop_sequence", stop)


def test_max_tokens_ends_with_stop_reason_max_tokens(client):
    system, messages = CHATS[1]
    message = create(client, system, messages, max_tokens=3, extra_body=GREEDY)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert message.content[0].text


def test_count_tokens_counts_the_rendered_conversation(client, reference):
    for (system, messages), expected in zip(CHATS, reference["chats"]):
        kwargs = {"system": system} if system is not None else {}
        counted = client.messages.count_tokens(model="m", messages=messages, **kwargs)
        assert counted.input_tokens == expected["usage"]["prompt_tokens"]


USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tools": [{"name": "f"}]}, ["tools[0].input_schema"]),
        ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, ["tools[0].input_schema", "object"]),
        ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]}, ["tools[0].name"]),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["tools[0].type", "server tools"]),
        ({"tool_choice": {"type": "sometimes"}}, ["tool_choice"]),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
         ["tool_choice", "'g'"]),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         ["messages[0].content[0].type", "tool_use", "assistant"]),
        ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                 "input": {}}]},
                       {"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]},
         ["messages[2].content[0].tool_use_id"]),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, ["thinking"]),
        ({"extra_body": {"frobnicate": 1}}, ["frobnicate"]),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
         ["messages[0].content[0].source.data", "no projector_path"]),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
         ["messages[0].content[0].source", "base64"]),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         ["messages[0].content[0].type", "document"]),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, ["messages[0].role", "user"]),
        ({"messages": [*USER, *USER]}, ["messages[1].role", "alternate"]),
        ({"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, ["messages[1].role", "prefill"]),
        ({"messages": [{"role": "system", "content": "Hi"}]}, ["messages[0].role"]),
        ({"messages": []}, ["messages"]),
        ({"system": [{"type": "image"}]}, ["system[0].type"]),
        ({"max_tokens": 0}, ["max_tokens=0"]),
        ({"max_tokens": 10**9}, ["max_tokens=1000000000", "limit"]),
        ({"extra_body": {"temperature": 1.5}}, ["temperature=1.5"]),
        ({"extra_body": {"top_p": 0}}, ["top_p"]),
        ({"extra_body": {"top_k": -1}}, ["top_k=-1"]),
        ({"stop_sequences": [""]}, ["stop_sequences[0]"]),
        ({"extra_body": {"stream": "yes"}}, ["stream"]),
    ],
)
def test_unsupported_or_bad_fields_are_refused_by_name_in_anthropics_shape(client, kwargs, words):
    kwargs = {"messages": USER, "max_tokens": 4, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="m", **kwargs)
    assert caught.value.status_code == 400
    assert_error_shape(caught.value.response.json(), "invalid_request_error", *words)


def test_a_missing_max_tokens_and_an_unknown_path_get_anthropics_shape(api):
    status, _, raw = raw_post(f"{api}/v1/messages", {"model": "m", "messages": USER}, {"x-api-key": TOKEN})
    assert status == 400
    assert_error_shape(json.loads(raw), "invalid_request_error", "max_tokens")
    status, _, raw = raw_post(f"{api}/v1/messages/batches", {}, {"x-api-key": TOKEN})
    assert status == 404
    assert_error_shape(json.loads(raw), "not_found_error")


def test_the_token_is_accepted_as_x_api_key_and_a_wrong_one_gets_401_in_anthropics_shape(api):
    body = {"model": "m", "messages": USER, "max_tokens": 2, **GREEDY}
    status, _, raw = raw_post(f"{api}/v1/messages", body, {"x-api-key": TOKEN})
    assert status == 200 and json.loads(raw)["type"] == "message"
    status, _, raw = raw_post(f"{api}/v1/messages", body, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    for headers in ({"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {}):
        status, _, raw = raw_post(f"{api}/v1/messages", body, headers)
        assert status == 401
        assert_error_shape(json.loads(raw), "authentication_error", "x-api-key")
    # the client sending the key in either header
    keyed = anthropic.Anthropic(base_url=api, api_key=None, default_headers={"x-api-key": TOKEN}, max_retries=0)
    assert keyed.messages.create(model="m", messages=USER, max_tokens=2).content
    wrong = anthropic.Anthropic(base_url=api, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="m", messages=USER, max_tokens=2)
    assert caught.value.status_code == 401
    assert_error_shape(caught.value.response.json(), "authentication_error")
    # the OpenAI API's errors keep their own shape
    status, _, raw = raw_post(f"{api}/v1/chat/completions", {"messages": USER}, {"x-api-key": "wrong"})
    assert status == 401 and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (InvalidFieldError("max_tokens", "max_tokens is required"), 400, "invalid_request_error"),
        (CapacityError("all execution lanes are busy and the admission queue is full"), 529, "overloaded_error"),
        (DownstreamError("stage-2 is not ready", stage_id="stage-2"), 503, "api_error"),
    ],
)
def test_domain_errors_map_to_anthropics_statuses(exc, status, error_type):
    response = anthropic_error_response(exc)
    assert response.status_code == status
    assert_error_shape(json.loads(response.body), error_type, str(exc))
    assert ("retry-after" in response.headers) == (status >= 500)


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def tool_uses(content) -> list[tuple[str, dict]]:
    return [(block.name, block.input) for block in content if block.type == "tool_use"]


def test_a_tool_call_is_a_tool_use_block_equal_to_chat_completions_call_streamed_or_not(client, api):
    """``tool_choice: any`` (chat completions' ``required``): one call whose input validates, the same
    call the OpenAI API gives for the same conversation, and the same when streamed."""
    kwargs = {"max_tokens": 48, "tools": [WEATHER], "extra_body": GREEDY,
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    whole = create(client, None, QUESTION, **kwargs)
    assert whole.stop_reason == "tool_use"
    [(name, arguments)] = tool_uses(whole.content)
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["input_schema"])
    assert all(block.id.startswith("toolu_") for block in whole.content if block.type == "tool_use")

    chat = openai.OpenAI(base_url=f"{api}/v1", api_key=TOKEN, max_retries=0, timeout=60).chat.completions.create(
        model="m", messages=QUESTION, max_tokens=48, temperature=0, tool_choice="required", parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}])
    [call] = chat.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, arguments)

    with client.messages.stream(model="m", messages=QUESTION, **kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and tool_uses(streamed.content) == [(name, arguments)]
    fragments = [e.delta.partial_json for e in events
                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert fragments and json.loads("".join(fragments)) == arguments


def test_a_tool_result_turn_is_answered_and_streams_as_it_is_answered_whole(client):
    """The call → result → answer round: the assistant's tool_use and the user's tool_result go back
    in; with tool_choice none the model answers in text, the same streamed or not."""
    first = create(client, None, QUESTION, max_tokens=48, tools=[WEATHER], extra_body=GREEDY,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    use = next(block for block in first.content if block.type == "tool_use")
    history = [*QUESTION, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "18 degrees celsius and sunny"}]}]
    kwargs = {"max_tokens": 24, "tools": [WEATHER], "tool_choice": {"type": "none"}, "extra_body": GREEDY}
    answer = create(client, None, history, **kwargs)
    assert answer.stop_reason in ("end_turn", "max_tokens") and not tool_uses(answer.content)
    text = "".join(block.text for block in answer.content if block.type == "text")
    assert text
    with client.messages.stream(model="m", messages=history, **kwargs) as stream:
        assert "".join(stream.text_stream) == text
    counted = client.messages.count_tokens(model="m", messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
