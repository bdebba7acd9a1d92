"""``plan --quantization``: a stage's memory depends on its quantization, and ``auto`` picks, per node,
the highest precision that fits, on SmolLM2's real tensors (the bytes from llama.cpp's dry-run plan)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skippy_stage.cli.plan import add_plan_parser
from skippy_stage.errors import PlanError
from skippy_stage.ops.footprint import GIB, ModelFootprint, kv_bytes_per_layer, read_footprints
from skippy_stage.ops.plan import AUTO_QUANTIZATIONS, parse_nodes, plan_stages

SIZING = ["--ctx-size", "256", "--lanes", "1", "--overhead-mib", "0"]


@pytest.fixture(scope="module")
def footprints(smollm2: Path) -> dict[str, ModelFootprint]:
    return {m.quantization: m for m in read_footprints(smollm2, ("preserve", *AUTO_QUANTIZATIONS))}


def run_plan(argv: list[str], capsys) -> tuple[str, str]:
    parser = argparse.ArgumentParser(prog="skippy-stage")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_a_stages_weights_follow_its_quantization(footprints):
    q8, q4, kept = footprints["Q8_0"], footprints["Q4_0"], footprints["preserve"]
    assert q8.tensor_bytes > kept.tensor_bytes > q4.tensor_bytes  # the fixture is Q4_1
    assert all(a > b for a, b in zip(q8.layer_weight_bytes, q4.layer_weight_bytes))
    nodes = parse_nodes("a=1,b=1")
    at = {q: plan_stages(footprints[q], nodes, ctx_size=256, lanes=1) for q in ("Q8_0", "Q4_0")}
    assert [s.quantization for s in at["Q8_0"].stages] == ["Q8_0", "Q8_0"]
    assert at["Q8_0"].stages[0].weight_bytes == sum(q8.layer_weight_bytes[:15]) + q8.fixed_bytes(True, False)
    assert at["Q8_0"].stages[0].weight_bytes > at["Q4_0"].stages[0].weight_bytes


def test_plan_at_one_type_plans_and_writes_every_stage_at_it(smollm2, tmp_path, capsys):
    out, _ = run_plan(["--model", str(smollm2), "--nodes", "a=1,b=1", *SIZING, "--quantization", "Q4_K_M",
                       "--out", str(tmp_path)], capsys)
    assert [line.split()[2] for line in out.splitlines()[2:4]] == ["Q4_K_M", "Q4_K_M"]
    for node in ("a", "b"):
        assert json.loads((tmp_path / "configs" / f"{node}.json").read_text())["checkpoint_quantization"] == "Q4_K_M"


def test_plan_without_the_flag_writes_no_quantization(smollm2, tmp_path, capsys):
    out, _ = run_plan(["--model", str(smollm2), "--nodes", "a=1,b=1", *SIZING, "--out", str(tmp_path)], capsys)
    assert "quant" not in out.splitlines()[1]
    assert "checkpoint_quantization" not in json.loads((tmp_path / "configs" / "a.json").read_text())


def test_auto_picks_q8_0_where_it_fits_and_q4_0_where_only_that_fits(smollm2, footprints, tmp_path, capsys):
    q4, kept = footprints["Q4_0"], footprints["preserve"]
    kv = kv_bytes_per_layer(q4, 256, 1)
    # b (the final stage) holds its fixed tensors and its one layer at Q4_0, with less to spare than
    # the GGUF's own Q4_1 layer (the next type up the ladder) would need; a has room for all at Q8_0.
    spare = (kept.layer_weight_bytes[-1] - q4.layer_weight_bytes[-1]) // 2
    tight = (q4.fixed_bytes(False, True) + q4.layer_weight_bytes[-1] + kv[-1] + spare) / GIB
    out, err = run_plan(["--model", str(smollm2), "--nodes", f"a=0.5,b={tight!r}", *SIZING,
                         "--quantization", "auto", "--out", str(tmp_path)], capsys)

    assert "a=Q8_0, b=Q4_0" in err
    assert [line.split()[:3] for line in out.splitlines()[2:4]] == [["a", "0:29", "Q8_0"], ["b", "29:30", "Q4_0"]]
    written = {n: json.loads((tmp_path / "configs" / f"{n}.json").read_text()) for n in ("a", "b")}
    assert written["a"]["checkpoint_quantization"] == "Q8_0"
    assert written["b"]["checkpoint_quantization"] == "Q4_0"


def test_auto_keeps_every_node_at_the_top_when_all_fit(smollm2, capsys):
    out, err = run_plan(["--model", str(smollm2), "--nodes", "a=1,b=1", *SIZING, "--quantization", "auto"], capsys)
    assert "a=Q8_0, b=Q8_0" in err


@pytest.mark.parametrize(("value", "message"), [("Q9_9", "is not 'auto' or one of"),
                                                 ("IQ2_XXS", "needs an importance matrix")])
def test_a_quantization_plan_cannot_make_is_refused(smollm2, value, message):
    parser = argparse.ArgumentParser(prog="skippy-stage")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", str(smollm2), "--nodes", "a=1", "--quantization", value])
    with pytest.raises(PlanError, match=message):
        args.func(args)
