"""``bench``'s run: the sections chosen, in turn, and the report assembled from their figures."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from skippy_stage.cli.bench.batched import _batched
from skippy_stage.cli.bench.chat import _chat_ttft
from skippy_stage.cli.bench.decode import (
    COMPARISON_CONTENDERS,
    HEADLINE_CONTENDERS,
    STREAM_CONTENDERS,
    STREAM_INTERVAL_MS,
    _interleaved_decode,
)
from skippy_stage.cli.bench.floors import hop_floor_us, wake_floor_us
from skippy_stage.cli.bench.images import _images
from skippy_stage.cli.bench.mtp import _mtp
from skippy_stage.cli.bench.pipeline import SETTINGS, stage_threads, wake_latency_setting
from skippy_stage.cli.bench.repack import _repack
from skippy_stage.cli.bench.speculative import _speculative
from skippy_stage.cli.bench.wan import WanSetup, _wan
from skippy_stage.cli.bench.workload import AGG_TOKENS, DECODE_TOKENS, PREFILL_TOKENS, QUICK, THREE
from skippy_stage.cli.local import pipeline_configs, stage_environment
from skippy_stage.cli.settings import apply_settings
from skippy_stage.config import SHARED_HOST_PLACES_ENV, StageConfig
from skippy_stage.errors import SkippyError
from skippy_stage.model import threadpool
from skippy_stage.model.packaged import smollm2_path
from skippy_stage.stage import native_frames, wire

# The sections of a run, in the order they run (``bench --only``).
SECTIONS = ("decode", "batched", "chat", "speculative", "images", "mtp", "repack", "floors", "wan")


@dataclass(frozen=True)
class BenchPlan:
    """What one ``bench`` run measures: its ``sections``, the ``--set`` ``settings`` applied to the
    stages of every pipeline it starts (the unsplit references stay as they are), the links of
    the ``wan`` section and the ``mtp`` section's model (None: the random-weight fixture)."""

    sections: tuple[str, ...] = SECTIONS
    settings: tuple[str, ...] = ()
    wan: WanSetup = field(default_factory=WanSetup)
    mtp_model: str | None = None

    def __post_init__(self) -> None:
        unknown = [name for name in self.sections if name not in SECTIONS]
        if unknown or not self.sections:
            raise SkippyError(f"bench sections {', '.join(unknown) or '(none)'} unknown: choose from {', '.join(SECTIONS)}")
        # Always in the order they run.
        object.__setattr__(self, "sections", tuple(name for name in SECTIONS if name in self.sections))


def run(json_path: str | None = None, plan: BenchPlan | None = None) -> dict[str, object]:
    """The sections of ``plan`` (every one by default), and the report assembled from their figures."""
    plan = plan or BenchPlan()
    SETTINGS[:] = plan.settings
    # A wrong name or value, refused before anything runs.
    apply_settings(pipeline_configs("model.gguf", THREE, host="127.0.0.1", ports=[1, 2, 3], extra={}), plan.settings)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    model = smollm2_path()
    cores = os.cpu_count() or 1
    report: dict[str, object] = {"sections": list(plan.sections)}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="skippy-bench-") as tmp:
        cache_dir = str(Path(tmp) / "slices")
        if "decode" in plan.sections:
            _decode_section(report, ratios, model, Path(tmp), cache_dir, cores)
        if "batched" in plan.sections:
            prefill, aggregate = _batched(model, Path(tmp), cache_dir, cores)
            report["aggregate_tokens_per_s"] = aggregate
            report["prefill_tokens_per_s"] = prefill
            ratios["aggregate_8_vs_single_batched_8"] = aggregate["pipeline"]["8"] / aggregate["single_process"]["8"]
            ratios["aggregate_8_vs_pipeline_1"] = aggregate["pipeline"]["8"] / aggregate["pipeline"]["1"]
            ratios["prefill_512"] = prefill["pipeline"] / prefill["single_process"]
        if "chat" in plan.sections:
            chat = report["chat_ttft_s"] = _chat_ttft(model, Path(tmp), cache_dir)
            ratios["chat_turn4_ttft_without_vs_with_prefix_cache"] = (chat["without_prefix_cache"][-1]
                                                                      / chat["with_prefix_cache"][-1])
        if "speculative" in plan.sections:
            speculative = report["speculative"] = _speculative(model, Path(tmp), cache_dir)
            ratios.update({f"speculative_{name}_tokens_per_s_ngram_vs_none": figures["speedup"]
                           for name, figures in speculative.items()})
        if "images" in plan.sections:
            images = report["images"] = _images(model, Path(tmp), cache_dir)
            ratios["image_encode_3_stage_head"] = images["encode_ms_per_image"]["ratio"]
            ratios["image_ttft_3_stage"] = images["ttft_ms_one_image"]["ratio"]
            if "skipped" not in images["mrope_encode_ms_per_image"]:
                ratios["image_encode_qwen2vl_head"] = images["mrope_encode_ms_per_image"]["ratio"]
        if "mtp" in plan.sections:
            mtp = report["mtp"] = _mtp(Path(tmp), cache_dir, plan.mtp_model)
            if "skipped" not in mtp:
                ratios["mtp_2_stage_tokens_per_s_mtp_vs_none"] = mtp["ratios"]["mtp_vs_none"]
        if "repack" in plan.sections:
            report["repack"] = _repack(Path(tmp), cache_dir, cores)
        if "floors" in plan.sections:
            report["hop_floor_us"] = hop_floor_us(200 if QUICK else 2000)
            report["wake_floor_us"] = wake_floor_us(100 if QUICK else 400)
            report["transport_floor_us"] = {"grpc_stream": report["hop_floor_us"]["grpc_stream_round_trip_us"],
                                            "tcp_frame": report["hop_floor_us"]["tcp_frame_round_trip_us"],
                                            "tcp_socket": report["hop_floor_us"]["tcp_socket_round_trip_us"]}
        if "wan" in plan.sections:
            report["wan"] = _wan(model, Path(tmp), cache_dir, plan.wan)
        _host_section(report)
        report["ratios"] = ratios
        report["conditions"] = {"cores": cores, "model": model.name, "decode_tokens": DECODE_TOKENS,
                                "aggregate_tokens_per_session": AGG_TOKENS, "prefill_tokens": PREFILL_TOKENS,
                                "pipeline_threads_per_stage": {"2": stage_threads(2), "3": stage_threads(3)},
                                "single_process_threads": cores}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def _decode_section(report: dict[str, object], ratios: dict[str, float], model: Path, workdir: Path, cache_dir: str,
                    cores: int) -> None:
    """Single-stream decode: the headline pipelines, the comparisons on 3 stages and the client's stream."""
    decode = _interleaved_decode(model, workdir, cache_dir, cores, HEADLINE_CONTENDERS, whole=("2", "3"))
    compared = _interleaved_decode(model, workdir, cache_dir, cores, COMPARISON_CONTENDERS)
    streamed = _interleaved_decode(model, workdir, cache_dir, cores, STREAM_CONTENDERS)
    report["stream_interval_2_stage"] = {"interval_ms": STREAM_INTERVAL_MS,
                                         "each_token_ms_per_token": streamed["2-each"]["ms"],
                                         "interval_ms_per_token": streamed["2-interval"]["ms"],
                                         "single_process_ms_per_token": streamed["single"]["ms"]}
    report["client_priority_2_stage"] = {"quiet_ms_per_token": streamed["2-each"]["ms"],
                                         "local_ms_per_token": streamed["2-local"]["ms"],
                                         "held_ms_per_token": streamed["2-held"]["ms"],
                                         "single_process_ms_per_token": streamed["single"]["ms"]}
    report["single_process_ms_per_token"] = decode["single"]["ms"]
    pipelines_ms = {n: decode[n]["ms"] for n in ("2", "3")}
    stage_cpu = {n: decode[n]["cpu"] for n in ("2", "3")}
    hops = {"2": decode["2"]["hops"], "3": decode["3"]["hops"]}
    # The stages below the head with their plain frames in C (the default) and all in Python.
    report["frame_path_comparison_3_stage"] = {"native_ms_per_token": compared["3-tcp"]["ms"],
                                               "python_ms_per_token": compared["3-python"]["ms"]}
    report["return_path_comparison_3_stage"] = {"relay_ms_per_token": compared["3-relay"]["ms"],
                                                "direct_ms_per_token": compared["3-tcp"]["ms"]}
    report["decode_rounds"] = {**{name: d["runs"] for name, d in decode.items()},
                               **{f"{name} (comparison phase)": d["runs"] for name, d in compared.items()}}
    single_ms = compared["single"]["ms"]  # the phase's own unsplit runs
    report["transport_comparison_3_stage"] = {
        transport: {"ms_per_token": compared[name]["ms"],
                    "per_hop_overhead_us": (compared[name]["ms"] - single_ms) / 3 * 1e3,
                    "hop_latency_us": compared[name]["hop_latency"]}
        for transport, name in (("tcp", "3-tcp"), ("stream", "3-stream"))
    }
    # Median "frame handed to the transport -> compute starts at the next stage", from the
    # stages' own histograms, over the default 3-stage pipeline's decode runs.
    report["hop_latency_us"] = decode["3"]["hop_latency"]
    report["pipeline_ms_per_token"] = pipelines_ms
    # The same pipelines, the client asking for the whole completion (no message per token).
    report["whole_completion_ms_per_token"] = {n: decode[f"{n}-whole"]["ms"] for n in ("2", "3")}
    report["one_stage_ms_per_token"] = decode["1"]["ms"]
    report["stage_cpu_ms_per_token"] = stage_cpu
    # Where a token's CPU goes: each process's decoding threads and the rest (thread_split), the
    # single process's next to the 1-, 2- and 3-stage pipelines'. On a host whose cores are busy
    # for the whole token, CPU beyond the single process's is what the split costs.
    report["token_cpu_us_by_thread"] = {n: decode[n]["threads"] for n in ("single", "1", "2", "3")}
    # What a token pays per hop, as the client sees it: the 3-stage decode's excess over the
    # single process, over the 3 legs a token travels (head -> 1 -> 2 -> head, direct return).
    report["per_hop_overhead_us"] = (pipelines_ms["3"] - report["single_process_ms_per_token"]) / 3 * 1e3
    # From the stages' own histograms: the head's wait for a step's outputs minus the compute
    # of the stages below, per leg (2 and 3 stages averaged).
    all_hops = [h for n in hops.values() for h in n]
    report["per_hop_overhead_us_histograms"] = sum(all_hops) / len(all_hops)
    report["per_hop_overhead_us_by_hop"] = hops
    # Split cost = hidden-state capture + compute inflation + hops: the stages' own compute
    # per token, summed, next to the single process's whole ms/token.
    report["stage_compute_ms_per_token"] = {n: sum(decode[n]["compute"]) for n in ("2", "3")}
    report["stage_compute_ms_by_stage"] = {n: decode[n]["compute"] for n in ("2", "3")}
    # The whole cost of splitting, per extra stage, as seen by a client.
    report["split_cost_us_per_extra_stage"] = (pipelines_ms["3"] - report["single_process_ms_per_token"]) / 2 * 1e3
    single = report["single_process_ms_per_token"]
    ratios.update({
        "decode_2_stage": single / pipelines_ms["2"],
        "decode_3_stage": single / pipelines_ms["3"],
        # The stack unsplit against the single process, and each split against the stack unsplit.
        "decode_1_stage": single / decode["1"]["ms"],
        "decode_2_stage_whole_completion": single / decode["2-whole"]["ms"],
        "decode_3_stage_whole_completion": single / decode["3-whole"]["ms"],
        "decode_2_stage_vs_1_stage": decode["1"]["ms"] / pipelines_ms["2"],
        "decode_3_stage_vs_1_stage": decode["1"]["ms"] / pipelines_ms["3"],
    })


def _host_section(report: dict[str, object]) -> None:
    """How this host and build ran every section: no measurement, always reported."""
    report["native_frames"] = native_frames.available() == ""
    report["cpu_wake_latency_us"] = wake_latency_setting()
    report["hop_transport_default"] = StageConfig.__dataclass_fields__["hop_transport"].default
    # Stages sharing this host sleep their OpenMP workers soon after a decode; the single
    # process runs as llama-cpp-python does (an operator's GOMP_SPINCOUNT applies to both).
    report["openmp_spincount"] = {"stages": stage_environment()["GOMP_SPINCOUNT"],
                                  "single_process": os.environ.get("GOMP_SPINCOUNT", "libgomp default")}
    report["openmp_wait_policy"] = {"stages": stage_environment().get("OMP_WAIT_POLICY", "libgomp default"),
                                    "single_process": os.environ.get("OMP_WAIT_POLICY", "libgomp default")}
    report["openmp_proc_bind"] = {"stages": stage_environment().get("OMP_PROC_BIND", "libgomp default"),
                                  "single_process": os.environ.get("OMP_PROC_BIND", "libgomp default")}
    # Whether each stage's binding starts at its own core (stage_index mod the cores).
    report["openmp_places_by_stage"] = stage_environment().get(SHARED_HOST_PLACES_ENV) == "1"
    report["hidden_state_capture"] = _capture_kind()
    # What runs the CPU graphs: OpenMP, or (a build without it) ggml's own pool, polling as set.
    report["cpu_threads"] = "openmp" if threadpool.openmp_build() else {
        "stages": f"ggml pool, poll {threadpool.poll_level(stage_environment())}",
        "single_process": f"ggml pool, poll {threadpool.poll_level(os.environ)}"}
    report["wire_bytes_per_token"] = {d: wire.payload_size(d, 1, 576) for d in wire.DTYPES}


def _capture_kind() -> str:
    from skippy_stage.model.capture import native_library_path

    return "native" if native_library_path() is not None else "python"
