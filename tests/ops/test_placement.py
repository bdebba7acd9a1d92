"""Choosing the stage count and the order of nodes by estimated time per output token, on the real
SmolLM2 GGUF (30 equal layers, tied embeddings): every candidate split by memory, estimated as
links + per-edge overhead + compute, the fastest one planned."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skippy_stage.cli.plan import add_plan_parser
from skippy_stage.errors import DoesNotFitError, PlanError
from skippy_stage.ops.footprint import GIB, MIB, ModelFootprint, kv_bytes_per_layer, read_footprint
from skippy_stage.ops.placement import (
    HOP_OVERHEAD_MS,
    Links,
    choose_placement,
    decode_bytes,
    default_token_ms,
    measured_links,
    parse_links,
    parse_speeds,
)
from skippy_stage.ops.plan import NodeSpec, parse_nodes
from skippy_stage.stage.reports import StageReport

TOKEN_MS = 10.0


@pytest.fixture(scope="module")
def footprint(smollm2: Path) -> ModelFootprint:
    return read_footprint(smollm2)


def gib_for_layers(footprint: ModelFootprint, layers: float) -> float:
    """A node budget with room for ``layers`` layers (weights and KV at the default 4096 x 4) past
    its fixed costs (512 MiB overhead and the tensors every stage file carries)."""
    per_layer = footprint.layer_weight_bytes[0] + kv_bytes_per_layer(footprint, 4096, 4)[0]
    return (512 * MIB + footprint.shared_bytes + layers * per_layer) / GIB


@pytest.fixture(scope="module")
def three(footprint: ModelFootprint) -> list[NodeSpec]:
    """Two big nodes, each too small for the model alone but enough as a pair, and a small fast one
    (room for 4 layers) that fits no pair: the model fits on 2 of the 3, and on all 3."""
    big, small = gib_for_layers(footprint, 20.5), gib_for_layers(footprint, 4.5)
    return [NodeSpec("big-a", big), NodeSpec("big-b", big), NodeSpec("gpu", small)]


def choose(footprint: ModelFootprint, nodes: list[NodeSpec], link_ms: str, speed: str = "", **kwargs):
    return choose_placement(footprint, nodes, parse_links(link_ms, nodes), speeds=parse_speeds(speed, nodes),
                            token_ms=TOKEN_MS, **kwargs)


# --------------------------------------------------------------------------- the choice


def test_a_fast_third_node_pays_on_a_fast_link_and_not_on_a_slow_one(footprint, three):
    near = choose(footprint, three, "0.5", "gpu=4")
    assert near.chosen.order == ("big-a", "big-b", "gpu"), near.format_table()
    far = choose(footprint, three, "20", "gpu=4")
    assert far.chosen.order == ("big-a", "big-b"), far.format_table()
    # The same candidates either way, with the same compute; the links decide.
    assert {c.order for c in near.candidates} == {c.order for c in far.candidates}
    assert far.plan.stages[0].node == "big-a" and len(far.plan.stages) == 2


def test_with_equal_speeds_the_fewest_stages_that_fit_win_at_any_latency(footprint, three):
    for ms in ("0", "0.5", "20"):
        assert choose(footprint, three, ms).chosen.order == ("big-a", "big-b")
    # With nothing to tell them apart (no latency, no overhead), fewer stages, then the order given.
    tie = choose(footprint, parse_nodes("a=1,b=1"), "0", hop_overhead_ms=0)
    assert [c.order for c in tie.candidates] == [("a",), ("b",), ("a", "b"), ("b", "a")]
    assert all(c.estimate.total_ms == pytest.approx(TOKEN_MS) for c in tie.candidates)


def test_a_model_that_fits_one_node_has_no_link_to_pay(footprint):
    placement = choose(footprint, parse_nodes("a=1,b=1,c=1"), "0.5")
    one = placement.chosen
    assert one.order == ("a",) and one.estimate.links_ms == one.estimate.hops_ms == 0
    assert one.estimate.total_ms == pytest.approx(TOKEN_MS)


def test_per_pair_links_pick_the_nodes_on_the_fast_link(footprint, three):
    """big-a and big-b in one rack, the fast node across sites."""
    placement = choose(footprint, three, "big-a-big-b=0.5,big-a-gpu=20,big-b-gpu=20", "gpu=4")
    assert placement.chosen.order == ("big-a", "big-b")
    with_gpu = next(c for c in placement.candidates if c.order == ("big-a", "big-b", "gpu"))
    assert with_gpu.estimate.links_ms == pytest.approx(0.5 + 20 + 20), "the return from gpu to big-a counts"


# --------------------------------------------------------------------------- the estimate


def test_the_estimate_is_links_plus_overhead_per_edge_plus_each_stages_share_over_its_speed(footprint, three):
    placement = choose(footprint, three, "0.5", "gpu=4")
    c = next(c for c in placement.candidates if c.order == ("big-a", "big-b", "gpu"))
    e = c.estimate
    assert e.links_ms == pytest.approx(3 * 0.5), "3 edges: big-a to big-b, big-b to gpu, gpu back to big-a"
    assert e.hops_ms == pytest.approx(3 * HOP_OVERHEAD_MS)
    layer = footprint.layer_weight_bytes[0]
    a, b, gpu = (s.n_layers for s in c.plan.stages)
    # The final stage also runs the output head: the tied token embeddings, in the shared tensors.
    work = [a * layer, b * layer, (gpu * layer + footprint.shared_bytes) / 4]
    assert e.compute_ms == pytest.approx(TOKEN_MS * sum(work) / decode_bytes(footprint))
    assert e.total_ms == pytest.approx(e.links_ms + e.hops_ms + e.compute_ms)


def test_the_default_compute_reads_the_weights_at_10_gb_per_s(footprint):
    assert decode_bytes(footprint) == sum(footprint.layer_weight_bytes) + footprint.shared_bytes
    assert default_token_ms(footprint) == pytest.approx(decode_bytes(footprint) / 1e7)
    assert 9 < default_token_ms(footprint) < 10.5, "close to the 9.81 ms/token bench measures unsplit"


# --------------------------------------------------------------------------- what cannot be had


def test_candidates_that_do_not_fit_or_lack_a_latency_say_why(footprint, three):
    placement = choose(footprint, three, "0.5", "gpu=4")
    refused = {c.order: c.reason for c in placement.candidates if not c.feasible}
    assert set(refused) == {("big-a",), ("big-b",), ("gpu",), ("big-a", "gpu"), ("gpu", "big-a"),
                            ("big-b", "gpu"), ("gpu", "big-b")}
    assert all(reason.startswith("does not fit: short by ") for reason in refused.values())
    # The feasible ones first, fastest first; then those that cannot be had.
    feasible = [c.feasible for c in placement.candidates]
    assert feasible == sorted(feasible, reverse=True)
    totals = [c.estimate.total_ms for c in placement.candidates if c.feasible]
    assert totals == sorted(totals)

    unknown = choose(footprint, three, "big-a-big-b=0.5", "gpu=4")
    assert unknown.chosen.order == ("big-a", "big-b")
    for c in unknown.candidates:
        if len(c.order) == 3:  # each has an edge to or from gpu, whose latency nobody gave
            assert not c.feasible and c.reason.startswith("no latency for the link") and "gpu" in c.reason


def test_nothing_that_can_be_had_is_refused_saying_why(footprint):
    with pytest.raises(DoesNotFitError, match=r"none of the 4 candidates .* a > b: does not fit: short by [0-9.]+ MiB in all, node a cannot hold one layer"):
        choose(footprint, parse_nodes("a=0.3,b=0.3"), "1")


# --------------------------------------------------------------------------- the latencies given


def test_link_latencies_are_parsed_per_pair_or_for_every_pair():
    nodes = parse_nodes("gpu-a=1,gpu-b=1,c=1")
    links = parse_links("5, gpu-a-gpu-b=0.5", nodes)
    assert links.one_way_ms("gpu-b", "gpu-a") == 0.5 and links.one_way_ms("gpu-a", "c") == 5
    assert parse_links("c-gpu-a=2", nodes).one_way_ms("gpu-a", "c") == 2
    assert parse_links("c-gpu-a=2", nodes).one_way_ms("gpu-b", "c") is None
    for text, why in [("x-c=1", "is not A-B"), ("c-c=1", "is not A-B"), ("1,2", "more than one"),
                      ("c-gpu-a=1,gpu-a-c=2", "twice"), ("c-gpu-a=-1", ">= 0"), ("fast", "not a number"),
                      ("c-gpu-a=nan", ">= 0")]:
        with pytest.raises(PlanError, match=why):
            parse_links(text, nodes)
    ambiguous = parse_nodes("a=1,a-b=1,b-c=1,c=1")
    with pytest.raises(PlanError, match="more than one way"):
        parse_links("a-b-c=1", ambiguous)


def test_speeds_default_to_1_and_must_be_positive():
    nodes = parse_nodes("a=1,b=1")
    assert parse_speeds("", nodes) == {"a": 1.0, "b": 1.0}
    assert parse_speeds("b=2.5", nodes) == {"a": 1.0, "b": 2.5}
    for text in ("c=2", "a", "a=0", "a=fast"):
        with pytest.raises(PlanError, match="--speed"):
            parse_speeds(text, nodes)


def report(stage_id: str, index: int, down: str = "", down_us: int = 0, back_us: int = 0) -> StageReport:
    return StageReport(stage_id=stage_id, stage_index=index, run_id="r", topology_id="", model_id="m",
                       architecture="llama", layer_start=0, layer_end=1, include_embeddings=False,
                       include_output=False, state="serving", wire_dtype="f32", hop_transport="tcp",
                       frame_port=0, tls=False, downstream_ok=True, downstream_stage_id=down,
                       downstream_rtt_us=down_us, downstream_rtt_samples=1 if down_us else 0,
                       return_rtt_us=back_us, return_rtt_samples=1 if back_us else 0)


def test_measured_round_trips_become_one_way_latencies_by_stage_id():
    found = measured_links([report("a", 0, "b", down_us=1000), report("b", 1, "c", down_us=3000),
                            report("c", 2, back_us=40000)])
    assert found == {frozenset("ab"): 0.5, frozenset("bc"): 1.5, frozenset("ac"): 20.0}
    # Two stages: the edge and the return are the same pair, measured from both ends.
    assert measured_links([report("a", 0, "b", down_us=1000), report("b", 1, back_us=3000)]) == {frozenset("ab"): 1.0}
    assert measured_links([report("a", 0, "b")]) == {}, "no sample yet: nothing measured"
    links = Links(default_ms=9, given={frozenset("ab"): 0.1}, measured=found)
    assert (links.one_way_ms("b", "a"), links.one_way_ms("c", "b"), links.one_way_ms("a", "d")) == (0.1, 1.5, 9)
    assert links.describe() == "given a-b 0.1 ms; measured a-c 20 ms, b-c 1.5 ms (half the round trip); " \
                               "every other pair 9 ms"


# --------------------------------------------------------------------------- the command


def run_plan(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser(prog="skippy-stage")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_plan_prints_every_candidates_estimate_and_writes_the_chosen_one(smollm2, footprint, three, tmp_path, capsys):
    nodes = ",".join(f"{n.name}={n.mem_gib!r}" for n in three)
    out = run_plan(["--model", str(smollm2), "--nodes", nodes, "--speed", "gpu=4", "--link-ms", "0.5",
                    "--token-ms", str(TOKEN_MS), "--out", str(tmp_path)], capsys)
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert len(rows) == 3 + 6 + 6, "1, 2 and 3 stages over 3 nodes, every order"
    chosen = [r for r in rows if r[-2:] == ["<-", "chosen"]]
    assert len(chosen) == 1 and chosen[0][:6] == ["3", "big-a", ">", "big-b", ">", "gpu"]
    for row in rows:  # an estimate, or why there is none
        line = " ".join(row)
        assert "does not fit: short by" in line or float(row[-3] if line.endswith("<- chosen") else row[-1]) > 0
    assert "links (one-way): every pair 0.5 ms" in out and "speeds: gpu 4; every other 1" in out
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == ["big-a.json", "big-b.json", "gpu.json"]
    final = json.loads((tmp_path / "configs" / "gpu.json").read_text())
    assert final["return_to"]["stage_id"] == "big-a" and final["layer_end"] == 30

    far = tmp_path / "far"
    out = run_plan(["--model", str(smollm2), "--nodes", nodes, "--speed", "gpu=4", "--link-ms", "20",
                    "--token-ms", str(TOKEN_MS), "--out", str(far)], capsys)
    assert next(line for line in out.splitlines() if line.endswith("<- chosen")).split()[:4] == \
        ["2", "big-a", ">", "big-b"]
    assert sorted(p.name for p in (far / "configs").iterdir()) == ["big-a.json", "big-b.json"]


def test_plan_without_latencies_splits_over_every_node_in_order(smollm2, capsys):
    out = run_plan(["--model", str(smollm2), "--nodes", "a=1,b=1,c=1"], capsys)
    assert "chosen" not in out and "ms/token" not in out
    assert [line.split()[1] for line in out.splitlines()[2:5]] == ["0:10", "10:20", "20:30"]
    for flag in (["--speed", "a=2"], ["--token-ms", "5"], ["--hop-overhead-ms", "1"]):
        parser = argparse.ArgumentParser(prog="skippy-stage")
        add_plan_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["plan", "--model", str(smollm2), "--nodes", "a=1,b=1", *flag])
        with pytest.raises(PlanError, match="give --link-ms or --measure"):
            args.func(args)
