"""A stage runtime refuses bad client input with a typed error, and keeps serving.

Everything a client sends is checked before it reaches llama.cpp, because llama.cpp answers
some bad input by aborting the whole process (more tokens than ``n_batch`` trips a
``GGML_ASSERT``). Every refusal here is made against the real SmolLM2 model split 0:15/15:30
and must

* raise the documented error type, with a message naming the field and the offending value;
* leave the lane table exactly as it was: no lane bound, no session advanced;
* leave the runtime able to run the next valid batch.

KV admission (lanes of ``ctx_size / lane_count`` cells) and sampling through llama.cpp's own
sampler chain at the final stage are specified here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from support.chain import Chain, Step, split_configs

from skippy_stage.errors import CapacityError, InvalidRequestError, SessionStateError, UnknownSessionError
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.kv_page import KvPage
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.sampling import SamplingParams

N_BATCH = 64
CTX_SIZE = 512
LANE_COUNT = 2
CELLS_PER_LANE = CTX_SIZE // LANE_COUNT
N_VOCAB = 49152
N_EMBD = 576
PROMPT = "The capital of France is"
SEEDED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@pytest.fixture(scope="module")
def chain(smollm2, slice_cache):
    """Two stage runtimes, built once for the module: stage-0 (0:15, the head) and stage-1 (15:30, final)."""
    configs = split_configs(
        smollm2, [(0, 15), (15, 30)], slice_cache,
        n_batch=N_BATCH, n_ubatch=N_BATCH, ctx_size=CTX_SIZE, lane_count=LANE_COUNT, kv_unified=False,
        n_threads=1,  # two stages share two cores: one thread each, so neither spins waiting for the other
    )
    built = Chain(configs)
    yield built
    built.close()


@pytest.fixture(scope="module")
def head(chain) -> StageRuntime:
    return chain.stages[0]


@pytest.fixture(scope="module")
def tail(chain) -> StageRuntime:
    return chain.stages[1]


@pytest.fixture(scope="module")
def prompt(head) -> list[int]:
    return head.tokenizer.tokenize(PROMPT)


@pytest.fixture(autouse=True)
def no_session_outlives_a_test(chain):
    """Drop whatever a test left bound, so a failing test cannot poison the next one."""
    yield
    for stage in chain.stages:
        for row in stage.stats().lanes:
            if row.state == "active":
                stage.drop_session(row.session_id)


# -- helpers -------------------------------------------------------------------------


def rows(n: int, width: int = N_EMBD, dtype: type = np.float32) -> np.ndarray:
    """Hidden rows as an upstream stage would send them (values do not matter to validation)."""
    return np.zeros((n, width), dtype=dtype)


def generate(
    chain: Chain, session_id: str, tokens: Sequence[int], n_tokens: int, sampling: SamplingParams | None = None,
) -> tuple[list[int], list[np.ndarray]]:
    """Prefill ``tokens`` and sample ``n_tokens`` tokens through the chain, then drop the session.

    Each generated token is fed back as the next step's token ids, as the head does, so the
    final stage's sampler sees the whole history.
    """
    out: list[int] = []
    logits: list[np.ndarray] = []
    start, step_tokens = 0, list(tokens)
    for _ in range(n_tokens):
        (result,) = chain.step([Step(session_id, start, step_tokens, sampling=sampling)])
        out.append(result.token)
        logits.append(result.logits)
        start, step_tokens = start + len(step_tokens), [result.token]
    chain.drop(session_id)
    return out, logits


def assert_serves(chain: Chain, prompt: list[int]) -> None:
    """A valid request right after a refusal runs through both stages, and leaves nothing behind."""
    (result,) = chain.step([Step("after-refusal", 0, prompt)])
    assert result.logits.shape == (N_VOCAB,)
    assert result.token == int(np.argmax(result.logits))
    chain.drop("after-refusal")
    assert [stage.stats().active_sessions for stage in chain.stages] == [0, 0]


def refuse(stage: StageRuntime, entries: list[BatchEntry], error: type[Exception], *names: str) -> str:
    """Run a batch that must be refused: assert the error type, the message and untouched lanes."""
    before = stage.stats()
    with pytest.raises(error) as raised:
        stage.run_batch(entries)
    message = str(raised.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    assert stage.stats() == before, "a refused batch changed the lane table"
    return message


# -- the runtime under test ------------------------------------------------------------


def test_the_split_has_the_shapes_these_tests_assume(head, tail):
    assert (head.n_vocab, head.n_embd, tail.n_vocab, tail.n_embd) == (N_VOCAB, N_EMBD, N_VOCAB, N_EMBD)
    assert head.cells_per_lane == tail.cells_per_lane == CELLS_PER_LANE
    stats = head.stats()
    assert (stats.lane_count, stats.kv_cells_per_lane, stats.active_sessions) == (LANE_COUNT, CELLS_PER_LANE, 0)


# -- batch size: the input llama.cpp would abort the process on -------------------------


def test_a_batch_of_exactly_n_batch_tokens_runs(chain, head, prompt):
    head.run_batch([BatchEntry("full", np.arange(N_BATCH), token_ids=list(range(1000, 1000 + N_BATCH)))])
    assert head.lanes.lane_of("full").n_tokens == N_BATCH
    head.drop_session("full")
    assert_serves(chain, prompt)


def test_one_token_over_n_batch_is_refused_and_the_stage_survives(chain, head, prompt):
    too_many = N_BATCH + 1
    entries = [BatchEntry("big", np.arange(too_many), token_ids=[1000] * too_many)]
    refuse(head, entries, InvalidRequestError, f"n_batch={N_BATCH}", f"total to {too_many}")
    assert_serves(chain, prompt)


def test_n_batch_counts_the_tokens_of_every_entry_together(chain, head, prompt):
    entries = [
        BatchEntry("a", np.arange(40), token_ids=[1000] * 40),
        BatchEntry("b", np.arange(25), token_ids=[1000] * 25),
    ]
    refuse(head, entries, InvalidRequestError, f"n_batch={N_BATCH}", "entries[1]", "total to 65")
    assert_serves(chain, prompt)


def test_hidden_rows_over_n_batch_are_refused_at_an_inner_stage_too(chain, tail, prompt):
    entries = [BatchEntry("big", np.arange(N_BATCH + 1), hidden=rows(N_BATCH + 1))]
    refuse(tail, entries, InvalidRequestError, f"n_batch={N_BATCH}", f"total to {N_BATCH + 1}")
    assert_serves(chain, prompt)


# -- token ids -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", [N_VOCAB, N_VOCAB + 1000, -1, -(2**31)], ids=["n_vocab", "beyond", "minus-one", "int32-min"],
)
@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_token_id_outside_the_vocabulary_is_refused(chain, prompt, where, bad):
    """The tail takes token ids too (for the sampler's history), so it checks them as well."""
    stage = chain.stages[0 if where == "head" else 1]
    tokens = [1, 2, bad, 3]
    hidden = None if where == "head" else rows(4)
    entries = [BatchEntry("t", np.arange(4), token_ids=tokens, hidden=hidden)]
    refuse(stage, entries, InvalidRequestError, f"token_ids[2]={bad}", str(N_VOCAB))
    assert_serves(chain, prompt)


def test_token_ids_are_required_at_stage_0(chain, head, prompt):
    refuse(head, [BatchEntry("t", np.arange(3))], InvalidRequestError, "token_ids", "stage-0")
    assert_serves(chain, prompt)


def test_token_ids_must_match_the_positions(chain, head, prompt):
    entries = [BatchEntry("t", np.arange(3), token_ids=[1, 2])]
    refuse(head, entries, InvalidRequestError, "token_ids", "3 positions")
    assert_serves(chain, prompt)


# -- hidden rows at an inner stage -----------------------------------------------------


def test_hidden_rows_of_the_wrong_width_are_refused(chain, tail, prompt):
    entries = [BatchEntry("h", np.arange(4), hidden=rows(4, width=512))]
    refuse(tail, entries, InvalidRequestError, "hidden", "width 512", f"n_embd {N_EMBD}")
    assert_serves(chain, prompt)


def test_hidden_rows_must_be_one_per_position(chain, tail, prompt):
    entries = [BatchEntry("h", np.arange(4), hidden=rows(3))]
    refuse(tail, entries, InvalidRequestError, "hidden", "3 rows", "4 positions")
    assert_serves(chain, prompt)


def test_hidden_rows_must_be_float32(chain, tail, prompt):
    entries = [BatchEntry("h", np.arange(4), hidden=rows(4, dtype=np.float64))]
    refuse(tail, entries, InvalidRequestError, "hidden", "float64", "float32")
    assert_serves(chain, prompt)


def test_hidden_rows_are_required_after_stage_0_and_refused_at_it(chain, head, tail, prompt):
    refuse(tail, [BatchEntry("h", np.arange(2), token_ids=[1, 2])], InvalidRequestError, "hidden", str(N_EMBD))
    refuse(head, [BatchEntry("h", np.arange(2), token_ids=[1, 2], hidden=rows(2))], InvalidRequestError,
           "hidden", "stage-0")
    assert_serves(chain, prompt)


# -- positions and session order -------------------------------------------------------


def test_positions_with_a_gap_are_refused(chain, head, prompt):
    entries = [BatchEntry("p", [0, 1, 2, 5], token_ids=[1, 2, 3, 4])]
    refuse(head, entries, InvalidRequestError, "positions", "positions[2]=2", "followed by 5")
    assert_serves(chain, prompt)


def test_negative_and_empty_positions_are_refused(chain, head, prompt):
    refuse(head, [BatchEntry("p", [-1, 0], token_ids=[1, 2])], InvalidRequestError, "positions[0]=-1")
    refuse(head, [BatchEntry("p", [], token_ids=[])], InvalidRequestError, "positions", "non-empty")
    assert_serves(chain, prompt)


def test_a_session_continues_only_at_its_next_position(chain, head, prompt):
    """A refused out-of-order step writes no KV: the continuation equals an undisturbed run."""
    expected, _ = generate(chain, "reference", prompt, 2)
    (first,) = chain.step([Step("s", 0, prompt)])
    assert first.token == expected[0]
    n = len(prompt)
    for start in (n + 2, n - 1, 0):
        entries = [BatchEntry("s", np.arange(start, start + 1), token_ids=[first.token])]
        refuse(head, entries, SessionStateError, f"positions[0]={start}", "session_id='s'", f"next position {n}")
    assert head.lanes.lane_of("s").n_tokens == n
    (second,) = chain.step([Step("s", n, [first.token])])
    assert second.token == expected[1]
    chain.drop("s")
    assert_serves(chain, prompt)


def test_an_unknown_session_must_start_at_position_0(chain, head, tail, prompt):
    names = ("session_id='ghost'", "start at 5")
    refuse(head, [BatchEntry("ghost", [5, 6], token_ids=[1, 2])], UnknownSessionError, *names)
    refuse(tail, [BatchEntry("ghost", [5, 6], hidden=rows(2))], UnknownSessionError, *names)
    assert_serves(chain, prompt)


# -- the shape of a batch --------------------------------------------------------------


def test_an_empty_batch_is_refused(chain, head, prompt):
    refuse(head, [], InvalidRequestError, "entries", "empty")
    assert_serves(chain, prompt)


def test_a_session_may_appear_only_once_per_batch(chain, head, prompt):
    entries = [BatchEntry("dup", [0], token_ids=[1]), BatchEntry("dup", [0], token_ids=[2])]
    refuse(head, entries, InvalidRequestError, "entries[1].session_id='dup'", "twice")
    assert_serves(chain, prompt)


@pytest.mark.parametrize("session_id", ["", "x" * 257], ids=["empty", "too-long"])
def test_a_session_id_must_be_1_to_256_characters(chain, head, prompt, session_id):
    entries = [BatchEntry(session_id, [0], token_ids=[1])]
    refuse(head, entries, InvalidRequestError, f"session_id={session_id!r}", "1..256")
    assert_serves(chain, prompt)


@pytest.mark.parametrize("ask", ["sample", "want_logits"])
def test_only_the_final_stage_samples_or_returns_logits(chain, head, prompt, ask):
    entries = [BatchEntry("s", np.arange(len(prompt)), token_ids=prompt, **{ask: True})]
    refuse(head, entries, InvalidRequestError, "entries[0]", "stage-0", "not the final stage")
    assert_serves(chain, prompt)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
     ("top_k", -1), ("min_p", 1.0), ("repeat_penalty", 0.0), ("repeat_last_n", -1), ("seed", -1),
     ("frequency_penalty", 2.5), ("presence_penalty", float("inf"))],
)
def test_invalid_sampling_params_are_refused_naming_the_field(chain, tail, prompt, field, value):
    entries = [BatchEntry("s", np.arange(2), hidden=rows(2), sample=True, sampling=SamplingParams(**{field: value}))]
    refuse(tail, entries, InvalidRequestError, f"sampling.{field}={value!r}")
    assert_serves(chain, prompt)


# -- KV admission and lanes ------------------------------------------------------------


def test_sampling_settings_are_checked_once_per_object_and_a_bad_one_every_time(monkeypatch):
    from skippy_stage.model import sampling

    calls = []
    real = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(self) or real(self))
    good, bad = SamplingParams(temperature=0.3), SamplingParams(temperature=-1.0)
    assert sampling.validated_once(good) is good and sampling.validated_once(good) is good
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="temperature"):
            sampling.validated_once(bad)
    assert calls == [good, bad, bad], "a refused object is not remembered"


def test_a_session_may_fill_its_lane_but_not_overflow_it(chain, head, prompt):
    """Each lane holds ctx_size / lane_count cells; overflow is refused before llama_decode."""
    filled = 0
    for n in (64, 64, 64, 58):
        head.run_batch([BatchEntry("long", np.arange(filled, filled + n), token_ids=[1000] * n)])
        filled += n
    assert filled == CELLS_PER_LANE - 6
    entries = [BatchEntry("long", np.arange(filled, filled + 10), token_ids=[1000] * 10)]
    refuse(head, entries, CapacityError, "session_id='long'", f"{filled + 10} tokens", f"{CELLS_PER_LANE} KV cells")
    head.run_batch([BatchEntry("long", np.arange(filled, CELLS_PER_LANE), token_ids=[1000] * 6)])
    assert head.lanes.lane_of("long").n_tokens == CELLS_PER_LANE
    entries = [BatchEntry("long", [CELLS_PER_LANE], token_ids=[1000])]
    refuse(head, entries, CapacityError, f"{CELLS_PER_LANE + 1} tokens", f"{CELLS_PER_LANE} KV cells")
    drop = head.drop_session("long")
    assert drop.n_tokens == CELLS_PER_LANE
    assert_serves(chain, prompt)


def test_a_new_session_needs_a_free_lane_and_reuses_a_dropped_one(chain, head, prompt):
    def new(session_id: str) -> BatchEntry:
        return BatchEntry(session_id, np.arange(len(prompt)), token_ids=prompt)

    head.run_batch([new("a")])
    # Two new sessions with one lane left: all-or-nothing, so neither is bound.
    refuse(head, [new("b"), new("c")], CapacityError, "all execution lanes are busy", f"lane_count={LANE_COUNT}")
    head.run_batch([new("b")])
    refuse(head, [new("c")], CapacityError, "all execution lanes are busy")
    lane_of_b = head.lanes.lane_of("b").lane

    drop = head.drop_session("b")
    assert (drop.lane, drop.n_tokens, drop.discarded) == (lane_of_b, len(prompt), False)
    head.run_batch([new("c")])
    rows_by_lane = {row.lane: row for row in head.stats().lanes}
    assert (rows_by_lane[lane_of_b].state, rows_by_lane[lane_of_b].session_id) == ("active", "c")
    assert rows_by_lane[lane_of_b].n_tokens == len(prompt)
    assert head.stats().active_sessions == 2
    head.drop_session("a")
    head.drop_session("c")
    assert_serves(chain, prompt)


def test_dropping_a_session_resets_its_lane_and_reports_the_time(chain, head, prompt):
    with pytest.raises(UnknownSessionError, match="session_id='nobody'"):
        head.drop_session("nobody")
    head.run_batch([BatchEntry("d", np.arange(len(prompt)), token_ids=prompt)])
    lane = head.lanes.lane_of("d").lane
    assert head.stats().active_sessions == 1
    drop = head.drop_session("d")
    assert (drop.session_id, drop.lane, drop.n_tokens, drop.discarded) == ("d", lane, len(prompt), False)
    assert drop.reset_seconds >= 0.0
    stats = head.stats()
    assert (stats.active_sessions, stats.total_session_tokens) == (0, 0)
    assert {row.lane: row.state for row in stats.lanes}[lane] == "idle"
    with pytest.raises(UnknownSessionError, match="session_id='d'"):
        head.drop_session("d")
    # The dropped session starts over from position 0, on a reset lane.
    refuse(head, [BatchEntry("d", [len(prompt)], token_ids=[1])], UnknownSessionError, "session_id='d'")
    assert_serves(chain, prompt)


# -- sampling at the final stage (llama.cpp's sampler chain) ----------------------------


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(chain, head):
    tokens = head.tokenizer.tokenize("Once upon a time")
    first, _ = generate(chain, "seed-a", tokens, 16, SamplingParams(**SEEDED, seed=1234))
    again, _ = generate(chain, "seed-b", tokens, 16, SamplingParams(**SEEDED, seed=1234))
    other, _ = generate(chain, "seed-c", tokens, 16, SamplingParams(**SEEDED, seed=4321))
    assert first == again
    assert first != other


def test_greedy_sampling_picks_the_argmax_of_the_returned_logits(chain, prompt):
    tokens, logits = generate(chain, "greedy", prompt, 16, SamplingParams(temperature=0.0))
    assert tokens == [int(np.argmax(row)) for row in logits]


def test_plain_greedy_read_in_place_picks_what_llama_cpps_greedy_sampler_picks(chain, head, tail, prompt):
    """Plain greedy skips llama_sampler_sample's copy of every logit into a candidate array; the
    token must still be exactly llama.cpp's (the first maximum), row by row."""
    import llama_cpp

    from skippy_stage.model.sampling import SamplerChain

    (hidden,) = head.run_batch([BatchEntry("rows", np.arange(len(prompt)), token_ids=prompt)])
    tail.run_batch([BatchEntry("rows", np.arange(len(prompt)), token_ids=prompt, hidden=hidden.hidden,
                               sample=True, all_rows=True)])
    ours = SamplerChain(SamplingParams(temperature=0.0), N_VOCAB)
    theirs = llama_cpp.llama_sampler_init_greedy()
    try:
        assert ours.argmax
        for row in range(len(prompt)):
            assert ours.sample(tail._ctx, row) == llama_cpp.llama_sampler_sample(theirs, tail._ctx, row)
    finally:
        ours.close()
        llama_cpp.llama_sampler_free(theirs)
        chain.drop("rows")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, repeat_penalty=1.3),
                                    SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)),
                                    SamplingParams(temperature=0.7)])
def test_greedy_with_a_penalty_or_a_bias_and_any_temperature_go_through_llama_cpps_chain(params):
    from skippy_stage.model.sampling import SamplerChain

    chain = SamplerChain(params, N_VOCAB)
    try:
        assert not chain.argmax
    finally:
        chain.close()


def test_top_k_1_at_temperature_1_is_greedy(chain, prompt):
    greedy, _ = generate(chain, "greedy", prompt, 16, SamplingParams())
    top1, _ = generate(chain, "top-k-1", prompt, 16, SamplingParams(temperature=1.0, top_k=1, seed=7))
    assert top1 == greedy


REPETITIVE = "one, one, one, one, one,"


def test_repeat_penalty_sees_the_prompt_that_flows_down_the_chain(chain, head):
    """The prompt reaches the final stage as token ids, so even the first token is penalised.

    Without a penalty the model continues the pattern with " one", a prompt token; with
    repeat_penalty 1.5 that token is penalised and the very first sampled token changes.
    """
    tokens = head.tokenizer.tokenize(REPETITIVE)
    plain, _ = generate(chain, "plain", tokens, 8, SamplingParams())
    assert plain[0] in tokens
    penalised, _ = generate(chain, "penalised", tokens, 8, SamplingParams(repeat_penalty=1.5))
    assert penalised[0] != plain[0]
    assert penalised != plain


def test_repeat_penalty_window_holds_the_last_n_tokens_of_the_history(chain, head):
    """Greedy with a penalty picks the argmax of the logits penalised over the last repeat_last_n tokens."""
    penalty, last_n = 1.5, 2
    factor = np.float32(penalty)
    tokens = head.tokenizer.tokenize("one one one one one one")
    params = SamplingParams(repeat_penalty=penalty, repeat_last_n=last_n)
    out, logits = generate(chain, "window", tokens, 24, params)
    history = list(tokens)
    expected = []
    for row, token in zip(logits, out):
        penalised = row.copy()
        for t in set(history[-last_n:]):  # llama.cpp: multiply a non-positive logit, divide a positive one
            penalised[t] = penalised[t] * factor if penalised[t] <= 0 else penalised[t] / factor
        expected.append(int(np.argmax(penalised)))
        history.append(token)
    assert out == expected


def test_frequency_and_presence_penalties_subtract_per_occurrence_and_once_over_the_window(chain, head):
    """OpenAI's penalties, llama.cpp's sampler: greedy picks the argmax of the logits less
    frequency x count and presence x (count > 0) over the last repeat_last_n tokens, prompt included."""
    frequency, presence, last_n = 0.7, 0.4, 16
    tokens = head.tokenizer.tokenize("one two one two one two one")
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence, repeat_last_n=last_n)
    out, logits = generate(chain, "openai-penalties", tokens, 16, params)
    history = list(tokens)
    expected = []
    for row, token in zip(logits, out):
        penalised = row.copy()
        window = history[-last_n:]
        for t in set(window):
            penalised[t] -= np.float32(window.count(t)) * np.float32(frequency) + np.float32(presence)
        expected.append(int(np.argmax(penalised)))
        history.append(token)
    assert out == expected
    plain, _ = generate(chain, "no-penalties", tokens, 16, SamplingParams())
    assert out != plain


def test_a_session_cut_back_and_fed_other_tokens_computes_what_a_fresh_session_fed_those_tokens_does(
        smollm2, slice_cache):
    """The KV past the cut is gone on every stage: an edited continuation equals a session that
    never had the old tokens, run in the same batch shapes (a prefill, then one token a step)."""
    chain = Chain(split_configs(smollm2, [(0, 10), (10, 20), (20, 30)], slice_cache, kv_unified=False))
    try:
        prompt = chain.head.tokenizer.tokenize("The capital of France is", add_special=True, parse_special=False)
        _, by_session = chain.greedy({"a": prompt}, 8)  # the lanes hold the prompt and 7 fed tokens
        generated = by_session["a"]
        cut = len(prompt) + 3
        assert [stage.trim_session("a", cut) for stage in chain.stages] == [len(prompt) + 7] * 3
        edit = [generated[5]]  # not the token that stood at position `cut`
        got = forced_then_greedy(chain, "a", cut, edit, 4)

        chain.step([Step("b", 0, prompt, want_logits=False)])
        for i, token in enumerate(generated[:3]):
            chain.step([Step("b", len(prompt) + i, [token], want_logits=False)])
        want = forced_then_greedy(chain, "b", cut, edit, 4)
        assert got == want
    finally:
        chain.close()


def forced_then_greedy(chain: Chain, session_id: str, start: int, forced: list[int], n: int) -> list[int]:
    (out,) = chain.step([Step(session_id, start, forced, want_logits=False)])
    tokens = [out.token]
    for i in range(n - 1):
        (out,) = chain.step([Step(session_id, start + len(forced) + i, [tokens[-1]], want_logits=False)])
        tokens.append(out.token)
    return tokens


def test_a_session_exported_from_every_stage_and_imported_under_a_new_id_continues_identically(smollm2, slice_cache):
    """KV pages: each stage's part of session ``s`` becomes session ``t`` on the same stage; both
    then decode the same tokens, one session at a time (the same batch shapes)."""
    chain = Chain(split_configs(smollm2, [(0, 10), (10, 20), (20, 30)], slice_cache, kv_unified=False))
    try:
        prompt = chain.head.tokenizer.tokenize("Once upon a time", add_special=True, parse_special=False)
        _, by_session = chain.greedy({"s": prompt}, 4)
        held = len(prompt) + 3
        pages = [stage.export_session("s", 1 << 26) for stage in chain.stages]
        assert [p.descriptor.n_tokens for p in pages] == [held] * 3
        assert [(p.descriptor.layer_start, p.descriptor.layer_end) for p in pages] == [(0, 10), (10, 20), (20, 30)]
        assert [stage.import_session("t", page) for stage, page in zip(chain.stages, pages)] == [held] * 3
        last = by_session["s"][-1]
        assert forced_then_greedy(chain, "t", held, [last], 5) == forced_then_greedy(chain, "s", held, [last], 5)
    finally:
        chain.close()


def test_a_page_import_is_refused_by_the_field_that_does_not_match(smollm2, slice_cache):
    chain = Chain(split_configs(smollm2, [(0, 10), (10, 20), (20, 30)], slice_cache, kv_unified=False))
    try:
        prompt = chain.head.tokenizer.tokenize("Hello there", add_special=True, parse_special=False)
        chain.greedy({"s": prompt}, 2)
        page = chain.stages[1].export_session("s", 1 << 26)
        with pytest.raises(InvalidRequestError, match="page.descriptor.model_digest=.* does not match stage stage-2"):
            chain.stages[2].import_session("t", page)
        for field, value in (("layer_start", 20), ("cache_type_k", "q8_0"), ("model_digest", "0" * 64)):
            bad = KvPage(dataclasses.replace(page.descriptor, **{field: value}), page.data, page.token_ids)
            with pytest.raises(InvalidRequestError, match=f"page.descriptor.{field}={value!r} does not match"):
                chain.stages[1].import_session("t", bad)
        truncated = KvPage(page.descriptor, page.data[: len(page.data) // 2], page.token_ids)
        with pytest.raises(InvalidRequestError, match="is not a KV state of page.descriptor.n_tokens=3 positions"):
            chain.stages[1].import_session("t", truncated)
        with pytest.raises(SessionStateError, match="already bound"):
            chain.stages[1].import_session("s", page)
        assert chain.stages[1].stats().active_sessions == 1  # only "s": no refused import kept a lane
        with pytest.raises(CapacityError, match="more than max_message_bytes=16"):
            chain.stages[1].export_session("s", 16)
    finally:
        chain.close()


# -- forks: n choices of one prompt --------------------------------------------------


def test_a_fork_starts_from_its_sources_kv_and_then_goes_its_own_way(chain, prompt):
    """``fork_of`` copies the first positions[0] tokens of a live session's KV on every stage: the
    fork's first logits equal its source's (computed in the same batch), and each then continues as
    if alone; feeding the fork other tokens leaves the source's continuation untouched."""
    n = len(prompt)
    chain.step([Step("src", 0, prompt[:-1], want_logits=False, sample=False)])
    src, fork = chain.step([Step("src", n - 1, prompt[-1:]), Step("fork", n - 1, prompt[-1:], fork_of="src")])
    assert np.array_equal(src.logits, fork.logits)
    assert [stage.stats().total_session_tokens for stage in chain.stages] == [2 * n, 2 * n]
    other = int(np.argsort(src.logits)[-2])  # the fork takes the runner-up, the source its argmax
    got = [src.token]
    outs = chain.step([Step("src", n, [src.token], want_logits=False), Step("fork", n, [other], want_logits=False)])
    got.append(outs[0].token)
    for i in range(3):
        (out, _) = chain.step([Step("src", n + 1 + i, [got[-1]], want_logits=False),
                               Step("fork", n + 1 + i, [outs[1].token], want_logits=False)])
        got.append(out.token)
    chain.drop("src")
    chain.drop("fork")
    want, _ = generate(chain, "alone", prompt, 5)
    assert got == want


@pytest.mark.parametrize("case", ["unknown source", "more than it holds", "bound already", "itself", "with a prefix"])
def test_a_fork_of_what_cannot_be_copied_is_refused_naming_fork_of(chain, head, prompt, case):
    if case != "unknown source":
        chain.step([Step("src", 0, prompt, sample=False)])
    if case == "bound already":
        head.run_batch([BatchEntry("twin", [0], token_ids=prompt[:1])])
    n = len(prompt)
    entry, error = {
        "unknown source": (BatchEntry("f", [0], token_ids=[1], fork_of="nobody"), UnknownSessionError),
        "more than it holds": (BatchEntry("f", [n + 1], token_ids=[1], fork_of="src"), SessionStateError),
        "bound already": (BatchEntry("twin", [1], token_ids=[1], fork_of="src"), SessionStateError),
        "itself": (BatchEntry("src", [n], token_ids=[1], fork_of="src"), InvalidRequestError),
        "with a prefix": (BatchEntry("f", [1], token_ids=[1], fork_of="src", prefix_id="p"), InvalidRequestError),
    }[case]
    refuse(head, [entry], error, "fork_of")
    for stage in chain.stages:
        for session_id in ("src", "twin"):
            if stage.lanes.lane_of(session_id) is not None:
                stage.drop_session(session_id)
    assert_serves(chain, prompt)


# -- a prompt's logprobs -------------------------------------------------------------


def prompt_logprobs_of(chain: Chain, session_id: str, start: int, tokens: list[int], next_token: int | None):
    """One prompt chunk through both stages asking the final stage for its rows' logprobs."""
    positions = np.arange(start, start + len(tokens))
    (inner,) = chain.stages[0].run_batch([BatchEntry(session_id, positions, token_ids=tokens)])
    (out,) = chain.stages[1].run_batch([BatchEntry(session_id, positions, token_ids=tokens, hidden=inner.hidden,
                                                   prompt_logprobs=3, next_token=next_token)])
    return out.prompt_logprobs


def test_a_prompts_logprobs_come_row_by_row_and_across_chunks_through_next_token(chain, head, prompt):
    """Row i gives the log-probability of the token that follows it, with the 3 most likely; the
    last row of a chunk needs the next chunk's first token (``next_token``); chunked, the values
    are those of the prompt in one batch (float tolerance: other batch shapes)."""
    whole = prompt_logprobs_of(chain, "whole", 0, prompt, None)
    cut = len(prompt) // 2
    first = prompt_logprobs_of(chain, "chunked", 0, prompt[:cut], prompt[cut])
    second = prompt_logprobs_of(chain, "chunked", cut, prompt[cut:], None)
    assert [lp.token for lp in whole] == prompt[1:] == [lp.token for lp in first + second]
    for a, b in zip(whole, first + second):
        assert abs(a.logprob - b.logprob) < 1e-3 and len(a.top) == 3
        assert a.top[0][1] >= a.logprob - 1e-6
    for session_id in ("whole", "chunked"):
        chain.drop(session_id)


@pytest.mark.parametrize(("field", "value"), [("prompt_logprobs", 21), ("prompt_logprobs", -1), ("next_token", N_VOCAB)])
def test_bad_prompt_logprobs_are_refused_naming_the_field(chain, tail, prompt, field, value):
    entry = BatchEntry("s", np.arange(len(prompt)), token_ids=prompt, hidden=rows(len(prompt)),
                       **{"prompt_logprobs": 2, field: value})
    refuse(tail, [entry], InvalidRequestError, field)


# -- seeded sampling -----------------------------------------------------------------


def test_seeded_sampling_equals_llama_cpp_pythons_for_the_same_seed(smollm2, chain, head):
    """The final stage's chain is llama.cpp's, in llama-cpp-python's order, drawing from the same
    seeded stream: a split samples the unsplit model's text at temperature > 0 too."""
    from skippy_stage.model.loader import reference_llama

    llm = reference_llama(smollm2, n_ctx=512, verbose=False)
    try:
        want = llm.create_completion("Once upon a time", max_tokens=12, seed=42, repeat_penalty=1.0,
                                     **SEEDED)["choices"][0]["text"]
    finally:
        llm.close()
    tokens, _ = generate(chain, "seeded", head.tokenizer.tokenize("Once upon a time"), 12,
                         SamplingParams(seed=42, **SEEDED))
    assert b"".join(head.tokenizer.token_bytes(t) for t in tokens).decode("utf-8", errors="ignore") == want


def test_a_sampler_built_mid_session_skips_the_draws_before_it_and_samples_what_the_first_would_have(chain, prompt):
    """A session whose sampler is rebuilt (a hand-off, a recovery, a trim) is told how many samples
    came before (``draws_before``): with the same KV and seed, it continues the seeded text exactly."""
    sampling = SamplingParams(seed=1234, **SEEDED)
    first, _ = generate(chain, "first", prompt, 10, sampling)
    chain.step([Step("again", 0, prompt, want_logits=False, sample=False)])
    for i, token in enumerate(first[:4]):
        chain.step([Step("again", len(prompt) + i, [token], want_logits=False, sample=False)])
    out = []
    for i in range(5):
        fed = [first[4]] if i == 0 else [out[-1]]
        (result,) = chain.step([Step("again", len(prompt) + 4 + i, fed, want_logits=False, sampling=sampling,
                                     draws_before=5 + i)])
        out.append(result.token)
    chain.drop("again")
    assert out == first[5:]


def test_draws_before_beyond_what_a_session_can_have_taken_is_refused_naming_it(chain, tail, prompt):
    """A session samples once per token it holds: a larger count (a skip a client could make the
    stage spend seconds on) is refused."""
    entry = BatchEntry("s", np.arange(len(prompt)), token_ids=prompt, hidden=rows(len(prompt)), sample=True,
                       sampling=SamplingParams(seed=1, **SEEDED), draws_before=1)
    refuse(tail, [entry], InvalidRequestError, "draws_before=1", "positions[0]=0")


def test_llama_cpps_dist_sampler_draws_once_per_sample_whatever_the_candidates():
    """What skipping draws relies on, pinned: one, two or a thousand candidates, each sample takes
    one draw from the seeded stream (a llama.cpp whose dist sampler stops drawing for a single
    candidate fails here, not in a recovery)."""
    import ctypes

    import llama_cpp

    from skippy_stage.model.sampling import _TOKEN_DATA

    def picks(sizes: list[int]) -> list[int]:
        dist = llama_cpp.llama_sampler_init_dist(42)
        out = []
        for n in sizes:
            data = np.zeros(n, dtype=_TOKEN_DATA)
            data["id"], data["logit"] = np.arange(n), np.linspace(0, 1, n)
            arr = llama_cpp.llama_token_data_array(data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                                   n, -1, False)
            llama_cpp.llama_sampler_apply(dist, ctypes.byref(arr))
            out.append(int(arr.selected))
        llama_cpp.llama_sampler_free(dist)
        return out

    plain = picks([1000] * 6)
    assert picks([1, 1, 1] + [1000] * 3)[3:] == plain[3:] == picks([2, 2, 2] + [1000] * 3)[3:]


def test_logit_bias_moves_the_greedy_choice_and_a_token_outside_the_vocabulary_is_refused(chain, tail, prompt):
    """OpenAI's logit_bias, llama.cpp's sampler, first in the chain: -100 bans the greedy token, +100
    on another token makes it the greedy choice every time."""
    plain, logits = generate(chain, "unbiased", prompt, 1, SamplingParams())
    banned, _ = generate(chain, "banned", prompt, 1, SamplingParams(logit_bias=((plain[0], -100.0),)))
    assert banned[0] != plain[0] and banned[0] == int(np.argsort(logits[0])[-2])
    forced, _ = generate(chain, "forced", prompt, 4, SamplingParams(logit_bias=((42, 100.0),)))
    assert forced == [42] * 4
    entry = BatchEntry("s", np.arange(2), hidden=rows(2), sample=True,
                       sampling=SamplingParams(logit_bias=((N_VOCAB, 1.0),)))
    refuse(tail, [entry], InvalidRequestError, f"logit_bias names token {N_VOCAB}")
