"""OpenAI's Responses API at the head (/v1/responses), checked with the official ``openai`` client
against real ``serve`` processes (SmolLM2 split 0:10 / 10:20 / 20:30, the API on the head). The
contract:

* a Responses request is a chat completion in another shape: with temperature 0 its text is what
  /v1/chat/completions answers on the same messages (``instructions`` a system turn first), and
  what llama-cpp-python's ``create_chat_completion`` gives on the unsplit model; the answer parses
  as the ``openai`` package's own ``Response`` model;
* a stream comes as the documented events, numbered in order, and its deltas join to the answer
  the same request gets whole; a tool conversation (function_call → function_call_output →
  answer) runs the same streamed and not;
* ``previous_response_id`` continues a stored conversation: the same text as sending the whole
  history, its prefix read from the resident prefix (``cached_tokens``); an unknown id is a 404
  naming it; ``GET``/``DELETE`` find stored responses; ``store: false`` keeps nothing;
* ``max_output_tokens`` ends a response ``incomplete`` with its reason, and ``text.format``
  json_schema output validates against the schema;
* every field this server does not implement is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from skippy_stage.cli.local import free_ports
from skippy_stage.head.generator import Finish
from skippy_stage.model.loader import reference_llama
from skippy_stage.server.openai_api.responses_api import ResponseOutput, ResponseStore, StoredResponse
from skippy_stage.server.openai_api.responses_request import chat_messages, parse_responses_request
from skippy_stage.server.openai_api.tools import CallReader

RANGES = [(0, 10), (10, 20), (20, 30)]
# One llama.cpp thread per stage (three share the machine's cores); a stage busy under a grammar
# gets 5 s to answer its upstream's health probe.
STAGE_OPTIONS = {"n_threads": 1, "kv_unified": False, "health_probe_s": 5.0}
MAX_TOKENS = 24
INSTRUCTIONS = "You answer in one short sentence."
QUESTION = "Why is the sea salty?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "get weather.", "parameters": WEATHER_SCHEMA,
           "strict": True}
WEATHER_QUESTION = "What is the weather like in Paris today?"
WEATHER_RESULT = json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def api(start_pipeline, smollm2):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, RANGES, http_port=[port, None, None], **STAGE_OPTIONS)
    yield f"http://127.0.0.1:{port}/v1"
    pipeline.stop()


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(smollm2):
    """What llama-cpp-python answers on the unsplit model, greedy."""
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    try:
        return llm.create_chat_completion([{"role": "system", "content": INSTRUCTIONS},
                                           {"role": "user", "content": QUESTION}], temperature=0,
                                          max_tokens=MAX_TOKENS)
    finally:
        llm.close()


def as_input(items) -> list[dict]:
    """A response's output items, sent back as input (as agents do)."""
    return [item.model_dump(exclude_none=True) for item in items]


def event_types(events) -> list[str]:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events]


# ---- text ------------------------------------------------------------------------------------

def test_greedy_text_equals_chat_completions_and_llama_cpp(client, reference):
    raw = client.responses.with_raw_response.create(model="m", instructions=INSTRUCTIONS, input=QUESTION,
                                                    temperature=0, max_output_tokens=MAX_TOKENS)
    Response.model_validate(json.loads(raw.text))  # every field the openai package requires, in its types
    response = raw.parse()
    chat = client.chat.completions.create(model="m", messages=[{"role": "system", "content": INSTRUCTIONS},
                                                               {"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=MAX_TOKENS)
    expected = reference["choices"][0]
    assert response.output_text == chat.choices[0].message.content == expected["message"]["content"]
    assert response.status == ("incomplete" if expected["finish_reason"] == "length" else "completed")
    assert response.id.startswith("resp_") and response.object == "response" and response.instructions == INSTRUCTIONS
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        reference["usage"]["prompt_tokens"], reference["usage"]["completion_tokens"],
        reference["usage"]["total_tokens"])
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_a_stream_comes_in_the_documented_order_and_joins_to_the_whole_answer(client):
    kwargs = dict(model="m", instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:  # the openai package's own accumulator checks the events
        events = list(stream)
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    types = event_types(events)
    deltas = types.count("response.output_text.delta")
    end = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert deltas > 1 and types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", end]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    assert text == whole.output_text == events[-4].text == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id


def test_each_event_is_sent_as_event_and_data_lines(api):
    body = json.dumps({"input": QUESTION, "max_output_tokens": 3, "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(f"{api}/responses", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        blocks = answer.read().decode().strip().split("\n\n")
    for n, block in enumerate(blocks):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == event[len("event: "):] and payload["sequence_number"] == n
    assert json.loads(blocks[-1].split("\n")[1][6:])["type"] == "response.incomplete"


def test_max_output_tokens_ends_incomplete_with_its_reason(client):
    kwargs = dict(model="m", input="Write a long story about the sea.", temperature=0, max_output_tokens=5)
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[-1].status == "incomplete"
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


def test_json_schema_output_validates(client):
    for temperature in (0.0, 0.9):
        response = client.responses.create(
            model="m", input="Invent a person: give a name and an age.", temperature=temperature,
            max_output_tokens=64, text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                    "strict": True}})
        assert response.status == "completed" and response.text.format.type == "json_schema"
        jsonschema.validate(json.loads(response.output_text), PERSON)


# ---- tool calls ------------------------------------------------------------------------------

def _create(client: openai.OpenAI, body: dict, *, stream: bool):
    """The Response of ``body``: whole, or the last event's of its stream (with the events)."""
    if not stream:
        return client.responses.create(**body), None
    events = list(client.responses.create(**body, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response, events


def test_a_tool_conversation_in_two_turns_streamed_and_not(client):
    question = [{"role": "user", "content": WEATHER_QUESTION}]
    first = dict(model="m", input=question, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                 temperature=0, max_output_tokens=64)
    calls, texts = [], []
    for stream in (False, True):
        response, events = _create(client, first, stream=stream)
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and response.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
        if stream:
            types = event_types(events)
            fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            assert len(fragments) > 1 and "".join(fragments) == call.arguments
            assert types == ["response.created", "response.in_progress", "response.output_item.added",
                             *["response.function_call_arguments.delta"] * len(fragments),
                             "response.function_call_arguments.done", "response.output_item.done",
                             "response.completed"]
            assert events[2].item.name == "get_weather" and events[2].item.arguments == ""
        calls.append((call.name, call.arguments))
        second = dict(model="m", tools=[WEATHER], temperature=0, max_output_tokens=16,
                      input=[*question, *as_input(response.output),
                             {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}])
        answer, _ = _create(client, second, stream=stream)
        [message] = answer.output
        assert message.type == "message" and answer.output_text
        texts.append(answer.output_text)
        # the same second turn from the stored first one
        continued, _ = _create(client, {**second, "previous_response_id": response.id,
                                        "input": second["input"][-1:]}, stream=stream)
        assert continued.output_text == answer.output_text
        assert continued.usage.input_tokens == answer.usage.input_tokens
    assert calls[0] == calls[1] and texts[0] == texts[1]


# ---- stored responses ------------------------------------------------------------------------

def test_previous_response_id_gives_the_whole_historys_text_from_the_resident_prefix(client):
    first = client.responses.create(model="m", input="Name a colour.", temperature=0, max_output_tokens=12)
    follow = client.responses.create(model="m", previous_response_id=first.id, input="Name another one.",
                                     temperature=0, max_output_tokens=12)
    assert follow.previous_response_id == first.id
    # the first turn's prompt is read from its resident prefix, not computed again
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1 > 0
    whole = client.responses.create(model="m", temperature=0, max_output_tokens=12, store=False,
                                    input=[{"role": "user", "content": "Name a colour."}, *as_input(first.output),
                                           {"role": "user", "content": "Name another one."}])
    assert whole.output_text == follow.output_text and whole.usage.input_tokens == follow.usage.input_tokens
    # chained once more, from the second
    third = client.responses.create(model="m", previous_response_id=follow.id, input="And one more.",
                                    temperature=0, max_output_tokens=4)
    assert third.usage.input_tokens > follow.usage.input_tokens + follow.usage.output_tokens
    # GET finds a stored response, DELETE forgets it; store: false keeps nothing
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    client.responses.delete(follow.id)
    for gone in (follow.id, whole.id):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id=follow.id, input="x", max_output_tokens=2)


def test_an_unknown_previous_response_id_gets_404_naming_it(client):
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="m", input="hi", previous_response_id="resp_never_stored",
                                    max_output_tokens=4, stream=stream)
        error = refused.value.response.json()["error"]
        assert error["param"] == "previous_response_id" and error["type"] == "invalid_request_error"
        assert "resp_never_stored" in error["message"] and error["code"] == "previous_response_not_found"


def test_the_store_forgets_the_oldest_first():
    def stored(text: str) -> StoredResponse:
        items = ({"type": "message", "role": "user", "content": text},)
        return StoredResponse(response={}, conversation=items, chars=len(text) + len("messageuser"))

    store = ResponseStore(max_responses=2, max_chars=100)
    for name in ("a", "b", "c"):
        assert store.put(name, stored("x"))
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    assert store.put("d", stored("y" * 80)) and store.get("b") is None and store.get("c") is None
    assert not store.put("e", stored("z" * 200)) and store.get("d")
    assert store.delete("d") and not store.delete("d") and len(store) == 0


# ---- the conversation as chat, and the output items (no server) --------------------------------

def test_items_become_the_chat_the_chat_path_renders():
    parsed = parse_responses_request({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use metric units."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check.",
                                                               "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": " Done."},  # text after its call: one turn, as chat's
    ]})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
             for i, args in ((1, '{"city": "Paris"}'), (2, '{"city": "Rome"}'))]
    assert chat_messages(parsed.items, parsed.instructions) == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25"},
        {"role": "assistant", "content": " Done.", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]


def test_output_items_and_their_events_from_text_and_calls():
    text = 'Checking.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    output = ResponseOutput(CallReader(frozenset({"f"}), constrained=False, parallel=True))
    events = [e for ch in text for e in output.feed(ch)]
    events += output.end(Finish(reason="stop", prompt_tokens=1, completion_tokens=1, session_id="s"))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len("Checking."), "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    message, call = output.items
    assert message["content"][0]["text"] == "Checking." and message["status"] == "completed"
    assert (call["name"], call["arguments"], call["status"]) == ("f", '{"a": 1}', "completed")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]


# ---- refusals --------------------------------------------------------------------------------

FN = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1].image_url"),  # (a head without a projector, or media_url_fetch off)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "42"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "42"}]}, "input[0].role"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 100000}}}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "maxLength": 100000}}}},
     "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [FN], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"store": "yes"}, "store"),
])
def test_unsupported_or_bad_fields_get_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="hi", max_output_tokens=4, extra_body=extra)
    error = refused.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[-1].split("[")[0] in error["message"]
