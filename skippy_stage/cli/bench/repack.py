"""Weight repacking on vs off: decode and prefill of a 2-stage pipeline and of the unsplit model,
each loaded both ways."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze
from skippy_stage.cli.bench.workload import PROMPT, QUICK
from skippy_stage.model.packaged import smollm2_path

# Weight repacking on vs off: SmolLM2 requantized to Q4_0, every matrix of which llama.cpp repacks on
# an AVX2 or AVX-512 CPU (of its Q4_1 as packaged: none, both ways would run the same kernels), on
# 2 stages. Gemma-3-270M Q4_K_M, whose texts differ with repack, repacks 27 small tensors only
# (12.7 MiB of 248): no difference in speed measured on an AMD EPYC. Sized to add ~30 s.
REPACK_SPLIT = [(0, 15), (15, 30)]
REPACK_DECODE_TOKENS = 16 if QUICK else 32
REPACK_PREFILL_TOKENS = 64 if QUICK else 256
REPACK_ROUNDS = 1 if QUICK else 5


def _llama_decode_ms(llm, tokens: list[int], n_tokens: int) -> float:
    """ms per greedy token of an in-process ``Llama`` after the first (decode steps only)."""
    count, started = 0, time.perf_counter()
    for _ in llm.generate(tokens, temp=0.0, reset=True):
        count += 1
        if count == 1:
            started = time.perf_counter()
        if count == n_tokens + 1:
            break
    return (time.perf_counter() - started) / max(count - 1, 1) * 1e3


def _llama_prefill_tps(llm, tokens: list[int]) -> float:
    llm.reset()
    started = time.perf_counter()
    llm.eval(tokens)
    return len(tokens) / (time.perf_counter() - started)


def _repack(workdir: Path, cache_dir: str, cores: int) -> dict[str, object]:
    """``repack`` off (the default) and on: single-stream decode ms/token and prefill tokens/s of
    a 2-stage pipeline, each against the unsplit model in this process loaded the same way
    (``reference_llama(repack=...)``; on is stock ``Llama``'s loading), both pipelines and both
    models loaded at once and run in interleaved rounds (medians), the others frozen. On an AMX
    CPU, which refuses repacking, the reason instead, under "skipped"."""
    from skippy_stage.model import host
    from skippy_stage.model.loader import reference_llama
    from skippy_stage.model.packaged import requantized_q4_0

    if host.host_info().amx:
        return {"skipped": f"this CPU has AMX, where repack=true is refused ({host.AMX_REPACK_CRASH})"}
    started = time.perf_counter()
    model = requantized_q4_0(smollm2_path(), workdir)
    ways = {"off": False, "on": True}
    singles, pipelines = {}, {}
    runs: dict[str, dict[str, list[float]]] = {way: {"single_ms": [], "single_tps": [], "pipeline_ms": [],
                                                     "pipeline_tps": []} for way in ways}
    try:
        for way, repack in ways.items():
            singles[way] = reference_llama(model, repack=repack, n_ctx=2048, n_threads=cores, n_threads_batch=cores,
                                           verbose=False)
            (workdir / f"repack-{way}").mkdir()
            pipelines[way] = _Pipeline(model, REPACK_SPLIT, workdir / f"repack-{way}", cache_dir,
                                       extra={"repack": repack, "lane_count": 1, "ctx_size": 2048})
        llm = singles["off"]
        decode_tokens = llm.tokenize(PROMPT.encode())
        text = "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
        prefill_tokens = llm.tokenize((text * REPACK_PREFILL_TOKENS).encode())[:REPACK_PREFILL_TOKENS]
        prefill_text = llm.detokenize(prefill_tokens[1:]).decode()  # the head adds the BOS itself
        with _awake(pipelines.values(), None):
            for single in singles.values():
                _llama_decode_ms(single, decode_tokens, 2)  # warm (a pipeline is warmed by _awake)
        for _ in range(REPACK_ROUNDS):
            for way in ways:
                with _awake(pipelines.values(), None):
                    runs[way]["single_ms"].append(_llama_decode_ms(singles[way], decode_tokens, REPACK_DECODE_TOKENS))
                    runs[way]["single_tps"].append(_llama_prefill_tps(singles[way], prefill_tokens))
                with _awake(pipelines.values(), pipelines[way]):
                    decoded = after_freeze(partial(pipelines[way].generate, PROMPT, REPACK_DECODE_TOKENS + 1))
                    prefilled = after_freeze(partial(pipelines[way].generate, prefill_text, 1))
                runs[way]["pipeline_ms"].append(1e3 / decoded["tokens_per_s"])
                runs[way]["pipeline_tps"].append(prefilled["prompt_tokens"] / prefilled["ttft_s"])
    finally:
        for llm in singles.values():
            llm.close()
        for pipeline in pipelines.values():
            pipeline.stop()
    out: dict[str, object] = {"model": "SmolLM2-135M requantized to Q4_0", "stages": [list(r) for r in REPACK_SPLIT],
                              "decode_tokens": REPACK_DECODE_TOKENS, "prefill_tokens": REPACK_PREFILL_TOKENS,
                              "rounds": REPACK_ROUNDS, "seconds": time.perf_counter() - started}
    for way in ways:
        m = {key: float(np.median(values)) for key, values in runs[way].items()}
        out[way] = {"single_process_ms_per_token": m["single_ms"], "pipeline_ms_per_token": m["pipeline_ms"],
                    "decode_ratio": m["single_ms"] / m["pipeline_ms"],
                    "single_process_prefill_tokens_per_s": m["single_tps"],
                    "pipeline_prefill_tokens_per_s": m["pipeline_tps"],
                    "prefill_ratio": m["pipeline_tps"] / m["single_tps"],
                    # What the stages ran with (a `bench --set repack=...` applies to these pipelines too).
                    "stages_repack": bool(pipelines[way].local.configs[0].get("repack", False))}
    # Above 1: repack on is the faster. Medians of each round's ratio: a round runs off and on one
    # right after the other, so a busy moment of the host weighs on both sides of its ratio.
    on, off = runs["on"], runs["off"]
    out["on_vs_off"] = {
        "single_process_decode": float(np.median(np.divide(off["single_ms"], on["single_ms"]))),
        "pipeline_decode": float(np.median(np.divide(off["pipeline_ms"], on["pipeline_ms"]))),
        "single_process_prefill": float(np.median(np.divide(on["single_tps"], off["single_tps"]))),
        "pipeline_prefill": float(np.median(np.divide(on["pipeline_tps"], off["pipeline_tps"]))),
    }
    return out
