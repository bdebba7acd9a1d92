"""A final stage with ``native_mtp_enabled`` drafts with the model's own next-n (MTP) layers.

The model is a random-weight DeepSeek-2 (MLA + MoE) with one next-n block (``mtp_fixture``),
split 0:3 / 3:7: the head runs three trunk layers, the final stage the other three and the
next-n block, which its slice keeps. The final stage returns with each sample the MTP layers'
guess of the token after it (``EntryResult.draft``). Held to:

- the trunk: with MTP on, the split computes bit for bit what the unsplit model with MTP on
  computes, and what the unsplit model without its next-n layers computes for every batch whose
  rows are all outputs (one-token steps, verify and ``all_rows`` batches); a multi-row batch with
  one output row differs in the last bits (the last layer then runs over every row, for its h);
- the drafts: driven with the batches of the one-process reference (``support.mtp_reference``:
  the prompt, then ``[last sample, draft]`` verify batches, a rejected draft rewound), each step's
  draft is the reference's, and the committed tokens are plain greedy decoding's; this for every
  attention-only architecture with an MTP graph in the pinned llama.cpp (``ARCHS``: deepseek2,
  deepseek32, cohere2moe, hy_v3, mimo2), the sliding-window ones decoding past their window;
- refusals, by name: on a stage with a downstream, on a model without next-n layers, on a
  recurrent model (its state cannot be cut back after a rejected draft);
- lanes: a session on a lane another session used drafts what it drafts on a fresh runtime.

Random weights almost never draft right (acceptance is printed); an oracle's drafts take the
accepting branch, so both branches of every verify step are exercised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from support.mtp_reference import MtpModel, greedy_decode, mtp_decode

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, InvalidRequestError
from skippy_stage.model import synthetic
from skippy_stage.model.batch import NO_DRAFT, BatchEntry
from skippy_stage.model.chain import Chain, Step, chain_configs
from skippy_stage.model.mtp_fixture import with_nextn

SPECS = synthetic.load_specs(Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz")
STEM = "deepseek2-moe"  # 6 trunk blocks + 1 next-n block
SPLIT = [(0, 3), (3, 7)]
PROMPT = [1, 5, 9, 17, 33, 65, 2, 7]
OTHER_PROMPT = [3, 4, 100, 8, 50]
N_TOKENS = 24
# The reference's context (support.mtp_reference): the same cells, lanes and batch sizes.
CONTEXT = dict(ctx_size=256, lane_count=1, n_batch=64, n_ubatch=64, n_threads=2)


@dataclass(frozen=True)
class ArchCase:
    split: list[tuple[int, int]]  # ranges the slicer accepts; the final stage holds the next-n block
    n_tokens: int = N_TOKENS


# Attention-only architectures whose pinned llama.cpp has an MTP graph (the hybrids qwen35,
# qwen35moe and qwen3next have one too, but a stage refuses to speculate on recurrent state).
ARCHS = {
    "deepseek2-moe": ArchCase(SPLIT),
    # The trunk attends through the DSA cache; the MTP context runs dense MLA over a plain KV cache.
    "deepseek32-moe": ArchCase([(0, 3), (3, 7)]),
    # The final stage: one sliding-window trunk layer, the full-attention next-n block. 32 tokens
    # after an 8-token prompt run past the fixture's 32-token window.
    "cohere2moe-moe": ArchCase([(0, 5), (5, 7)], n_tokens=32),
    "hy_v3-moe": ArchCase([(0, 4), (4, 7)]),
    # A sliding-window next-n block with fused QKV and a dense FFN; the final stage has no full attention.
    "mimo2-moe": ArchCase([(0, 5), (5, 7)], n_tokens=32),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp-stage")
    return {
        "mtp": synthetic.write_model(with_nextn(SPECS[STEM]), root / f"{STEM}-mtp.gguf", seed=42),
        "plain": synthetic.write_model(SPECS[STEM], root / f"{STEM}.gguf", seed=42),
        "recurrent": synthetic.write_model(with_nextn(SPECS["qwen35-dense"]), root / "qwen35-mtp.gguf", seed=42),
        "cache": root / "cache",
    }


def configs(model: Path, cache: Path, ranges: Sequence[tuple[int, int]] = SPLIT, *, mtp: bool = True,
            **settings: object) -> list[StageConfig]:
    out = chain_configs(model, ranges, cache, **{**CONTEXT, **settings})
    out[-1] = out[-1].replace(native_mtp_enabled=mtp)
    return out


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]):
    with MtpModel(models["mtp"]) as model:
        greedy = greedy_decode(model, PROMPT, N_TOKENS)
        yield {
            "greedy": greedy,
            "mtp": mtp_decode(model, PROMPT, N_TOKENS),
            "oracle": mtp_decode(model, PROMPT, N_TOKENS, oracle=greedy.tokens),
            "other": mtp_decode(model, OTHER_PROMPT, N_TOKENS),
        }


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request: pytest.FixtureRequest, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """One architecture's MTP fixture, split, token count and one-process reference."""
    stem = request.param
    case = ARCHS[stem]
    if stem == STEM:  # the model and reference the other tests use
        return stem, models["mtp"], case, request.getfixturevalue("reference")
    path = synthetic.write_model(with_nextn(SPECS[stem]), tmp_path_factory.mktemp("mtp-arch") / f"{stem}.gguf",
                                 seed=42)
    with MtpModel(path) as model:
        greedy = greedy_decode(model, PROMPT, case.n_tokens)
        reference = {
            "greedy": greedy,
            "mtp": mtp_decode(model, PROMPT, case.n_tokens),
            "oracle": mtp_decode(model, PROMPT, case.n_tokens, oracle=greedy.tokens),
        }
    return stem, path, case, reference


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    drafts: list[int | None] = field(default_factory=list)  # the final stage's draft after each step
    n_drafted: int = 0
    n_accepted: int = 0


def speculate(chain: Chain, session_id: str, prompt: Sequence[int], n_tokens: int,
              oracle: Sequence[int] | None = None) -> Run:
    """Drive a 2-stage chain as the reference drives one context: the prompt, then each step a verify
    batch ``[last sample, draft]`` (``oracle``'s token instead of the draft when given) at the last
    sample's position, rewinding a rejected draft's row."""
    head, final = chain.stages

    def step(start: int, tokens: list[int], *, verify: bool):
        positions = np.arange(start, start + len(tokens))
        (inner,) = head.run_batch([BatchEntry(session_id, positions, token_ids=tokens, rewind=True)])
        (result,) = final.run_batch([BatchEntry(session_id, positions, token_ids=tokens, hidden=inner.hidden,
                                                sample=True, verify=verify, rewind=True)])
        return result

    run = Run()
    result = step(0, list(prompt), verify=False)
    run.tokens.append(result.token)
    run.drafts.append(result.draft)
    pos = len(prompt)  # where the last sample goes
    while len(run.tokens) < n_tokens:
        draft = result.draft
        if oracle is not None and len(run.tokens) < len(oracle):
            draft = oracle[len(run.tokens)]
        result = step(pos, [run.tokens[-1], draft], verify=True)
        run.n_drafted += 1
        run.n_accepted += len(result.tokens) - 1
        run.tokens += result.tokens
        run.drafts.append(result.draft)
        pos += len(result.tokens)
    run.tokens = run.tokens[:n_tokens]
    return run


def test_the_split_with_mtp_on_computes_what_the_unsplit_model_with_mtp_on_computes(models) -> None:
    split = Chain(configs(models["mtp"], models["cache"]))
    whole = Chain(configs(models["mtp"], models["cache"], [(0, 7)]))
    try:
        assert split.stages[-1].n_layers_nextn == 1 and split.stages[0].n_layers_nextn == 0
        (a,) = split.step([Step("s", 0, PROMPT)])
        (b,) = whole.step([Step("s", 0, PROMPT)])
        tokens = [a.token]
        pos = len(PROMPT)
        for _ in range(N_TOKENS):  # every step's logits (max |diff| == 0.0) and draft, one token per batch
            assert np.array_equal(a.logits, b.logits) and a.token == b.token
            assert a.draft == b.draft is not None
            (a,) = split.step([Step("s", pos, [tokens[-1]])])
            (b,) = whole.step([Step("s", pos, [tokens[-1]])])
            tokens.append(a.token)
            pos += 1
    finally:
        split.close()
        whole.close()


def test_mtp_changes_no_logit_of_a_step_whose_rows_are_all_outputs(models) -> None:
    """Against the unsplit model loaded *without* its next-n layers: bit-identical for one-token steps
    and for a prompt whose every row is an output (``all_rows``, llama-cpp-python's ``logits_all``). A
    prompt with only its last row out is not: llama.cpp then runs the last layer over every row (each
    row's h feeds the MTP layers) where it otherwise keeps the output row alone, and that row's logits
    move in the last bits (llama.cpp's own MTP driver does the same)."""
    split = Chain(configs(models["mtp"], models["cache"]))
    plain = Chain(configs(models["mtp"], models["cache"], [(0, 7)], mtp=False))
    try:
        (a,) = split.step([Step("s", 0, PROMPT, all_rows=True)])
        (b,) = plain.step([Step("s", 0, PROMPT, all_rows=True)])
        assert np.array_equal(a.logits, b.logits) and a.token == b.token
        tokens = [a.token]
        pos = len(PROMPT)
        for _ in range(N_TOKENS - 1):
            (a,) = split.step([Step("s", pos, [tokens[-1]])])
            (b,) = plain.step([Step("s", pos, [tokens[-1]])])
            assert np.array_equal(a.logits, b.logits) and a.token == b.token
            tokens.append(a.token)
            pos += 1
        split.drop("s")
        plain.drop("s")
        (a,) = split.step([Step("t", 0, PROMPT)])
        (b,) = plain.step([Step("t", 0, PROMPT)])
        assert a.token == b.token and np.abs(a.logits - b.logits).max() <= 1e-6
    finally:
        split.close()
        plain.close()


def test_each_draft_is_the_reference_draft_and_the_tokens_are_greedy(arch, capsys) -> None:
    stem, path, case, reference = arch
    chain = Chain(configs(path, path.parent / "cache", case.split))
    try:
        assert [stage.n_layers_nextn for stage in chain.stages] == [0, 1]  # the final stage keeps the block
        run = speculate(chain, "s", PROMPT, case.n_tokens)
    finally:
        chain.close()
    ref = reference["mtp"]
    assert run.tokens == reference["greedy"].tokens == ref.tokens
    assert run.drafts[: len(ref.drafts)] == list(ref.drafts)
    assert (run.n_drafted, run.n_accepted) == (ref.n_drafted, ref.n_accepted)
    with capsys.disabled():
        print(f"\n{stem}: MTP drafts accepted {run.n_accepted}/{run.n_drafted} (random weights)")


def test_accepted_drafts_keep_the_mtp_layers_in_step(arch) -> None:
    """An oracle's right drafts are accepted (two tokens per step); the MTP drafts still match the
    reference's, which was driven the same way."""
    _, path, case, reference = arch
    chain = Chain(configs(path, path.parent / "cache", case.split))
    try:
        run = speculate(chain, "s", PROMPT, case.n_tokens, oracle=reference["greedy"].tokens)
    finally:
        chain.close()
    ref = reference["oracle"]
    assert run.tokens == reference["greedy"].tokens
    assert run.n_accepted == run.n_drafted == ref.n_accepted > 0
    assert run.drafts[: len(ref.drafts)] == list(ref.drafts)


def test_a_reused_lane_drafts_as_a_fresh_runtime_does(models, reference) -> None:
    chain = Chain(configs(models["mtp"], models["cache"]))  # one lane: the second session reuses it
    try:
        speculate(chain, "first", PROMPT, N_TOKENS)
        chain.drop("first")
        reused = speculate(chain, "second", OTHER_PROMPT, N_TOKENS)
    finally:
        chain.close()
    fresh_chain = Chain(configs(models["mtp"], models["cache"]))
    try:
        fresh = speculate(fresh_chain, "second", OTHER_PROMPT, N_TOKENS)
    finally:
        fresh_chain.close()
    assert reused.drafts == fresh.drafts
    assert reused.tokens == fresh.tokens == reference["other"].tokens
    assert reused.drafts[: len(reference["other"].drafts)] == list(reference["other"].drafts)


def test_a_trimmed_session_drafts_again_from_where_it_was_cut(models) -> None:
    """A cut into the last decode finds its h row again; the next step drafts as if never decoded past it."""
    chain = Chain(configs(models["mtp"], models["cache"]))
    try:
        head, final = chain.stages
        long = PROMPT + [40, 41, 42]
        (inner,) = head.run_batch([BatchEntry("s", np.arange(len(long)), token_ids=long)])
        final.run_batch([BatchEntry("s", np.arange(len(long)), token_ids=long, hidden=inner.hidden, sample=True)])
        for stage in chain.stages:
            stage.trim_session("s", len(PROMPT) - 1)
        tail = PROMPT[-1:]
        (inner,) = head.run_batch([BatchEntry("s", [len(PROMPT) - 1], token_ids=tail)])
        (cut,) = final.run_batch([BatchEntry("s", [len(PROMPT) - 1], token_ids=tail, hidden=inner.hidden,
                                             sample=True)])
        chain.drop("s")
        (inner,) = head.run_batch([BatchEntry("t", np.arange(len(PROMPT) - 1), token_ids=PROMPT[:-1])])
        final.run_batch([BatchEntry("t", np.arange(len(PROMPT) - 1), token_ids=PROMPT[:-1], hidden=inner.hidden)])
        (inner,) = head.run_batch([BatchEntry("t", [len(PROMPT) - 1], token_ids=tail)])
        (straight,) = final.run_batch([BatchEntry("t", [len(PROMPT) - 1], token_ids=tail, hidden=inner.hidden,
                                                  sample=True)])
    finally:
        chain.close()
    assert cut.draft is not None
    assert (cut.token, cut.draft) == (straight.token, straight.draft)


def test_an_mtp_final_stage_needs_the_token_ids(models) -> None:
    chain = Chain(configs(models["mtp"], models["cache"]))
    try:
        (inner,) = chain.head.run_batch([BatchEntry("s", np.arange(len(PROMPT)), token_ids=PROMPT)])
        with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.token_ids are required .*native_mtp_enabled"):
            chain.stages[-1].run_batch([BatchEntry("s", np.arange(len(PROMPT)), hidden=inner.hidden, sample=True)])
        assert chain.stages[-1].native_frame_args() is None  # every frame takes the Python path
    finally:
        chain.close()


def test_native_mtp_enabled_is_refused_on_a_stage_with_a_downstream(models) -> None:
    with pytest.raises(ConfigError, match=r"stage-0: native_mtp_enabled=True is for the final stage only"):
        chain_configs(models["mtp"], SPLIT, models["cache"], native_mtp_enabled=True, **CONTEXT)


def test_native_mtp_enabled_is_refused_on_a_model_without_next_n_layers(models) -> None:
    with pytest.raises(ConfigError, match=r"native_mtp_enabled=true: .*has no multi-token-prediction layers "
                                          r"\(nextn_predict_layers\)"):
        Chain(configs(models["plain"], models["cache"], [(0, 3), (3, 6)]))


def test_native_mtp_enabled_is_refused_on_a_recurrent_model(models) -> None:
    with pytest.raises(ConfigError, match=r"native_mtp_enabled=true: .*recurrent layers"):
        Chain(configs(models["recurrent"], models["cache"], [(0, 7)]))


def test_sessions_sharing_batches_draft_what_each_drafts_alone(models) -> None:
    def drive(prompts: dict[str, list[int]]) -> dict[str, list[tuple[tuple[int, ...], int | None]]]:
        chain = Chain(configs(models["mtp"], models["cache"], lane_count=2, ctx_size=512))
        head, final = chain.stages
        out: dict[str, list] = {sid: [] for sid in prompts}
        pending = {sid: (0, list(tokens), False) for sid, tokens in prompts.items()}
        try:
            for _ in range(8):
                entries = [BatchEntry(sid, np.arange(start, start + len(tokens)), token_ids=tokens, rewind=True)
                           for sid, (start, tokens, _) in pending.items()]
                inner = head.run_batch(entries)
                results = final.run_batch([
                    BatchEntry(e.session_id, e.positions, token_ids=e.token_ids, hidden=r.hidden, sample=True,
                               verify=pending[e.session_id][2], rewind=True) for e, r in zip(entries, inner)])
                for e, r in zip(entries, results):
                    kept = r.tokens if r.tokens is not None else (r.token,)
                    out[r.session_id].append((kept, r.draft))
                    pending[r.session_id] = (int(e.positions[0]) + len(kept), [kept[-1], r.draft], True)
        finally:
            chain.close()
        return out

    together = drive({"a": PROMPT, "b": OTHER_PROMPT})
    assert together["a"] == drive({"a": PROMPT})["a"]
    assert together["b"] == drive({"b": OTHER_PROMPT})["b"]


def test_a_fork_drafts_as_its_source_does(models) -> None:
    chain = Chain(configs(models["mtp"], models["cache"], lane_count=2, ctx_size=512))
    try:
        (source,) = chain.step([Step("a", 0, PROMPT)])
        (fork,) = chain.step([Step("b", len(PROMPT) - 1, PROMPT[-1:], fork_of="a")])
    finally:
        chain.close()
    assert fork.draft is not None
    assert (fork.token, fork.draft) == (source.token, source.draft)


def test_a_cut_behind_the_last_decode_stops_drafting_until_the_lane_is_reset(models) -> None:
    """The h row before the cut is gone (only the last decode's rows are kept): no draft rather than one
    from MTP state that does not match the session; a new session on the lane drafts again."""
    chain = Chain(configs(models["mtp"], models["cache"]))
    try:
        (first,) = chain.step([Step("s", 0, PROMPT)])
        chain.step([Step("s", len(PROMPT), [first.token])])
        for stage in chain.stages:
            stage.trim_session("s", 4)
        (after,) = chain.step([Step("s", 4, PROMPT[4:])])
        chain.drop("s")
        (again,) = chain.step([Step("t", 0, PROMPT)])
    finally:
        chain.close()
    assert after.token == first.token and after.draft == NO_DRAFT
    assert (again.token, again.draft) == (first.token, first.draft)


def test_a_stale_verify_window_leaves_the_mtp_layers_where_the_rewind_goes(models, reference) -> None:
    """A window sent before the one before it came back, which that one cut short (``continues``,
    nothing sampled): rewound by the next step, it changes none of the drafts after it."""
    greedy = reference["greedy"].tokens

    def run(with_stale_window: bool) -> list[int | None]:
        chain = Chain(configs(models["mtp"], models["cache"]))
        head, final = chain.stages

        def step(start: int, tokens: list[int], **flags: bool):
            positions = np.arange(start, start + len(tokens))
            (inner,) = head.run_batch([BatchEntry("s", positions, token_ids=tokens, rewind=True)])
            (result,) = final.run_batch([BatchEntry("s", positions, token_ids=tokens, hidden=inner.hidden,
                                                    sample=True, rewind=True, **flags)])
            return result

        try:
            pos = len(PROMPT)
            first = step(0, PROMPT)
            wrong = (greedy[1] + 1) % final.n_vocab
            cut = step(pos, [first.token, wrong], verify=True)  # rejected: one token kept
            assert cut.tokens == (greedy[1],)
            if with_stale_window:
                stale = step(pos + 2, [wrong, greedy[2]], verify=True, continues=True)
                assert stale.tokens == () and stale.draft is None
            after = step(pos + 1, [greedy[1], cut.draft], verify=True)
            return [first.draft, cut.draft, after.draft]
        finally:
            chain.close()

    drafts = run(with_stale_window=True)
    assert drafts == run(with_stale_window=False) and None not in drafts
