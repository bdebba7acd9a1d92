"""A split model computes exactly what the unsplit model computes: max |logit diff| == 0.0.

The reference is llama-cpp-python's own ``Llama`` on the whole GGUF (``logits_all=True``, loaded
as stages load, with the stages' context: ``support.reference``); the split is a chain of stage
runtimes, each loading its sliced stage file. Both evaluate the same tokens in the same batches
with every row an output (the chain's final stage asks for ``all_rows``): the prompt in one
batch, then one greedy token per batch. Every step's logits (the prompt's last row, then the 31
rows decoded after it) must be bit-identical and the 32 greedy tokens the same; also with two
sessions sharing every batch, in a unified KV pool, and in micro-batches of 4 tokens, where the
reference decodes the same multi-sequence batches on llama-cpp-python's context (with 4-token
micro-batches each session's last row is the only output, on both sides). And a session sharing
its batches on separate lanes must compute what llama-cpp-python computes for it alone. An
architecture is accepted by ``slicing`` only once a split of it is proven
(``test_architectures``).
"""

from __future__ import annotations

import numpy as np
import pytest
from support.chain import EQUIVALENCE_PROMPTS, Chain, split_configs
from support.reference import Reference, chain_greedy, max_diff

from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.slicing import read_model_info

PROMPTS = EQUIVALENCE_PROMPTS
N_TOKENS = 32
SMOLLM2_SPLITS = {
    "0:30": [(0, 30)],
    "0:10/10:20/20:30": [(0, 10), (10, 20), (20, 30)],
    "0:1/1:29/29:30": [(0, 1), (1, 29), (29, 30)],
    "0:15/15:30": [(0, 15), (15, 30)],
}


def whole_config(model, **settings: object):
    """The unsplit model's StageConfig: the context the reference makes."""
    (cfg,) = split_configs(model, [(0, read_model_info(model).block_count)], None, **settings)
    return cfg


def reference_run(model, prompts: list[str], **settings: object) -> dict[str, tuple[list[int], list[np.ndarray], list[int]]]:
    """Prompt tokens, each step's logits and 32 greedy tokens, from llama-cpp-python on the unsplit model,
    one prompt at a time (``Llama.eval``)."""
    reference = Reference(whole_config(model, **settings))
    try:
        out = {}
        for prompt in prompts:
            tokens = reference.llm.tokenize(prompt.encode(), add_bos=True, special=False)
            rows, greedy = reference.greedy_alone(tokens, N_TOKENS)
            out[prompt] = (tokens, rows, greedy)
        return out
    finally:
        reference.close()


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    return reference_run(smollm2, PROMPTS, kv_unified=False)


@pytest.fixture(scope="module", params=list(SMOLLM2_SPLITS), ids=list(SMOLLM2_SPLITS))
def smollm2_chain(request, smollm2, slice_cache):
    """Separate lanes (kv_unified off): two sessions batched together then keep their KV
    cells apart, so each computes exactly what it computes alone (a test below holds them to
    that). In a unified pool their cells interleave and llama.cpp's vectorised sums over the
    cells round differently (see the unified-KV test below)."""
    chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS[request.param], slice_cache, kv_unified=False))
    yield request.param, chain
    chain.close()


def test_each_split_matches_the_unsplit_model_for_every_prompt(smollm2_chain, smollm2_reference):
    name, chain = smollm2_chain
    for i, prompt in enumerate(PROMPTS):
        tokens, ref_rows, ref_greedy = smollm2_reference[prompt]
        rows, generated, _ = chain_greedy(chain, {f"s{i}": tokens}, N_TOKENS)
        diff = max_diff(rows[f"s{i}"], ref_rows)
        print(f"split {name} prompt {i}: max |logit diff| over {len(ref_rows)} steps = {diff}")
        assert diff == 0.0
        assert generated[f"s{i}"] == ref_greedy
        chain.drop(f"s{i}")
    assert all(stage.stats().active_sessions == 0 for stage in chain.stages)


def test_two_sessions_interleaved_in_one_batch_match_the_unsplit_model(smollm2_chain, smollm2, smollm2_reference):
    """Two sessions in every batch, on separate lanes: llama-cpp-python decodes the same two-sequence
    batches (rows in lane order, each on its lane's sequence)."""
    name, chain = smollm2_chain
    prompts = {"a": smollm2_reference[PROMPTS[1]][0], "b": smollm2_reference[PROMPTS[2]][0]}
    rows, generated, lanes = chain_greedy(chain, prompts, N_TOKENS)
    reference = Reference(whole_config(smollm2, kv_unified=False))
    try:
        ref_rows, ref_tokens = reference.greedy_together(prompts, lanes, N_TOKENS)
    finally:
        reference.close()
    for sid in prompts:
        diff = max_diff(rows[sid], ref_rows[sid])
        print(f"split {name} interleaved session {sid}: max |logit diff| = {diff}")
        assert diff == 0.0
        assert generated[sid] == ref_tokens[sid]
        chain.drop(sid)


def test_separate_lanes_make_a_session_in_a_shared_batch_compute_what_it_computes_alone(smollm2, slice_cache,
                                                                                        smollm2_reference):
    """The batch-invariance separate lanes promise, held to llama-cpp-python running each prompt alone
    (the prefill batch holds both prompts, each decode batch two rows where the reference has one)."""
    chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS["0:10/10:20/20:30"], slice_cache, kv_unified=False))
    try:
        prompts = {"a": smollm2_reference[PROMPTS[1]][0], "b": smollm2_reference[PROMPTS[2]][0]}
        rows, generated, _ = chain_greedy(chain, prompts, N_TOKENS)
    finally:
        chain.close()
    for sid, prompt in (("a", PROMPTS[1]), ("b", PROMPTS[2])):
        diff = max_diff(rows[sid], smollm2_reference[prompt][1])
        print(f"session {sid} in a shared batch vs alone: max |logit diff| = {diff}")
        assert diff == 0.0
        assert generated[sid] == smollm2_reference[prompt][2]


def test_unified_kv_cache_split_matches_the_unsplit_model(smollm2, slice_cache, smollm2_reference):
    """kv_unified changes how llama.cpp cuts a batch into micro-batches; the split must be exact.

    Two sessions batched together in one unified KV cache (micro-batches of 4 tokens) are compared
    with llama-cpp-python's context made alike (``kv_unified``, ``n_ubatch=4``, two sequences) and
    fed the same batches, each session's last row the only output on both sides (a stage outputs at
    most n_ubatch rows per batch): the batch's composition itself moves llama.cpp's logits on some CPUs
    (0.41 at most on an AVX2-only AMD EPYC, 0.0 on another machine), with or without a split,
    because the sessions' cells interleave in the shared pool. Against llama-cpp-python running
    each prompt alone the greedy tokens must agree for these prompts.
    """
    settings = dict(kv_unified=True, n_ubatch=4)
    prompts = {"a": smollm2_reference[PROMPTS[0]][0], "b": smollm2_reference[PROMPTS[2]][0]}
    chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS["0:10/10:20/20:30"], slice_cache, **settings))
    try:
        rows, generated, lanes = chain_greedy(chain, prompts, N_TOKENS, all_rows=False)
    finally:
        chain.close()
    reference = Reference(whole_config(smollm2, **settings))
    try:
        ref_rows, ref_tokens = reference.greedy_together(prompts, lanes, N_TOKENS, all_rows=False)
    finally:
        reference.close()
    for sid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
        diff = max_diff(rows[sid], ref_rows[sid])
        print(f"unified KV, session {sid}: max |logit diff| vs llama-cpp-python in the same batches = {diff}")
        assert diff == 0.0
        assert generated[sid] == ref_tokens[sid] == smollm2_reference[prompt][2]


def test_small_micro_batches_with_separate_lanes_match_the_unsplit_model_run_alike(smollm2, slice_cache,
                                                                                   smollm2_reference):
    """n_ubatch=4 makes llama.cpp interleave three sessions across micro-batches (equal split).

    Micro-batch size changes llama.cpp's kernels, so the reference is llama-cpp-python's context
    made with the same n_ubatch and three sequences, fed the same batches with each session's last
    row the only output; against it the split is exact. Greedy tokens still match the default-settings reference.
    """
    settings = dict(n_ubatch=4, lane_count=3, kv_unified=False)
    prompts = {sid: smollm2_reference[p][0] for sid, p in zip("abc", PROMPTS)}
    chain = Chain(split_configs(smollm2, SMOLLM2_SPLITS["0:15/15:30"], slice_cache, **settings))
    try:
        rows, generated, lanes = chain_greedy(chain, prompts, 8, all_rows=False)
    finally:
        chain.close()
    reference = Reference(whole_config(smollm2, **settings))
    try:
        ref_rows, ref_tokens = reference.greedy_together(prompts, lanes, 8, all_rows=False)
    finally:
        reference.close()
    for sid, prompt in zip("abc", PROMPTS):
        diff = max_diff(rows[sid], ref_rows[sid])
        print(f"split 0:15/15:30 n_ubatch=4 session {sid}: max |logit diff| vs llama-cpp-python alike = {diff}")
        assert diff == 0.0
        assert generated[sid] == ref_tokens[sid] == smollm2_reference[prompt][2][:8]


def test_gemma3_split_off_the_sliding_window_period_matches_the_unsplit_model(gemma3, slice_cache):
    """5 and 11 are not multiples of Gemma-3's 6-layer window period: the per-layer pattern must survive."""
    prompts = PROMPTS[:2]
    reference = reference_run(gemma3, prompts, kv_unified=False)
    chain = Chain(split_configs(gemma3, [(0, 5), (5, 11), (11, 18)], slice_cache, kv_unified=False))
    try:
        for i, prompt in enumerate(prompts):
            tokens, ref_rows, ref_greedy = reference[prompt]
            rows, generated, _ = chain_greedy(chain, {f"g{i}": tokens}, N_TOKENS)
            diff = max_diff(rows[f"g{i}"], ref_rows)
            print(f"gemma3 0:5/5:11/11:18 prompt {i}: max |logit diff| over {len(ref_rows)} steps = {diff}")
            assert diff == 0.0
            assert generated[f"g{i}"] == ref_greedy
            chain.drop(f"g{i}")
    finally:
        chain.close()


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_an_eval_callback_changes_no_bits(model_name, request):
    """With ``cb_eval`` set, llama.cpp's scheduler computes the graph in pieces, one per node the
    callback asks for. The whole model in the stage runtime with a tap after every layer (the most
    pieces) and with no callback gives llama-cpp-python's logits, which it computes without one."""
    model = request.getfixturevalue(model_name)
    n_layers = read_model_info(model).block_count
    cfg = whole_config(model, ctx_size=256, lane_count=1)
    reference = Reference(cfg)
    try:
        tokens = np.random.default_rng(1).integers(0, reference.n_vocab, 40).tolist()
        reference.llm.eval(tokens[:32])
        ref_rows = [np.array(reference.llm.scores[31], dtype=np.float32)]
        for p in range(32, 40):
            reference.llm.eval([tokens[p]])
            ref_rows.append(np.array(reference.llm.scores[p], dtype=np.float32))
    finally:
        reference.close()
    for name, taps in (("no callback", ()), ("a tap after every layer", range(n_layers - 1))):
        runtime = StageRuntime(cfg, tap_layers=list(taps))
        try:
            feeds = [(0, tokens[:32])] + [(p, [tokens[p]]) for p in range(32, 40)]
            rows = []
            for start, feed in feeds:
                (r,) = runtime.run_batch([BatchEntry("s", np.arange(start, start + len(feed)), token_ids=feed,
                                                     want_logits=True, all_rows=True)])
                rows.append(r.logits)
                if taps:
                    assert set(runtime.take_taps()) == set(taps)
        finally:
            runtime.close()
        diff = max_diff(rows, ref_rows)
        print(f"{model_name}, runtime with {name}: max |logit diff| vs llama-cpp-python = {diff}")
        assert diff == 0.0
