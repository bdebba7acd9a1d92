"""A split model computes exactly what the unsplit model computes.

The reference is llama-cpp-python's own ``Llama`` on the whole GGUF; the split is a chain
of stage runtimes, each loading its sliced stage file. Logits after the prompt must agree
to 1e-4 (they are in fact bit-identical) and 32 greedy tokens must be the same, also when
two sessions share every batch. An architecture is accepted by ``slicing`` only once a
test here proves it.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.chain import EQUIVALENCE_PROMPTS, Chain, split_configs

from skippy_stage.model.loader import reference_llama

PROMPTS = EQUIVALENCE_PROMPTS
N_TOKENS = 32
SMOLLM2_SPLITS = {
    "0:30": [(0, 30)],
    "0:10/10:20/20:30": [(0, 10), (10, 20), (20, 30)],
    "0:1/1:29/29:30": [(0, 1), (1, 29), (29, 30)],
    "0:15/15:30": [(0, 15), (15, 30)],
}
LOGIT_TOLERANCE = 1e-4


def reference_run(model, prompts: list[str]) -> dict[str, tuple[list[int], np.ndarray, list[int]]]:
    """Prompt tokens, logits after the prompt and 32 greedy tokens, from the unsplit model."""
    llm = reference_llama(model, n_ctx=2048, logits_all=True, verbose=False)
    out = {}
    for prompt in prompts:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(tokens)
        logits = np.array(llm.scores[len(tokens) - 1], dtype=np.float32)
        greedy: list[int] = []
        for token in llm.generate(tokens, temp=0.0, reset=True):
            greedy.append(token)
            if len(greedy) == N_TOKENS:
                break
        out[prompt] = (tokens, logits, greedy)
    llm.close()
    return out


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    return reference_run(smollm2, PROMPTS)


@pytest.fixture(scope="module", params=list(SMOLLM2_SPLITS), ids=list(SMOLLM2_SPLITS))
def smollm2_chain(request, smollm2, slice_cache):
    """Separate lanes (kv_unified off): two sessions batched together then keep their KV
    cells apart, so each computes exactly what it computes alone, the reference here. In
    the default unified pool their cells interleave and llama.cpp's vectorised sums over
    the cells round differently (see the unified-KV test below)."""
    chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS[request.param], slice_cache, kv_unified=False))
    yield request.param, chain
    chain.close()


def test_each_split_matches_the_unsplit_model_for_every_prompt(smollm2_chain, smollm2_reference):
    name, chain = smollm2_chain
    for i, prompt in enumerate(PROMPTS):
        tokens, ref_logits, ref_greedy = smollm2_reference[prompt]
        logits, generated = chain.greedy({f"s{i}": tokens}, N_TOKENS)
        diff = float(np.abs(logits[f"s{i}"] - ref_logits).max())
        print(f"split {name} prompt {i}: max |logit diff| = {diff}")
        assert diff <= LOGIT_TOLERANCE
        assert generated[f"s{i}"] == ref_greedy
        chain.drop(f"s{i}")
    assert all(stage.stats().active_sessions == 0 for stage in chain.stages)


def test_two_sessions_interleaved_in_one_batch_match_the_unsplit_model(smollm2_chain, smollm2_reference):
    name, chain = smollm2_chain
    prompts = {"a": smollm2_reference[PROMPTS[1]][0], "b": smollm2_reference[PROMPTS[2]][0]}
    logits, generated = chain.greedy(prompts, N_TOKENS)
    for sid, prompt in (("a", PROMPTS[1]), ("b", PROMPTS[2])):
        _, ref_logits, ref_greedy = smollm2_reference[prompt]
        diff = float(np.abs(logits[sid] - ref_logits).max())
        print(f"split {name} interleaved session {sid}: max |logit diff| = {diff}")
        assert diff <= LOGIT_TOLERANCE
        assert generated[sid] == ref_greedy
        chain.drop(sid)


def test_unified_kv_cache_split_matches_the_unsplit_model(smollm2, slice_cache, smollm2_reference):
    """kv_unified changes how llama.cpp cuts a batch into micro-batches; the split must be exact.

    Two sessions batched together in one unified KV cache are compared with the unsplit
    model batched the same way: the batch's composition itself moves llama.cpp's logits on
    some CPUs (0.41 at most on an AVX2-only AMD EPYC, 0.0 on another machine), with or
    without a split, because the sessions' cells interleave in the shared pool. The split
    is exact against the unsplit model batched alike; against llama-cpp-python alone the
    greedy tokens must agree for these prompts.
    """
    prompts = {"a": smollm2_reference[PROMPTS[0]][0], "b": smollm2_reference[PROMPTS[2]][0]}
    runs = {}
    for name, ranges in (("unsplit", [(0, 30)]), ("split", SMOLLM2_SPLITS["0:10/10:20/20:30"])):
        chain = Chain(split_configs(smollm2, ranges, slice_cache, kv_unified=True, n_ubatch=4))
        try:
            runs[name] = chain.greedy(prompts, N_TOKENS)
        finally:
            chain.close()
    (split_logits, split_tokens), (whole_logits, whole_tokens) = runs["split"], runs["unsplit"]
    for sid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
        diff = float(np.abs(split_logits[sid] - whole_logits[sid]).max())
        print(f"unified KV, session {sid}: max |logit diff| vs the unsplit model in the same batch = {diff}")
        assert diff <= LOGIT_TOLERANCE
        assert split_tokens[sid] == whole_tokens[sid] == smollm2_reference[prompt][2]


def test_small_micro_batches_with_separate_lanes_match_the_unsplit_model_run_alike(smollm2, slice_cache, smollm2_reference):
    """n_ubatch=4 makes llama.cpp interleave three sessions across micro-batches (equal split).

    Micro-batch size changes llama.cpp's kernels, so the fair reference is the unsplit
    model run with the same n_ubatch and the same batches; against it the split is exact.
    Greedy tokens still match the default-settings reference.
    """
    settings = dict(n_ubatch=4, lane_count=3, kv_unified=False)
    prompts = {sid: smollm2_reference[p][0] for sid, p in zip("abc", PROMPTS)}
    results = {}
    for name in ("0:30", "0:15/15:30"):
        chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS[name], slice_cache, **settings))
        try:
            results[name] = chain.greedy(prompts, 8)
        finally:
            chain.close()
    (whole_logits, whole_tokens), (split_logits, split_tokens) = results["0:30"], results["0:15/15:30"]
    for sid, prompt in zip("abc", PROMPTS):
        diff = float(np.abs(split_logits[sid] - whole_logits[sid]).max())
        print(f"split 0:15/15:30 n_ubatch=4 session {sid}: max |logit diff| vs unsplit alike = {diff}")
        assert diff <= LOGIT_TOLERANCE
        assert split_tokens[sid] == whole_tokens[sid] == smollm2_reference[prompt][2][:8]


def test_gemma3_split_off_the_sliding_window_period_matches_the_unsplit_model(gemma3, slice_cache):
    """5 and 11 are not multiples of Gemma-3's 6-layer window period: the per-layer pattern must survive."""
    prompts = PROMPTS[:2]
    reference = reference_run(gemma3, prompts)
    chain = Chain(split_configs(gemma3, [(0, 5), (5, 11), (11, 18)], slice_cache))
    try:
        for i, prompt in enumerate(prompts):
            tokens, ref_logits, ref_greedy = reference[prompt]
            logits, generated = chain.greedy({f"g{i}": tokens}, N_TOKENS)
            diff = float(np.abs(logits[f"g{i}"] - ref_logits).max())
            print(f"gemma3 0:5/5:11/11:18 prompt {i}: max |logit diff| = {diff}")
            assert diff <= LOGIT_TOLERANCE
            assert generated[f"g{i}"] == ref_greedy
            chain.drop(f"g{i}")
    finally:
        chain.close()
