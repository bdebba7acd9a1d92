"""Tool calls on /v1/chat/completions, checked with the official ``openai`` client against real
``serve`` processes. The contract:

* a tool conversation runs in two turns (call → tool result → answer), and a streamed answer's
  ``tool_calls`` deltas (index, id, type and name first, then ``arguments`` fragments) join to
  the answer the same request gets whole, with ``finish_reason: "tool_calls"``;
* with ``tool_choice: "required"`` or a named function every answer is a call of an offered (or
  that) function whose ``arguments`` validate against its schema, greedy or sampled; with
  ``"none"`` no answer has calls;
* bad tools, tool choices and tool messages get a 400 naming the field;
* the prompt is the model's own chat template rendered with ``tools`` and the tool turns when
  the template knows them (a ChatML template in the shape of Qwen 2.5's, written into a copy of
  SmolLM2's GGUF), else SmolLM2's template over the generic format's messages: the prompt
  token count, and the greedy text of llama-cpp-python on the unsplit model fed that prompt,
  are the server's.

The tools' system section is the same in most requests: resident prefixes keep its prefill to one.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jinja2
import jinja2.sandbox
import jsonschema
import openai
import pytest
from gguf import GGUFReader, GGUFValueType

from skippy_stage.cli.local import free_ports
from skippy_stage.model import gguf_file
from skippy_stage.model.loader import reference_llama
from skippy_stage.server.openai_api.tools import CallReader, template_knows_tools

RANGES = [(0, 10), (10, 20), (20, 30)]
# The cores are shared with other test processes: a stage busy sampling under a grammar gets 5 s to
# answer its upstream's health probe (1 s by default) before the head calls the chain down.
STAGE_OPTIONS = {"n_threads": 1, "kv_unified": False, "health_probe_s": 5.0}
TOOLS_TEMPLATE = Path(__file__).resolve().parent.parent / "fixtures" / "chatml-tools.jinja"

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "add_numbers": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"], "additionalProperties": False},
    "send_email": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 32},
                                                    "subject": {"type": "string", "maxLength": 32},
                                                    "urgent": {"type": "boolean"}},
                   "required": ["to", "subject"], "additionalProperties": False},
    "find_books": {"type": "object", "properties": {"topics": {"type": "array", "minItems": 1, "maxItems": 3,
                                                               "items": {"type": "string", "maxLength": 16}},
                                                    "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["topics"], "additionalProperties": False},
}
QUESTIONS = {"get_weather": "What is the weather like in Paris today?", "add_numbers": "What is 17 plus 25?",
             "send_email": "Email bob@example.com to say the meeting moved to Friday.",
             "find_books": "Find me some books about the sea and about ships."}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}.",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]
WEATHER = [TOOLS[0]]
WEATHER_RESULT = json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def api(start_pipeline, smollm2):
    """SmolLM2, whose chat template does not know tools: the generic format."""
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, RANGES, http_port=[port, None, None], **STAGE_OPTIONS)
    yield _client(f"http://127.0.0.1:{port}/v1")
    pipeline.stop()


@pytest.fixture(scope="module")
def tools_model(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's GGUF with a chat template that knows tools (same ChatML tokens)."""
    dest = tmp_path_factory.mktemp("tools-model") / "SmolLM2-tools-template.gguf"
    reader = GGUFReader(str(smollm2))
    template = TOOLS_TEMPLATE.read_text()
    metadata = [(f.name, gguf_file.pack_value(GGUFValueType.STRING, template) if f.name == "tokenizer.chat_template"
                 else gguf_file.raw_value(f)) for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    tensors = [gguf_file.tensor_from_reader(reader, t, t.name) for t in reader.tensors]
    alignment = reader.fields.get("general.alignment")
    gguf_file.write_gguf(dest, metadata, tensors,
                         alignment=int(alignment.parts[-1][0]) if alignment else gguf_file.DEFAULT_ALIGNMENT)
    return dest


@pytest.fixture(scope="module")
def native_api(start_pipeline, tools_model):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(tools_model, [(0, 15), (15, 30)], http_port=[port, None], **STAGE_OPTIONS)
    yield _client(f"http://127.0.0.1:{port}/v1")
    pipeline.stop()


def joined_calls(chunks: list) -> tuple[list[dict], list[str | None]]:
    """A stream's tool_calls deltas joined per index, and its finish reasons; checks OpenAI's
    shape: id, type and name only in a call's first delta."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        deltas = (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
        for delta in deltas:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": delta.function.arguments or ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], [c.choices[0].finish_reason for c in chunks if c.choices]


def as_dicts(tool_calls) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in tool_calls or []]


def assert_valid(calls: list[dict], offered: set[str]) -> None:
    for call in calls:
        assert call["name"] in offered
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def two_turns(client: openai.OpenAI, *, stream: bool) -> tuple[list[dict], str | None, object]:
    """call → tool result → answer: the call, its finish reason, and the second turn's result."""
    messages = [{"role": "user", "content": QUESTIONS["get_weather"]}]
    first = dict(model="m", messages=messages, tools=WEATHER, tool_choice="required", parallel_tool_calls=False,
                 temperature=0, max_tokens=64)
    if stream:
        calls, reasons = joined_calls(list(_client_call(client, first, stream=True)))
        reason = reasons[-1]
        assert all(r is None for r in reasons[:-1])
    else:
        answer = client.chat.completions.create(**first)
        assert answer.choices[0].message.content is None
        calls, reason = as_dicts(answer.choices[0].message.tool_calls), answer.choices[0].finish_reason
    assert len(calls) == 1
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": WEATHER_RESULT},
    ]
    second = dict(model="m", messages=history, tools=WEATHER, temperature=0, max_tokens=24)
    return calls, reason, _client_call(client, second, stream=stream)


def _client_call(client: openai.OpenAI, body: dict, *, stream: bool):
    result = client.chat.completions.create(**body, stream=stream)
    return list(result) if stream else result


def test_a_tool_conversation_in_two_turns_streamed_and_not(api):
    calls, reason, answer = two_turns(api, stream=False)
    assert reason == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert_valid(calls, {"get_weather"})
    streamed_calls, streamed_reason, chunks = two_turns(api, stream=True)
    assert streamed_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c["name"], c["arguments"]) for c in calls]
    # The second turn: an answer in text, the same streamed or not.
    message = answer.choices[0].message
    assert message.tool_calls is None and message.content and answer.choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined_calls(chunks)[0] == []
    assert text == message.content and chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_twenty_required_calls_over_four_schemas_all_validate(api):
    offered = set(SCHEMAS)
    for name in SCHEMAS:
        for seed in range(5):
            answer = api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": QUESTIONS[name]}], tools=TOOLS,
                tool_choice="required", parallel_tool_calls=False, max_tokens=150,
                temperature=0.0 if seed == 0 else 0.9, seed=seed)
            choice = answer.choices[0]
            calls = as_dicts(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
            assert_valid(calls, offered)


def test_parallel_calls_each_get_an_index_and_an_id(api):
    body = dict(model="m", messages=[{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
                tools=WEATHER, tool_choice="required", parallel_tool_calls=True, temperature=0, max_tokens=80)
    answer = api.chat.completions.create(**body)
    calls = as_dicts(answer.choices[0].message.tool_calls)
    assert len(calls) >= 2 and len({c["id"] for c in calls}) == len(calls)
    # a call cut off by max_tokens is the last one, and only then
    assert_valid(calls if answer.choices[0].finish_reason == "tool_calls" else calls[:-1], {"get_weather"})
    streamed, reasons = joined_calls(list(api.chat.completions.create(**body, stream=True)))
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    assert reasons[-1] == answer.choices[0].finish_reason


def test_a_named_function_is_always_the_one_called(api):
    for seed, question in enumerate(QUESTIONS.values()):
        answer = api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], tools=TOOLS, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "add_numbers"}}, max_tokens=64,
            temperature=0.0 if seed == 0 else 0.9, seed=seed)
        calls = as_dicts(answer.choices[0].message.tool_calls)
        assert [c["name"] for c in calls] == ["add_numbers"] and answer.choices[0].finish_reason == "tool_calls"
        assert_valid(calls, {"add_numbers"})


def test_tool_choice_none_never_returns_tool_calls(api):
    for seed, question in enumerate(QUESTIONS.values()):
        body = dict(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice="none",
                    max_tokens=16, temperature=0.0 if seed == 0 else 0.9, seed=seed)
        answer = api.chat.completions.create(**body)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
        chunks = list(api.chat.completions.create(**body, stream=True))
        assert joined_calls(chunks)[0] == [] and chunks[-1].choices[0].finish_reason != "tool_calls"


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [FN, FN]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [FN, {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/$defs/none"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 100000}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [FN], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [FN], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*USER, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages[1].tool_calls[0]"),
])
def test_bad_tool_input_gets_400_naming_the_field(api, body, param):
    extra = {k: v for k, v in body.items() if k != "messages"}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="m", messages=body.get("messages", USER), max_tokens=4, extra_body=extra)
    error = refused.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[-1].split("[")[0] in error["message"]


def test_completions_refuse_tools_by_name(api):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="m", prompt="hi", max_tokens=4, extra_body={"tools": [FN]})
    assert refused.value.response.json()["error"]["param"] == "tools"


# ---- the rendered prompt --------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": QUESTIONS["get_weather"]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT},
]
# The generic format (docs/api.md): the same conversation as plain turns, tool_choice none.
GENERIC = [
    ("system", "You are a weather bot.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
               "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
               + json.dumps(WEATHER[0]) + "\n</tools>\n\nFor each function call, return a json object with function "
               "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
               "Do not call any of these functions now: answer in text."),
    ("user", QUESTIONS["get_weather"]),
    ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                  "</tool_call>"),
    ("user", f"<tool_response>\n{WEATHER_RESULT}\n</tool_response>"),
]


def render(template: str, messages: list[dict], tools: list[dict] | None) -> str:
    """A chat template rendered as Hugging Face (and llama-server's --jinja) render one: tool
    call arguments as objects."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True,
                                            bos_token="", eos_token="")


def chat_template(model: Path) -> str:
    field = GGUFReader(str(model)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def assert_served_prompt_is(client: openai.OpenAI, model: Path, prompt: str) -> None:
    """The server's prompt has ``prompt``'s tokens, and greedy it answers what llama-cpp-python
    answers on the unsplit model fed ``prompt``."""
    llm = reference_llama(model, n_ctx=2048, verbose=False)
    try:
        tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
        expected = llm.create_completion(tokens, max_tokens=12, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    answer = client.chat.completions.create(model="m", messages=CONVERSATION, tools=WEATHER, tool_choice="none",
                                            temperature=0, max_tokens=12)
    assert answer.usage.prompt_tokens == len(tokens)
    assert answer.choices[0].message.content == expected


def test_a_template_without_tools_gets_the_generic_format(api, smollm2):
    template = chat_template(smollm2)
    assert not template_knows_tools(template)
    prompt = render(template, [{"role": r, "content": c} for r, c in GENERIC], None)
    assert prompt.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools")
    assert_served_prompt_is(api, smollm2, prompt)


def test_a_template_that_knows_tools_renders_them_itself(native_api, tools_model):
    template = chat_template(tools_model)
    assert template_knows_tools(template)
    prompt = render(template, CONVERSATION, WEATHER)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert_served_prompt_is(native_api, tools_model, prompt)


def test_calls_through_a_template_that_knows_tools(native_api):
    calls, reason, answer = two_turns(native_api, stream=False)
    assert reason == "tool_calls" and calls[0]["name"] == "get_weather"
    assert_valid(calls, {"get_weather"})
    assert answer.choices[0].message.content


# ---- reading calls out of text (auto) ---------------------------------------------------------

def _read(text: str, cuts: list[int], *, constrained: bool = False, parallel: bool = True) -> tuple[list, dict]:
    reader = CallReader(frozenset({"f", "g"}), constrained=constrained, parallel=parallel)
    deltas, at = [], 0
    for cut in [*cuts, len(text)]:
        deltas += reader.feed(text[at:cut])
        at = cut
    deltas += reader.end()
    return deltas, reader.message()


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Let me see.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, \"}\"]}}\n</tool_call>",
     "Let me see.", [("f", '{"x": [1, "}"]}')]),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", "
     "\"arguments\": {\"y\": true}}\n</tool_call>\n", None, [("f", "{}"), ("g", '{"y": true}')]),
    ("No call: <tool_call>{\"name\": \"h\", \"arguments\": {}}</tool_call>",
     "No call: <tool_call>{\"name\": \"h\", \"arguments\": {}}</tool_call>", []),
    ("<tool_call>not json</tool_call> and a < sign", "<tool_call>not json</tool_call> and a < sign", []),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n", None, [("f", '{"a": 1}')]),  # never closed
    ("plain text", "plain text", []),
])
def test_calls_are_read_out_of_free_text_whatever_the_pieces(text, content, calls):
    rng = random.Random(7)
    whole = _read(text, [])[1]
    assert whole["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
    for _ in range(20):
        deltas, message = _read(text, sorted(rng.sample(range(len(text)), min(len(text) - 1, 6))))
        assert message["content"] == content and [c["function"] for c in message.get("tool_calls", [])] == \
            [c["function"] for c in whole.get("tool_calls", [])]
        assert "".join(d.get("content", "") for d in deltas) == (content or "")


def test_a_constrained_call_streams_its_arguments_as_they_come():
    text = '<tool_call>\n{"name": "g", "arguments": {"s": "a\\"}b", "n": [1, {"k": 2}]}}\n</tool_call>'
    deltas, message = _read(text, list(range(1, len(text))), constrained=True)
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": message["tool_calls"][0]["id"], "type": "function",
                                         "function": {"name": "g", "arguments": ""}}]}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 10 and "".join(fragments) == '{"s": "a\\"}b", "n": [1, {"k": 2}]}'
    assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"])


def test_under_the_grammar_a_call_cut_off_before_its_name_is_dropped_not_turned_into_text():
    """max_tokens ended a parallel answer inside its second call's head: the first call stands, and
    nothing of the second becomes content (the grammar allows no text)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g'
    for cuts in ([], list(range(1, len(text)))):
        deltas, message = _read(text, cuts, constrained=True)
        assert message["content"] is None
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
            [("f", '{"a": 1}')]
        assert not any("content" in d for d in deltas)
