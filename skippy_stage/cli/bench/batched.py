"""Prefill and aggregate decode at several concurrencies: the unsplit model batched through the
low-level API in this process against a 3-stage pipeline serving concurrent clients."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.pipeline import _Pipeline
from skippy_stage.cli.bench.workload import AGG_TOKENS, CONCURRENCY, DECODE_ROUNDS, PREFILL_TOKENS, PROMPT, THREE
from skippy_stage.config import StageConfig
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.runtime import StageRuntime


def _long_prompt(runtime: StageRuntime, n_tokens: int) -> tuple[str, list[int]]:
    paragraph = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
                 "Over centuries, towers of stone replaced the fires, and lenses replaced the open flame. ")
    text = paragraph
    while len(runtime.tokenizer.tokenize(text)) < n_tokens:
        text += paragraph
    tokens = runtime.tokenizer.tokenize(text)[:n_tokens]
    return text, tokens


def single_process(model: Path, threads: int, cache_dir: str) -> dict[str, object]:
    """The unsplit model in this process, batched through the low-level API: prefill and
    aggregate decode of several sequences."""
    cfg = StageConfig(model_path=str(model), stage_id="single", stage_index=0, layer_start=0, layer_end=30,
                      n_threads=threads, lane_count=8, ctx_size=8 * 2048, n_batch=512, n_ubatch=512, cache_dir=cache_dir)
    runtime = StageRuntime(cfg)
    _, long_tokens = _long_prompt(runtime, PREFILL_TOKENS)
    started = time.perf_counter()
    runtime.run_batch([BatchEntry("prefill", np.arange(PREFILL_TOKENS), token_ids=long_tokens, sample=True)])
    prefill_tps = PREFILL_TOKENS / (time.perf_counter() - started)
    runtime.drop_session("prefill")

    aggregate = {}
    prompt = runtime.tokenizer.tokenize(PROMPT)
    for c in CONCURRENCY:
        sessions = [f"s{i}" for i in range(c)]
        started = time.perf_counter()
        results = runtime.run_batch([BatchEntry(s, np.arange(len(prompt)), token_ids=prompt, sample=True)
                                     for s in sessions])
        last = {r.session_id: r.token for r in results}
        pos = len(prompt)
        for _ in range(AGG_TOKENS - 1):
            results = runtime.run_batch([BatchEntry(s, [pos], token_ids=[last[s]], sample=True) for s in sessions])
            last = {r.session_id: r.token for r in results}
            pos += 1
        aggregate[str(c)] = c * AGG_TOKENS / (time.perf_counter() - started)
        for s in sessions:
            runtime.drop_session(s)
    runtime.close()
    return {"prefill_tps": prefill_tps, "aggregate": aggregate}


def _prefill_prompt(model: Path, cache_dir: str, n_tokens: int = PREFILL_TOKENS) -> str:
    """A text of ``n_tokens`` tokens for the head's tokenizer (at most: a cut may leave one fewer)."""
    cfg = StageConfig(model_path=str(model), stage_id="tok", stage_index=0, layer_start=0, layer_end=30,
                      lane_count=1, ctx_size=1024, cache_dir=cache_dir, n_threads=1)
    runtime = StageRuntime(cfg)
    try:
        text, _ = _long_prompt(runtime, n_tokens)
        while len(runtime.tokenizer.tokenize(text)) > n_tokens:
            text = text[:-1]
        return text
    finally:
        runtime.close()


def _aggregate(pipeline: _Pipeline, concurrency: int) -> float:
    results: list[dict[str, float]] = []
    lock = threading.Lock()

    def one() -> None:
        figures = pipeline.generate(PROMPT, AGG_TOKENS)
        with lock:
            results.append(figures)

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return sum(r["completion_tokens"] for r in results) / elapsed


def _batched(model: Path, workdir: Path, cache_dir: str, cores: int) -> tuple[dict[str, float],
                                                                             dict[str, dict[str, float]]]:
    """Prefill tokens/s and aggregate decode tokens/s by concurrency, of the unsplit model batched
    in this process (``single_process``) and of a 3-stage pipeline (``pipeline``)."""
    (workdir / "aggregate").mkdir()
    pipeline = _Pipeline(model, THREE, workdir / "aggregate", cache_dir)
    # Batched decode and prefill, the single process and the pipeline alternating in rounds
    # (medians), so a noisy moment of the host hits both alike.
    single_runs: list[dict] = []
    pipeline_runs: list[dict] = []
    try:
        runtime_text = _prefill_prompt(model, cache_dir)
        pipeline.generate(runtime_text, 1)  # warm
        for _ in range(DECODE_ROUNDS):
            single_runs.append(single_process(model, cores, cache_dir))
            figures = pipeline.generate(runtime_text, 1)
            pipeline_runs.append({"prefill_tps": PREFILL_TOKENS / figures["ttft_s"],
                                  "aggregate": {str(c): _aggregate(pipeline, c) for c in CONCURRENCY}})
    finally:
        pipeline.stop()

    def median(runs: list[dict], key: str, sub: str | None = None) -> float:
        return float(np.median([r[key][sub] if sub else r[key] for r in runs]))
    prefill: dict[str, float] = {"single_process": median(single_runs, "prefill_tps"),
                                 "pipeline": median(pipeline_runs, "prefill_tps")}
    aggregate: dict[str, dict[str, float]] = {
        name: {str(c): median(runs, "aggregate", str(c)) for c in CONCURRENCY}
        for name, runs in (("single_process", single_runs), ("pipeline", pipeline_runs))}
    return prefill, aggregate
