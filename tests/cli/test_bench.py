"""``skippy-stage bench`` runs end to end and writes every figure the issue asks for.

Figures are never asserted here (machines are noisy), only what no noise can change;
SKIPPY_BENCH_QUICK shrinks the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from skippy_stage.cli.bench import SECTIONS
from skippy_stage.cli.bench.wan import WAN_DELAYS_MS
from skippy_stage.cli.commands import bench_plan, build_parser
from skippy_stage.errors import SkippyError
from skippy_stage.model import host


def test_bench_writes_the_report_with_every_key(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "SKIPPY_BENCH_QUICK": "1"}
    run = subprocess.run([sys.executable, "-m", "skippy_stage", "bench", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["pipeline_ms_per_token"]) == {"2", "3"}
    # The whole model on one stage of this stack, in the same rounds: the split's own cost.
    assert report["one_stage_ms_per_token"] > 0
    assert {"decode_1_stage", "decode_2_stage_vs_1_stage", "decode_3_stage_vs_1_stage"} <= set(report["ratios"])
    assert "1 stage (this stack, unsplit)" in run.stdout
    assert set(report["aggregate_tokens_per_s"]["pipeline"]) == {"1", "4", "8"}
    assert set(report["aggregate_tokens_per_s"]["single_process"]) == {"1", "4", "8"}
    assert set(report["prefill_tokens_per_s"]) == {"pipeline", "single_process"}
    assert report["wire_bytes_per_token"] == {"f32": 2304, "f16": 1152, "bf16": 1152, "int8": 580}
    for key in ("single_process_ms_per_token", "per_hop_overhead_us", "ratios", "stage_cpu_ms_per_token",
                "per_hop_overhead_us_histograms", "openmp_spincount", "openmp_wait_policy", "openmp_proc_bind"):
        assert key in report
    # Stages started beside each other bind from their own cores unless the environment placed them.
    placed = {"OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"} & set(os.environ)
    assert report["openmp_places_by_stage"] is not bool(placed)
    assert ("each stage from its own core" in run.stdout) is not bool(placed)
    # Split cost = capture + compute inflation + hops, readable off the report.
    assert set(report["stage_compute_ms_per_token"]) == {"2", "3"}
    assert all(v > 0 for v in report["stage_compute_ms_per_token"].values())
    assert set(report["transport_floor_us"]) == {"grpc_stream", "tcp_frame", "tcp_socket"}
    # The candidate transports, measured in the same run; the default is one of them.
    assert set(report["transport_comparison_3_stage"]) == {"tcp", "stream"}
    assert report["hop_transport_default"] in report["transport_comparison_3_stage"]
    assert all(t["ms_per_token"] > 0 for t in report["transport_comparison_3_stage"].values())
    assert report["hop_latency_us"] > 0
    assert report["hidden_state_capture"] == "native"
    assert report["cpu_threads"] == "openmp" or report["cpu_threads"]["stages"] == "ggml pool, poll 0"
    assert all(v > 0 for v in report["pipeline_ms_per_token"].values())
    # The same pipelines for a client that asks for the whole completion, not a message per token.
    assert set(report["whole_completion_ms_per_token"]) == {"2", "3"}
    assert all(v > 0 for v in report["whole_completion_ms_per_token"].values())
    assert "2 stages, whole completion" in run.stdout
    # Where a token's CPU goes, by thread: one entry per process (the single process, each stage).
    by_thread = report["token_cpu_us_by_thread"]
    assert {n: len(procs) for n, procs in by_thread.items()} == {"single": 1, "1": 1, "2": 2, "3": 3}
    for procs in by_thread.values():
        for proc in procs:
            assert set(proc) == {"decoding", "other", "decoding_wait"}
            assert proc["decoding"] > 0 and proc["other"] >= 0 and proc["decoding_wait"] >= 0
    assert "CPU us per token, 3 stages:" in run.stdout and "vs single" in run.stdout
    assert "decode ms/token, 3 stages" in run.stdout
    # Speculative decoding: both prompts, with the ngram drafter and without, and the speed-up.
    assert set(report["speculative"]) == {"repetitive", "free_form"}
    for figures in report["speculative"].values():
        assert figures["none"]["tokens_per_trip"] == 1.0
        assert figures["ngram"]["ms_per_token"] > 0 and figures["ngram"]["tokens_per_trip"] >= 1.0
        assert figures["speedup"] > 0
    assert "speculative ngram, repetitive" in run.stdout
    # Both ways back to the head, measured side by side; and the hop's floor with no stage work.
    assert set(report["frame_path_comparison_3_stage"]) == {"native_ms_per_token", "python_ms_per_token"}
    assert all(v > 0 for v in report["frame_path_comparison_3_stage"].values())
    assert report["native_frames"] is True
    assert report["stream_interval_2_stage"]["interval_ms"] > 0
    assert all(v > 0 for v in report["stream_interval_2_stage"].values())
    # The decode figures' client runs in its own process at nice 19; the same pipeline with the
    # client in bench's process at normal priority, and with a client that reads nothing until the
    # end (timed at the head), is measured beside it.
    assert set(report["client_priority_2_stage"]) == {"quiet_ms_per_token", "local_ms_per_token", "held_ms_per_token",
                                                      "single_process_ms_per_token"}
    assert all(v > 0 for v in report["client_priority_2_stage"].values())
    assert "client in the bench's process at normal priority" in run.stdout
    assert set(report["return_path_comparison_3_stage"]) == {"relay_ms_per_token", "direct_ms_per_token"}
    assert all(v > 0 for v in report["return_path_comparison_3_stage"].values())
    assert set(report["hop_floor_us"]) == {"grpc_stream_round_trip_us", "tcp_frame_round_trip_us",
                                           "tcp_socket_round_trip_us"}
    assert all(v > 0 for v in report["hop_floor_us"].values())
    # What waking a sleeping stage costs, under the host's idle policy (and held, where allowed).
    assert report["wake_floor_us"]["host_policy"] > 0
    assert "cpu_wake_latency_us" in report and "wake of a sleeping receiver" in run.stdout
    assert "straight to the head" in run.stdout and "hop floor" in run.stdout and "hop latency" in run.stdout
    # The 4-turn chat on 3 stages with resident prefixes and without: time to first token per turn.
    assert set(report["chat_ttft_s"]) == {"with_prefix_cache", "without_prefix_cache"}
    assert all(len(v) == 4 and all(t > 0 for t in v) for v in report["chat_ttft_s"].values())
    assert "chat turn 4 TTFT" in run.stdout
    # Weight repacking on vs off (Gemma-3-270M on 2 stages), each against the unsplit model loaded the
    # same way; on an AMX CPU, where repack=true is refused, the reason instead.
    repack = report["repack"]
    if host.host_info().amx:
        assert "AMX" in repack["skipped"] and "repack on vs off: skipped" in run.stdout
    else:
        for way, stages_repack in (("off", False), ("on", True)):
            assert repack[way].pop("stages_repack") is stages_repack
            assert set(repack[way]) == {"single_process_ms_per_token", "pipeline_ms_per_token", "decode_ratio",
                                        "single_process_prefill_tokens_per_s", "pipeline_prefill_tokens_per_s",
                                        "prefill_ratio"}
            assert all(v > 0 for v in repack[way].values())
        assert set(repack["on_vs_off"]) == {"single_process_decode", "pipeline_decode", "single_process_prefill",
                                            "pipeline_prefill"}
        assert all(v > 0 for v in repack["on_vs_off"].values())
        assert "decode ms/token, repack on, 2 stages" in run.stdout and "repack on vs off (" in run.stdout
    # The split over emulated links, at each delay (a quick run: 0 and 5 ms, 1 and 4 sessions).
    wan = report["wan"]
    assert wan["delays_ms"] == [0.0, 5.0]
    by = wan["by_delay"]
    assert set(by) == {"0", "5"}
    zero = by["0"]["plain_ms_per_token"]
    for key, d in (("0", 0.0), ("5", 5.0)):
        e = by[key]
        assert set(e["speculative_ms_per_token"]) == set(e["plain_ms_per_token_same_prompts"]) == {"repetitive",
                                                                                                   "free_form"}
        assert set(e["aggregate_tokens_per_s"]) == {"1", "4"}
        assert e["ttft_ms_1024"] > 0 and all(v > 0 for v in e["aggregate_tokens_per_s"].values())
        # The floor is the zero-delay decode and 3 edges' delay, by definition; no token crosses
        # the chain's 3 delayed edges faster than that delay.
        assert e["floor_ms_per_token"] == 3 * d + zero
        assert e["plain_ms_per_token"] >= 3 * d
        assert all(v >= 3 * d for v in e["plain_ms_per_token_same_prompts"].values())
        # A plain greedy stream's text does not depend on the link's delay (one token per step).
        assert e["outputs_match_zero_delay"]["plain"] is True
        assert all(e["outputs_match_zero_delay"]["plain_same_prompts"].values())
        assert isinstance(e["relay_one_way_ms"], float)  # measured: only noise bounds it from below
    assert "plain / floor" in run.stdout and "relay one-way delay, measured" in run.stdout


def test_bench_link_delay_asks_for_the_wan_section_at_that_delay_and_zero():
    def plan(*flags: str):
        return bench_plan(build_parser().parse_args(["bench", *flags]))

    assert plan().sections == SECTIONS and plan().wan.delays_ms == WAN_DELAYS_MS
    linked = plan("--link-delay-ms", "10", "--link-mbit", "100")
    assert linked.sections == ("wan",) and linked.wan.delays_ms == (0.0, 10.0) and linked.wan.mbit == 100
    assert plan("--only", "wan,decode", "--link-delay-ms", "3").sections == ("decode", "wan")
    assert plan("--wan-delays-ms", "10,2").wan.delays_ms == (0.0, 2.0, 10.0)  # 0 always: the floor's
    for flags in (["--only", "decode", "--link-delay-ms", "5"], ["--only", "nope"], ["--wan-delays-ms", "-1"],
                  ["--wan-delays-ms", "2,x"], ["--link-delay-ms", "5", "--link-mbit", "0"]):
        with pytest.raises(SkippyError):
            plan(*flags)
