"""Speculative decoding through a real 3-stage pipeline: the head drafts, one batch carries the
last token and the drafts through every stage, the final stage samples every row and stops at
the first rejected draft, and every stage drops the rejected positions before the next step.

The reference is llama-cpp-python's own prompt-lookup speculation in one process,
``Llama(draft_model=LlamaPromptLookupDecoding(...)).create_completion(prompt, temperature=0)``:
it evaluates [last token + drafts] in one batch with every row's logits, samples each row,
stops at the first mismatch and removes the rest from its KV, and its prompt is evaluated with
every row as an output. The pipeline runs the same batch shapes, so the texts must be equal.
"""

from __future__ import annotations

import grpc
import openai
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
from support.pipeline import assert_no_active_sessions, metric, scrape

from skippy_stage.cli.local import free_ports
from skippy_stage.model.loader import reference_llama
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

RANGES = [(0, 10), (10, 20), (20, 30)]
MAX_TOKENS = 64
K = 4
REPETITIVE = ("Repeat the following passage exactly.\n\nPassage: The old lighthouse keeper climbed the spiral "
              "stairs every evening, lit the great lamp, and watched the ships pass safely through the narrow "
              "strait.\n\nRepeated passage:")
FREE_FORM = "Once upon a time, in a small village by the mountains,"
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):"
PROMPTS = [REPETITIVE, FREE_FORM, CODE]


def reference(model, prompts: list[str], *, k: int = K, ngram: int = 2) -> list[str]:
    llm = reference_llama(model, n_ctx=2048, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(max_ngram_size=ngram, num_pred_tokens=k))
    try:
        return [llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"] for p in prompts]
    finally:
        llm.close()


def generate(endpoint: str, prompt: str, speculative: pb.Speculative | None = None,
             max_tokens: int = MAX_TOKENS) -> str:
    request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens)
    if speculative is not None:
        request.speculative.CopyFrom(speculative)
    with grpc.insecure_channel(endpoint) as channel:
        return "".join(m.text for m in pb_grpc.StageServiceStub(channel).Generate(request, timeout=300))


@pytest.fixture(scope="module")
def pipeline(start_pipeline, smollm2):
    http, *metrics_ports = free_ports("127.0.0.1", 4)
    # Separate lanes: a shared KV pool interleaves concurrent sessions' cells, and the text could
    # then depend on the company a request keeps (README, kv_unified).
    p = start_pipeline(smollm2, RANGES, http_port=[http, None, None], metrics_port=metrics_ports,
                       kv_unified=False, speculative=[{"drafter": "ngram", "k": K, "adaptive": False}, None, None])
    p.http, p.metrics_ports = http, metrics_ports
    yield p
    p.stop()


@pytest.fixture(scope="module")
def ngram_texts(smollm2):
    return reference(smollm2, PROMPTS)


def test_greedy_ngram_speculation_over_three_stages_equals_llama_cpp_pythons_prompt_lookup(pipeline, ngram_texts):
    before = scrape(pipeline.metrics_ports[0])
    for prompt, expected in zip(PROMPTS, ngram_texts):
        assert generate(pipeline.head_endpoint, prompt) == expected
    after = scrape(pipeline.metrics_ports[0])
    drafted = metric(after, "skippy_spec_drafted_tokens_total") - metric(before, "skippy_spec_drafted_tokens_total")
    accepted = metric(after, "skippy_spec_accepted_tokens_total") - metric(before, "skippy_spec_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    assert_no_active_sessions(pipeline.configs)


def test_a_request_overrides_the_heads_speculation_and_its_own_k_is_still_exact(pipeline, smollm2):
    expected = reference(smollm2, [REPETITIVE], k=2, ngram=3)
    spec = pb.Speculative(drafter="ngram", k=2, ngram=3, adaptive=False)
    assert generate(pipeline.head_endpoint, REPETITIVE, spec) == expected[0]


def test_speculating_and_plain_sessions_share_batches_and_each_text_is_unchanged(pipeline):
    from concurrent.futures import ThreadPoolExecutor

    plain = pb.Speculative(drafter="none")
    alone = [generate(pipeline.head_endpoint, REPETITIVE), generate(pipeline.head_endpoint, CODE, plain)]
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(generate, pipeline.head_endpoint, REPETITIVE),
                pool.submit(generate, pipeline.head_endpoint, CODE, plain),
                pool.submit(generate, pipeline.head_endpoint, REPETITIVE),
                pool.submit(generate, pipeline.head_endpoint, CODE, plain)]
        texts = [r.result() for r in runs]
    assert texts == [alone[0], alone[1], alone[0], alone[1]]
    assert_no_active_sessions(pipeline.configs)


def test_the_openai_api_takes_speculative_settings_and_refuses_bad_ones_by_field(pipeline, ngram_texts):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pipeline.http}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    result = client.completions.create(model="m", prompt=REPETITIVE, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"speculative": {"drafter": "ngram", "k": K, "adaptive": False}})
    assert result.choices[0].text == ngram_texts[0]
    # usage counts what was generated, as without speculation: one completion token per token emitted
    request = pb.GenerateRequest(prompt=REPETITIVE, max_tokens=MAX_TOKENS,
                                 speculative=pb.Speculative(drafter="ngram", k=K, adaptive=False))
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        messages = list(pb_grpc.StageServiceStub(channel).Generate(request, timeout=300))
    emitted = sum(len(m.token_ids) for m in messages)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (messages[-1].prompt_tokens, emitted)
    for bad, field in (({"drafter": "mtp"}, "native multi-token-prediction"), ({"k": 0}, "speculative.k"),
                       ({"drafter": "model"}, "no draft model"), ({"lookahead": 3}, "lookahead")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt="Hi", max_tokens=4, extra_body={"speculative": bad})
        assert field in str(err.value), (bad, str(err.value))
