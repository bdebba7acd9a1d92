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
                       kv_unified=False, speculative=[{"drafter": "ngram", "k": K}, None, None])
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
    spec = pb.Speculative(drafter="ngram", k=2, ngram=3)
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
                                       extra_body={"speculative": {"drafter": "ngram", "k": K}})
    assert result.choices[0].text == ngram_texts[0]
    # usage counts what was generated, as without speculation: one completion token per token emitted
    request = pb.GenerateRequest(prompt=REPETITIVE, max_tokens=MAX_TOKENS,
                                 speculative=pb.Speculative(drafter="ngram", k=K))
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        messages = list(pb_grpc.StageServiceStub(channel).Generate(request, timeout=300))
    emitted = sum(len(m.token_ids) for m in messages)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (messages[-1].prompt_tokens, emitted)
    for bad, field in (({"drafter": "mtp"}, "native_mtp_enabled"), ({"k": 0}, "speculative.k"),
                       ({"drafter": "model"}, "no draft model"), ({"lookahead": 3}, "lookahead")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt="Hi", max_tokens=4, extra_body={"speculative": bad})
        assert field in str(err.value), (bad, str(err.value))


class _PipelineDrafts:
    """The pipeline's own model drafter as llama-cpp-python's draft model: the reference then
    drafts exactly what the head drafts (same model, same calls in the same order)."""

    def __init__(self, drafter, k: int) -> None:
        self.drafter, self.k = drafter, k

    def __call__(self, input_ids, **_: object):
        import numpy as np

        return np.asarray(self.drafter([int(t) for t in input_ids], self.k), dtype=np.intc)


def test_the_model_drafter_runs_a_draft_gguf_at_the_head_and_equals_llama_with_the_same_drafts(
        start_pipeline, smollm2):
    from skippy_stage.head.drafting import ModelDrafter
    from skippy_stage.model.tokenizer import Tokenizer

    metrics_ports = free_ports("127.0.0.1", 3)
    pipeline = start_pipeline(smollm2, RANGES, kv_unified=False, metrics_port=metrics_ports,
                              speculative=[{"drafter": "model", "model_path": str(smollm2), "k": 3},
                                           None, None])
    try:
        texts = [generate(pipeline.head_endpoint, p, max_tokens=32) for p in (FREE_FORM, CODE)]
        m = scrape(metrics_ports[0])
        assert metric(m, "skippy_spec_accepted_tokens_total") > 0
    finally:
        pipeline.stop()
    target = reference_llama(smollm2, n_ctx=2048, verbose=False)
    drafter = ModelDrafter(str(smollm2), n_ctx=512 + 32, n_threads=1, target=Tokenizer(target._model.model))
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False, draft_model=_PipelineDrafts(drafter, 3))
    try:
        expected = [llm.create_completion(p, max_tokens=32, temperature=0)["choices"][0]["text"]
                    for p in (FREE_FORM, CODE)]
    finally:
        llm.close()
        drafter.close()
        target.close()
    assert texts == expected


def test_a_draft_model_with_another_vocabulary_is_refused_by_name(smollm2, gemma3):
    from skippy_stage.errors import ConfigError
    from skippy_stage.head.drafting import ModelDrafter
    from skippy_stage.model.tokenizer import Tokenizer

    target = reference_llama(smollm2, n_ctx=256, verbose=False)
    try:
        with pytest.raises(ConfigError) as refused:
            ModelDrafter(str(gemma3), n_ctx=256, n_threads=1, target=Tokenizer(target._model.model))
    finally:
        target.close()
    assert "speculative.model_path" in str(refused.value) and "vocabulary" in str(refused.value)


def test_adaptive_k_stops_drafting_while_drafts_are_rejected_and_probes_to_start_again():
    from skippy_stage.head.drafting import DraftBudget

    budget = DraftBudget(k=4, adaptive=True)
    assert budget.next_k() == 4
    for _ in range(5):
        budget.record(drafted=4, accepted=0)
    assert [budget.next_k() for _ in range(16)].count(1) == 2, "one single-token probe every 8 steps"
    for _ in range(6):
        budget.record(drafted=1, accepted=1)
    assert budget.next_k() == 4
    fixed = DraftBudget(k=4, adaptive=False)
    fixed.record(drafted=4, accepted=0)
    assert fixed.next_k() == 4


def test_adaptive_k_grows_by_two_while_every_draft_is_kept_and_halves_on_a_rejection():
    from skippy_stage.head.drafting import DraftBudget

    budget = DraftBudget(k=8, adaptive=True)
    seen = [budget.next_k()]
    for _ in range(3):
        budget.record(drafted=seen[-1], accepted=seen[-1])
        seen.append(budget.next_k())
    assert seen == [4, 6, 8, 8], "from 4, two more per fully kept step, never past k"
    budget.record(drafted=8, accepted=7)
    assert budget.next_k() == 4
    budget.record(drafted=4, accepted=0)
    budget.record(drafted=2, accepted=1)
    assert budget.next_k() == 1, "never below one while drafting pays"
    assert DraftBudget(k=2, adaptive=True).next_k() == 2, "never more than k, even at the start"


def test_adaptive_prompt_lookup_continues_where_the_context_agrees_and_the_reference_takes_the_earliest():
    from skippy_stage.config import SpeculativeConfig
    from skippy_stage.head.drafting import Drafters, NgramDrafter

    # "the cat" occurs twice before the end: after "saw" (continued "sat"), then after "fed"
    # (continued "ate"); the text now ends "... fed the cat" again.
    saw, fed, the, cat, sat, ate, dot = 10, 11, 12, 13, 14, 15, 16
    history = [saw, the, cat, sat, dot, fed, the, cat, ate, dot, saw, sat, dot, fed, the, cat]
    reference = NgramDrafter(2)(history, 2)
    assert reference == [sat, dot], "llama-cpp-python's lookup: the earliest occurrence"
    assert NgramDrafter(2, by_context=True)(history, 2) == [ate, dot]
    # Nothing earlier matches the last token: no draft, as the reference.
    assert NgramDrafter(2, by_context=True)([1, 2, 3, 4], 3) == NgramDrafter(2)([1, 2, 3, 4], 3) == []
    # A fixed k is the reference schedule, drafts included; adaptive drafting, the context lookup.
    drafters = Drafters()
    assert drafters.for_spec(SpeculativeConfig(drafter="ngram", k=2))(history, 2) == reference
    assert drafters.for_spec(SpeculativeConfig(drafter="ngram", k="auto"))(history, 2) == [ate, dot]


@pytest.mark.parametrize("settings, field", [
    ({"drafter": "ngram", "k": 99}, "speculative.k=99"),
    ({"drafter": "model"}, "speculative.model_path"),
    ({"drafter": "ngram", "model_path": "x.gguf"}, "speculative.model_path"),
    ({"draft": "ngram"}, "unknown speculative key(s) draft"),
])
def test_a_head_config_with_bad_speculative_settings_is_refused_by_field(settings, field):
    from skippy_stage.config import StageConfig
    from skippy_stage.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        StageConfig.from_dict({"stage_id": "head", "stage_index": 0, "model_path": "m.gguf", "layer_start": 0,
                               "layer_end": 30, "speculative": settings})
    assert field in str(refused.value)


def test_speculation_is_refused_by_name_on_a_stage_that_is_not_the_head():
    from skippy_stage.config import StageConfig
    from skippy_stage.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        StageConfig.from_dict({"stage_id": "s1", "stage_index": 1, "model_path": "m.gguf", "layer_start": 10,
                               "layer_end": 30, "speculative": {"drafter": "ngram"}})
    assert "not the head" in str(refused.value)


def test_a_recurrent_model_refuses_the_rewind_speculation_needs_by_name(tmp_path):
    """Rejected drafts are removed by cutting the session back; a recurrent state cannot be cut."""
    from pathlib import Path

    from skippy_stage.errors import InvalidRequestError
    from skippy_stage.model import synthetic
    from skippy_stage.model.batch import BatchEntry
    from skippy_stage.model.chain import chain_configs
    from skippy_stage.model.runtime import StageRuntime

    specs = synthetic.load_specs(Path(__file__).resolve().parent / "fixtures" / "archs.jsonl.gz")
    model = synthetic.write_model(specs["mamba-dense"], tmp_path / "mamba.gguf", seed=42)
    (config,) = chain_configs(model, [(0, 6)], tmp_path)
    runtime = StageRuntime(config)
    try:
        assert not runtime.cuttable
        runtime.run_batch([BatchEntry("s", [0, 1, 2], token_ids=[1, 2, 3], sample=True)])
        with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.rewind: .* recurrent model"):
            runtime.run_batch([BatchEntry("s", [2, 3], token_ids=[3, 4], sample=True, rewind=True, verify=True)])
        runtime.run_batch([BatchEntry("s", [3], token_ids=[4], sample=True)])  # the session is unharmed
    finally:
        runtime.close()


def test_a_batch_asking_more_output_rows_than_n_ubatch_is_refused_and_the_stage_stays_up(smollm2, slice_cache):
    """all_rows and verify output every row; llama.cpp's output buffer would grow to the largest
    batch's rows x n_vocab floats, so the final stage bounds them (n_ubatch per batch)."""
    from skippy_stage.errors import InvalidRequestError
    from skippy_stage.model.batch import BatchEntry
    from skippy_stage.model.chain import chain_configs
    from skippy_stage.model.runtime import StageRuntime

    (config,) = chain_configs(smollm2, [(0, 30)], slice_cache, n_batch=64, n_ubatch=16)
    runtime = StageRuntime(config)
    try:
        wide = [BatchEntry("a", range(12), token_ids=[42] * 12, sample=True, all_rows=True),
                BatchEntry("b", range(8), token_ids=[42] * 8, sample=True, all_rows=True)]
        with pytest.raises(InvalidRequestError, match=r"entries\[1\] brings the batch's output rows to 20: at most "
                                                      r"n_ubatch=16"):
            runtime.run_batch(wide)
        assert runtime.stats().active_sessions == 0
        runtime.run_batch(wide[:1])  # within the bound: runs
        assert runtime.stats().active_sessions == 1
    finally:
        runtime.close()


def test_a_speculating_session_reserves_kv_cells_for_the_drafts_past_its_answer():
    from skippy_stage.head.drafting import DraftBudget
    from skippy_stage.head.tasks import Task
    from skippy_stage.model.sampling import SamplingParams

    plain = Task(session_id="a", prompt=[1] * 10, sampling=SamplingParams(), max_tokens=2)
    speculating = Task(session_id="b", prompt=[1] * 10, sampling=SamplingParams(), max_tokens=2,
                       draft_budget=DraftBudget(k=4, adaptive=True))
    assert (plain.reserve(100), speculating.reserve(100), speculating.reserve(13)) == (12, 16, 13)
