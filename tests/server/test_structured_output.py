"""Structured output through a real 3-stage pipeline: ``response_format`` constrains sampling at the
final stage with llama.cpp's grammar sampler (JSON schemas through llama-cpp-python's converter),
so every answer parses and validates, at any temperature; a schema the converter cannot handle is
refused by name. A grammar can never make a stage abort: a token it does not allow is refused, not
accepted (llama.cpp aborts the process on one)."""

from __future__ import annotations

import json
import time

import grpc
import jsonschema
import openai
import pytest
from support.pipeline import StreamingRun, assert_no_active_sessions, reference_texts

from skippy_stage.cli.local import free_ports
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

RANGES = [(0, 10), (10, 20), (20, 30)]
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "colour": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                                "bright": {"type": "boolean"}},
               "required": ["colour", "bright"], "additionalProperties": False},
    "list": {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "minItems": 1, "maxItems": 3}},
             "required": ["items"], "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                               "label": {"type": "string", "maxLength": 8}},
              "required": ["x", "y"], "additionalProperties": False},
}
QUESTIONS = {"person": "Invent a person and give their name and age as JSON.",
             "colour": "Pick a colour and say whether it is bright, as JSON.",
             "list": "List up to three fruits as JSON.",
             "point": "Give a point on a plane as JSON."}


@pytest.fixture(scope="module")
def api(start_pipeline, smollm2):
    port = free_ports("127.0.0.1", 1)[0]
    pipeline = start_pipeline(smollm2, RANGES, http_port=[port, None, None], kv_unified=False)
    yield pipeline, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                  timeout=300)
    pipeline.stop()


def test_twenty_answers_over_four_schemas_all_parse_and_validate(api):
    _, client = api
    for name, schema in SCHEMAS.items():
        for seed in range(5):
            answer = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": QUESTIONS[name]}], max_tokens=200,
                temperature=0.0 if seed == 0 else 0.9, seed=seed,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            text = answer.choices[0].message.content
            assert answer.choices[0].finish_reason == "stop", text
            jsonschema.validate(json.loads(text), schema)


def test_json_object_answers_parse_as_json_objects(api):
    _, client = api
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a cat."}],
                                            max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("response_format, why", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/nowhere"}}},
     "cannot be turned into a grammar"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be"),
    ({"type": "xml"}, "response_format.type='xml'"),
])
def test_a_response_format_the_server_cannot_honour_is_refused_by_name(api, response_format, why):
    _, client = api
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format=response_format)
    assert refused.value.body["param"] == "response_format" and why in refused.value.body["message"]


def test_a_grammar_that_does_not_parse_and_a_prompt_that_breaks_one_are_refused_and_the_stages_stay_up(api):
    pipeline, client = api
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=4,
                                                  sampling=pb.SamplingParams(grammar="root ::= (")), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.grammar" in refused.value.details()
        # A client that names a grammar from position 0 of a prompt the grammar does not allow: the final
        # stage refuses the token instead of letting llama.cpp accept it (which aborts the process).
        entry = pb.BatchEntry(session_id="bad-grammar", phase=pb.PHASE_PREFILL, positions=[0, 1, 2],
                              token_ids=[504, 3575, 282], sample_last=True,
                              sampling=pb.SamplingParams(grammar='root ::= "{" [a-z]* "}"', grammar_start=0))
        with pytest.raises(grpc.RpcError) as refused:
            stub.IterationBatch(pb.IterationBatchRequest(request_id="g", entries=[entry]), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not follow sampling.grammar" in refused.value.details()
    answer = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert answer.choices[0].text


@pytest.mark.parametrize("grammar, why", [
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "nests groups 5000 deep"),
    ("\n".join(f"r{i} ::= r{i + 1}" for i in range(3000)) + '\nroot ::= r0\nr3000 ::= "a"', "rules"),
    ('root ::= (" "?){0,1999}', "repeats"),
    ("root ::= " + '"a" ' * 40000, "characters"),
])
def test_a_grammar_that_could_overflow_llama_cpps_parser_is_refused_before_it_gets_there(api, grammar, why):
    pipeline, _ = api
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.StageServiceStub(channel).Generate(
                pb.GenerateRequest(prompt="Hi", max_tokens=4, sampling=pb.SamplingParams(grammar=grammar)), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in refused.value.details()


def test_a_schema_whose_bounds_would_make_a_huge_grammar_is_refused_naming_the_field(api):
    _, client = api
    common = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 200}}}
    assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "ok", "schema": common}}).choices
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30000}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
    assert "properties.s.maxLength=30000" in refused.value.body["message"]


def test_a_grammar_with_no_way_forward_ends_only_its_own_session(api, smollm2):
    """No token's text can start U+0001: the first sample is a dead end. That session ends (its
    stage samples the end of generation); a session sharing its batch goes on, to the unsplit
    model's text (separate lanes: what shares its steps does not change it)."""
    pipeline, _ = api
    prompt, tokens = "The capital of France is", 48
    [reference] = reference_texts(smollm2, [prompt], tokens)
    other = StreamingRun(pipeline.head_endpoint, prompt, tokens, after_pieces=2)
    assert other.started.wait(60)
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        messages = list(pb_grpc.StageServiceStub(channel).Generate(
            pb.GenerateRequest(prompt="Hi", max_tokens=8, sampling=pb.SamplingParams(grammar='root ::= "\\x01"')),
            timeout=60))
    dead_end_over = time.monotonic()
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP
    other.join(120)
    assert other.error is None, other.error
    assert other.ended > dead_end_over, "the other session had ended before: they never shared a batch"
    assert "".join(other.pieces) == reference
    assert other.outcome["done"].completion_tokens == tokens
    assert_no_active_sessions(pipeline.configs)
