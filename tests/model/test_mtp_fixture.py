"""Random-weight models with next-n (MTP) layers, and drafting with them, in one process.

No MTP model ships on PyPI; ``with_nextn`` makes one from an architecture fixture. These
tests hold it to what the pinned llama.cpp needs (it loads with ``load_mtp`` and reports its
next-n layers), and hold the one-process MTP reference (``tests/support/mtp_reference.py``) to
the law every speculative decoder obeys: drafting changes how many tokens a step commits,
never which tokens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.mtp_reference import MtpModel, MtpUnavailable, greedy_decode, mtp_decode

from skippy_stage.model import synthetic
from skippy_stage.model.mtp_fixture import with_nextn

SPECS = synthetic.load_specs(Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz")
STEMS = ["qwen35-dense", "deepseek2-moe"]  # qwen35: hybrid (recurrent + attention); deepseek2: MLA + MoE
PROMPT = [1, 5, 9, 17, 33, 65, 2, 7]
N_TOKENS = 40


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture with one next-n block, and as it is, written once."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for stem in STEMS:
        out[stem] = synthetic.write_model(with_nextn(SPECS[stem]), root / f"{stem}-mtp.gguf", seed=42)
        out[f"{stem}-plain"] = synthetic.write_model(SPECS[stem], root / f"{stem}.gguf", seed=42)
    return out


@pytest.fixture(scope="module", params=STEMS)
def mtp_model(request: pytest.FixtureRequest, fixtures: dict[str, Path]):
    with MtpModel(fixtures[request.param]) as model:
        yield request.param, model


def test_with_nextn_appends_the_blocks_and_keys_llama_cpp_reads() -> None:
    spec = with_nextn(SPECS["qwen35-dense"])
    meta = {k: v for k, _, _, v in spec.metadata}
    names = {t.name for t in spec.tensors}
    assert meta["qwen35.block_count"] == 7 and meta["qwen35.nextn_predict_layers"] == 1
    assert meta["qwen35.attention.recurrent_layers"] == (1, 0, 1, 0, 1, 0, 0)  # the next-n block is attention
    assert {"blk.6.nextn.eh_proj.weight", "blk.6.nextn.enorm.weight", "blk.6.nextn.hnorm.weight",
            "blk.6.attn_q.weight", "blk.6.ffn_down.weight"} <= names
    eh_proj = next(t for t in spec.tensors if t.name == "blk.6.nextn.eh_proj.weight")
    assert eh_proj.shape == (256, 512)  # numpy order: [2 * n_embd -> n_embd]


def test_each_next_n_block_is_the_kind_its_architectures_mtp_graph_builds() -> None:
    """cohere2moe's is full attention, mimo2's sliding-window with a fused QKV and a dense FFN
    (``models/<arch>.cpp``); the others copy their last trunk block of the MoE FFN."""
    def block(stem: str) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
        spec = with_nextn(SPECS[stem])
        meta = {k: v for k, _, _, v in spec.metadata}
        return meta, {t.name[len("blk.6."):]: t.shape for t in spec.tensors if t.name.startswith("blk.6.")}

    meta, cohere = block("cohere2moe-moe")
    assert meta["cohere2moe.attention.sliding_window_pattern"] == (0, 1, 0, 1, 0, 1, 0)
    assert {"attn_q.weight", "ffn_gate_inp.weight", "ffn_gate_up_exps.weight", "nextn.eh_proj.weight"} <= set(cohere)
    meta, mimo = block("mimo2-moe")
    assert meta["mimo2.attention.sliding_window_pattern"] == (0, 1, 0, 1, 0, 1, 1)
    assert mimo["attn_qkv.weight"] == (768, 256)  # numpy order: [n_embd -> q + k + v]
    assert {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_sinks.weight"} <= set(mimo)
    assert not any(name.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate_inp", "ffn_down_exps"))
                   for name in mimo)
    for stem in ("deepseek32-moe", "hy_v3-moe"):
        meta, other = block(stem)
        assert meta[f"{SPECS[stem].architecture}.nextn_predict_layers"] == 1
        assert "ffn_gate_inp.weight" in other and not any(name.endswith((".scale", ".input_scale")) for name in other)
    assert "indexer.attn_q_b.weight" in block("deepseek32-moe")[1]  # its loader wants the indexer in every block


def test_with_nextn_refuses_what_the_pinned_mtp_graphs_cannot_run() -> None:
    with pytest.raises(ValueError, match="no MTP fixture"):
        with_nextn(SPECS["llama-dense"])
    with pytest.raises(ValueError, match="1..1"):
        with_nextn(SPECS["qwen35-dense"], k=2)  # graph_mtp asserts a single next-n block
    with pytest.raises(ValueError, match="already"):
        with_nextn(with_nextn(SPECS["qwen35-dense"]))


@pytest.mark.parametrize("stem", STEMS)
def test_the_fixture_loads_with_its_next_n_layers(stem: str, fixtures: dict[str, Path]) -> None:
    with MtpModel(fixtures[stem]) as model:
        assert model.n_layer_nextn == 1
    with MtpModel(fixtures[f"{stem}-plain"]) as model:
        assert model.n_layer_nextn == 0


def test_mtp_drafting_commits_exactly_the_greedy_tokens(mtp_model, record_property) -> None:
    stem, model = mtp_model
    greedy = greedy_decode(model, PROMPT, N_TOKENS)
    drafted = mtp_decode(model, PROMPT, N_TOKENS)
    record_property("mtp_acceptance", f"{drafted.n_accepted}/{drafted.n_drafted}")
    print(f"{stem}: MTP drafts accepted {drafted.n_accepted}/{drafted.n_drafted} (random weights)")
    assert drafted.tokens == greedy.tokens
    assert drafted.n_drafted > 0
    main_pos, mtp_pos = drafted.pos_max
    assert mtp_pos == main_pos  # the MTP context's KV holds what the main context's holds


def test_accepted_drafts_commit_two_tokens_per_step_and_stay_exact(mtp_model) -> None:
    """Random weights almost never draft right; an oracle's drafts take the accepting branch."""
    _, model = mtp_model
    greedy = greedy_decode(model, PROMPT, N_TOKENS)
    right = mtp_decode(model, PROMPT, N_TOKENS, oracle=greedy.tokens)
    assert right.tokens == greedy.tokens
    assert right.n_accepted == right.n_drafted == N_TOKENS // 2
    every_third_wrong = [(t + 1) % model.n_vocab if i % 3 == 0 else t for i, t in enumerate(greedy.tokens)]
    mixed = mtp_decode(model, PROMPT, N_TOKENS, oracle=every_third_wrong)
    assert mixed.tokens == greedy.tokens
    assert 0 < mixed.n_accepted < mixed.n_drafted
    assert mixed.pos_max[0] == mixed.pos_max[1]


@pytest.mark.parametrize("stem", STEMS)
def test_an_mtp_context_on_a_model_without_next_n_layers_is_refused(stem: str, fixtures: dict[str, Path]) -> None:
    with MtpModel(fixtures[f"{stem}-plain"]) as model:
        with pytest.raises(MtpUnavailable, match="no next-n"):
            model.mtp_context()
        with pytest.raises(MtpUnavailable, match="NULL"):
            model.mtp_context_unchecked()  # llama.cpp's own refusal: NULL, not a crash
        with pytest.raises(MtpUnavailable):
            mtp_decode(model, PROMPT, 4)


def test_next_n_layers_not_loaded_are_refused_before_llama_cpp_is_asked(fixtures: dict[str, Path]) -> None:
    with MtpModel(fixtures["qwen35-dense"], load_mtp=False) as model:
        assert model.n_layer_nextn == 1  # the count comes from the metadata, loaded or not
        with pytest.raises(MtpUnavailable, match="load_mtp"):
            model.mtp_context()
        # The trunk still decodes: a model with MTP layers serves without them.
        assert len(greedy_decode(model, PROMPT, 4).tokens) == 4


ASK_ANYWAY = r"""
import sys
from support.mtp_reference import MtpModel
with MtpModel(sys.argv[1], load_mtp=False) as model:
    model.mtp_context_unchecked()
print("child " + "survived")
"""


def test_why_the_guard_exists_llama_cpp_aborts_on_next_n_layers_not_loaded(fixtures: dict[str, Path]) -> None:
    """Run where it can only take a child down: ``GGML_ASSERT(layer.nextn.eh_proj)``."""
    tests = Path(__file__).resolve().parents[1]  # where ``support`` imports from
    done = subprocess.run([sys.executable, "-c", ASK_ANYWAY, str(fixtures["qwen35-dense"])],
                          cwd=tests, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "child survived" not in done.stdout  # ggml prints a backtrace there
    assert "nextn.eh_proj" in done.stderr
