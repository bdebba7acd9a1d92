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

from skippy_stage.cli.bench import SECTIONS, format_table
from skippy_stage.cli.bench.images import ppm_image
from skippy_stage.cli.bench.mtp import RANDOM_NOTE, mtp_ranges
from skippy_stage.cli.bench.table import images_lines, mtp_lines
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
    # Images: the head's encode and the first token of a prompt with one, against libmtmd in one process.
    images = report["images"]
    assert images["stages"] == [[0, 10], [10, 20], [20, 30]]
    for figures in (images["encode_ms_per_image"], images["ttft_ms_one_image"]):
        assert all(v > 0 for v in figures.values())
    assert "image encode ms per image, head / one process" in run.stdout and "TTFT ms, one image" in run.stdout
    # ... and a Qwen2-VL image's (the random-weight fixture: this is a source checkout)
    mrope = images["mrope_encode_ms_per_image"]
    assert mrope["grid"] == "13x8" and mrope["rows"] == 104 and mrope["head"] > 0 and mrope["single_process"] > 0
    assert "Qwen2-VL image encode ms, head / one process" in run.stdout
    # Native MTP on the random-weight fixture (this is a source checkout): every step with the mtp
    # drafter verifies one draft; without it, one token a trip.
    mtp = report["mtp"]
    assert mtp["random_weights"] is True and mtp["stages"] == [[0, 3], [3, 7]]
    assert mtp["none"]["tokens_per_trip"] == 1.0 and mtp["mtp"]["tokens_per_trip"] >= 1.0
    assert mtp["drafted"] > 0 and 0 <= mtp["accepted"] <= mtp["drafted"]
    assert mtp["single_process_ms_per_token"] > 0 and all(v > 0 for v in mtp["ratios"].values())
    assert "mtp ms/token, 2 stages, drafter mtp" in run.stdout and RANDOM_NOTE in run.stdout
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


def test_bench_mtp_model_belongs_to_the_mtp_section_and_must_exist(tmp_path):
    def plan(*flags: str):
        return bench_plan(build_parser().parse_args(["bench", *flags]))

    model = tmp_path / "mtp.gguf"
    model.write_bytes(b"GGUF")
    assert plan().mtp_model is None
    assert plan("--only", "images,mtp").sections == ("images", "mtp")
    assert plan("--mtp-model", str(model)).mtp_model == str(model)
    assert plan("--only", "mtp", "--mtp-model", str(model)).sections == ("mtp",)
    with pytest.raises(SkippyError, match="--only leaves out"):
        plan("--only", "images", "--mtp-model", str(model))
    with pytest.raises(SkippyError, match="no such file"):
        plan("--mtp-model", str(tmp_path / "absent.gguf"))
    # The sections run in their order, the two new ones after speculative.
    assert SECTIONS.index("images") == SECTIONS.index("speculative") + 1 and SECTIONS.index("mtp") == SECTIONS.index("images") + 1


def test_mtp_stages_split_the_blocks_evenly_the_final_one_holding_the_next_n_block():
    assert mtp_ranges(7) == [(0, 3), (3, 7)]  # the fixture: 6 trunk blocks and the next-n block
    assert mtp_ranges(62) == [(0, 31), (31, 62)]


def test_the_bench_image_is_a_ppm_the_head_decodes_fixed_by_its_seed():
    image = ppm_image(320, 240, seed=3)
    assert image.startswith(b"P6 320 240 255\n") and len(image) == len(b"P6 320 240 255\n") + 320 * 240 * 3
    assert image == ppm_image(320, 240, seed=3) != ppm_image(320, 240, seed=4)


IMAGES = {"stages": [[0, 10], [10, 20], [20, 30]], "image": "320x240 PPM, random pixels",
          "projector": "random weights (write_projector, seed 0)", "prompt_tokens": 30, "rounds": 5,
          "encode_ms_per_image": {"head": 0.5, "single_process": 0.4, "ratio": 0.8},
          "ttft_ms_one_image": {"pipeline": 150.0, "single_process": 120.0,
                                "single_process_prefill_with_extra_encode": 120.4, "ratio": 0.8},
          "mrope_encode_ms_per_image": {"image": "200x120 PPM, random pixels", "grid": "13x8", "rows": 104,
                                        "model": "qwen2vl-dense fixture", "head": 11.0, "single_process": 10.0,
                                        "ratio": 10 / 11}}
MTP = {"model": "deepseek2-moe + 1 next-n block, random weights", "random_weights": True, "stages": [[0, 3], [3, 7]],
       "tokens": 64, "rounds": 5, "mtp": {"ms_per_token": 8.0, "tokens_per_trip": 1.25},
       "none": {"ms_per_token": 5.0, "tokens_per_trip": 1.0}, "single_process_ms_per_token": 4.0,
       "drafted": 315.0, "accepted": 63.0, "acceptance": 0.2,
       "ratios": {"mtp_vs_none": 0.625, "mtp_vs_single_process": 0.5, "none_vs_single_process": 0.8}}


def test_the_images_rows_put_the_head_beside_one_process_with_the_ratio():
    encode, ttft, note, mrope, mrope_note = images_lines(IMAGES)
    assert mrope.startswith("Qwen2-VL image encode ms, head / one process") and mrope.split()[-3:] == ["11.00", "10.00",
                                                                                                       "0.91"]
    assert "200x120 PPM, random pixels (13x8 grid, 104 rows)" in mrope_note
    skipped = images_lines({**IMAGES, "mrope_encode_ms_per_image": {"skipped": "no checkout"}})
    assert skipped[-1] == "Qwen2-VL image encode: skipped (no checkout)"
    assert encode.startswith("image encode ms per image, head / one process")
    assert encode.split()[-3:] == ["0.50", "0.40", "0.80"]
    assert ttft.startswith("TTFT ms, one image, 3 stages / one process") and ttft.split()[-3:] == ["150.00", "120.00", "0.80"]
    assert "medians of 5 rounds" in note and "120.40 ms with it" in note


def test_the_mtp_rows_say_what_was_kept_and_that_random_weights_mean_nothing():
    mtp_row, none_row, trips, model = mtp_lines(MTP)
    assert mtp_row.split()[-3:] == ["8.00", "4.00", "0.50"] and none_row.split()[-3:] == ["5.00", "4.00", "0.80"]
    assert "tokens/s with mtp over none 0.62" in trips and "1.25 tokens per trip (none 1.00)" in trips
    assert "drafts kept 63/315 (20%)" in trips and RANDOM_NOTE in trips
    assert "stages 0:3, 3:7" in model and "64 tokens, medians of 5 rounds" in model
    trained = mtp_lines({**MTP, "random_weights": False})
    assert RANDOM_NOTE not in "\n".join(trained)


def test_a_skipped_mtp_section_is_printed_with_its_reason():
    host = {"openmp_spincount": {"stages": "2000", "single_process": "default"},
            "openmp_wait_policy": {"stages": "active", "single_process": "default"},
            "openmp_proc_bind": {"stages": "true", "single_process": "default"}, "hidden_state_capture": "native",
            "cpu_threads": "openmp", "wire_bytes_per_token": {"f32": 2304}}
    table = format_table({"sections": ["images", "mtp"], "images": IMAGES,
                          "mtp": {"skipped": "no model with MTP layers: pass --mtp-model FILE"}, **host})
    lines = table.splitlines()
    assert lines[0].split() == ["measure", "pipeline", "single", "ratio", "target"]
    assert "mtp drafting: skipped (no model with MTP layers: pass --mtp-model FILE)" in lines
    assert any(line.startswith("image encode ms per image") for line in lines)


def test_without_the_checkout_s_fixtures_or_a_model_the_mtp_section_says_why(tmp_path, monkeypatch):
    from skippy_stage.cli.bench import mtp

    monkeypatch.setattr(mtp, "ARCHS", tmp_path / "tests" / "fixtures" / "archs.jsonl.gz")
    assert mtp._mtp(tmp_path, str(tmp_path / "slices"), None) == {"skipped": mtp.mtp_model(tmp_path, None)[1]}
    model, why = mtp.mtp_model(tmp_path, None)
    assert model is None and "--mtp-model" in why and "tests/fixtures/archs.jsonl.gz" in why
