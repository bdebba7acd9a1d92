"""Single-stream decode: the unsplit model in this process against pipelines of every kind the
report compares (1, 2 and 3 stages, transports, return paths, frame paths, the client's stream),
in interleaved rounds."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze
from skippy_stage.cli.bench.quiet_client import QuietClient, _HeldClient
from skippy_stage.cli.bench.readings import (
    THREAD_KEYS,
    _histogram_sums,
    _mean_delta,
    _shifted,
    _subtract,
    hop_latency_median_us,
    hop_overheads_us,
    thread_split,
    thread_times,
)
from skippy_stage.cli.bench.workload import DECODE_ROUNDS, DECODE_TOKENS, PROMPT, THREE
from skippy_stage.config import MAX_STREAM_INTERVAL_MS

# Single-stream decode, in two phases of interleaved rounds: the headline ratios (2 and 3 stages,
# the defaults: TCP frames, tokens straight back to the head), then the transports and return
# paths compared on 3 stages. Each phase loads only its own pipelines: an idle stage process
# still wakes ~100 times a second (gRPC's thread pool, health probes), and ten of them waking
# in the middle of the measured pipeline's decodes cost its 3-stage ratio ~0.05 in this
# project's runs (0.70-0.72 with all four pipelines loaded, 0.75-0.80 with two).
# "1": the whole model in one stage, served by this project's own stack (gRPC client, the head's
# scheduler, the runtime): what separates it from the single process is the stack, and what
# separates the pipelines from it is the split alone.
HEADLINE_CONTENDERS = {"1": ([(0, 30)], "direct", "tcp"), "2": ([(0, 15), (15, 30)], "direct", "tcp"),
                       "3": (THREE, "direct", "tcp")}
# "3-python": the default pipeline with every frame on the Python path (native_frames off).
COMPARISON_CONTENDERS = {"3-tcp": (THREE, "direct", "tcp"), "3-relay": (THREE, "relay", "tcp"),
                         "3-stream": (THREE, "direct", "stream"), "3-python": (THREE, "direct", "tcp", False)}
# The client's stream: one message per token (the default) against tokens that come within
# STREAM_INTERVAL_MS of the last message sent together (``stream_interval_ms``), 2 stages.
STREAM_INTERVAL_MS = 20.0
STREAM_CONTENDERS = {"2-each": ([(0, 15), (15, 30)], "direct", "tcp"),
                     "2-interval": ([(0, 15), (15, 30)], "direct", "tcp", True,
                                    {"stream_interval_ms": STREAM_INTERVAL_MS}),
                     # The client in the bench's own process at normal priority (the others: QuietClient).
                     "2-local": ([(0, 15), (15, 30)], "direct", "tcp", True, None, "local"),
                     # The client reading nothing until the end (as on another host), timed at the head.
                     "2-held": ([(0, 15), (15, 30)], "direct", "tcp", True, None, "held")}


class SingleDecoder:
    """The unsplit model in this process (llama-cpp-python's Llama), kept loaded so its
    decode runs can be interleaved with the pipelines' runs."""

    def __init__(self, model: Path, threads: int) -> None:
        from skippy_stage.model.loader import reference_llama

        self.threads = threads
        self.llm = reference_llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.tokens = self.llm.tokenize(PROMPT.encode())

    def ms_per_token(self) -> float:
        return self.measure()[0]

    def measure(self) -> tuple[float, dict[str, float]]:
        """ms per token, and this process's CPU by thread over the same tokens (``thread_split``:
        its decoding threads are llama.cpp's; the rest is this bench's own, idle meanwhile)."""
        started = time.perf_counter()
        before: dict[int, tuple[int, int]] = {}
        n = 0
        for _ in self.llm.generate(self.tokens, temp=0.0, reset=True):
            n += 1
            if n == 1:
                before = thread_times(os.getpid())
                started = time.perf_counter()  # from the first sampled token: decode only
            if n == DECODE_TOKENS + 1:
                break
        ms = (time.perf_counter() - started) / DECODE_TOKENS * 1e3
        return ms, thread_split(_subtract(thread_times(os.getpid()), before), DECODE_TOKENS, self.threads)

    def close(self) -> None:
        self.llm.close()


def _interleaved_decode(model: Path, workdir: Path, cache_dir: str, cores: int,
                        contenders: dict[str, tuple], whole: tuple[str, ...] = ()) -> dict[str, dict]:
    """Single-stream decode of the unsplit model and of ``contenders`` (name: layer ranges,
    return path, transport[, native frames[, other config[, "local": the client in this process]]]),
    in rounds; the pipelines' client is a QuietClient unless a contender says "local" (the client in
    this process) or "held" (``QuietClient.held``, timed at the head). The
    contenders named in ``whole`` run once more per round for a client that asks for the whole
    completion rather than a stream (``<name>-whole``), the unsplit model's own way of working.

    Everything is loaded at once and each round runs each contender once, so a slow moment of a
    noisy machine hits all of them alike; the figures are the medians over the rounds. The
    pipelines not being measured are frozen meanwhile (``_awake``).
    """
    pipelines: dict[str, _Pipeline] = {}
    clients: dict[str, QuietClient | None] = {}
    quiet = QuietClient()
    single = SingleDecoder(model, cores)
    runs: dict[str, list] = {"single": [], **{name: [] for name in contenders}, **{f"{n}-whole": [] for n in whole}}
    try:
        for name, (ranges, return_path, transport, *more) in contenders.items():
            sub = workdir / f"decode-{name}"
            sub.mkdir()
            pipelines[name] = _Pipeline(model, ranges, sub, cache_dir, return_path=return_path, transport=transport,
                                        native_frames=more[0] if more else True,
                                        extra=more[1] if len(more) > 1 else None)
            clients[name] = {"local": None, "held": _HeldClient(quiet, pipelines[name])}.get(
                more[2] if len(more) > 2 else "", quiet)
        with _awake(pipelines.values(), None):
            single.ms_per_token()  # warm
        for _ in range(DECODE_ROUNDS):
            with _awake(pipelines.values(), None):
                ms, threads = single.measure()
                runs["single"].append((ms, [], [], [], 0.0, [threads]))
            for name, pipeline in pipelines.items():
                with _awake(pipelines.values(), pipeline):
                    runs[name].append(after_freeze(partial(_decode_ms, pipeline, clients[name])))
                    if name in whole:
                        runs[f"{name}-whole"].append(after_freeze(partial(_decode_ms, pipeline, clients[name],
                                                                          whole=True)))
    finally:
        quiet.close()
        single.close()
        for pipeline in pipelines.values():
            pipeline.stop()
    out = {}
    for name, values in runs.items():
        ms = [v[0] for v in values]
        median = sorted(values, key=lambda v: v[0])[len(values) // 2]
        out[name] = {"ms": float(np.median(ms)), "runs": ms, "cpu": median[1],
                     "compute": [float(c) for c in np.median(np.array([v[3] for v in values]), axis=0)]
                     if name != "single" else [],
                     "hops": [float(h) for h in np.median(np.array([v[2] for v in values]), axis=0)]
                     if name != "single" else [],
                     "hop_latency": float(np.median([v[4] for v in values])),
                     # Each process's CPU by thread, medians over the rounds.
                     "threads": [{key: float(np.median([v[5][i][key] for v in values])) for key in THREAD_KEYS}
                                 for i in range(len(values[0][5]))]}
    return out


def _decode_ms(pipeline: _Pipeline, client: QuietClient | None = None,
               whole: bool = False) -> tuple[float, list[float], list[float], list[float], float, list[dict]]:
    """Single-stream ms/token, each stage's CPU ms per token over the same run, the hop
    overhead from the stages' histograms, each stage's compute ms per batch, the median hop
    latency (send -> compute starts at the next stage), and each stage's CPU by thread
    (``thread_split``). ``whole``: the client asks for the whole completion rather than a stream
    (``stream_interval_ms`` at its most: the first token at once, the rest about once a second
    and with the end).

    Every per-token figure is of the decode steps alone, as the single process's are: what a
    one-token generation of the same prompt cost (its prefill, the session's set-up and end) is
    taken off the whole run's counters. Before, one ~18-token prefill in 129 steps added ~0.2 ms
    to each stage's mean compute and ~1 ms to its CPU per token.

    A stage computes about a third of the model per token; CPU far above that means its
    threads spin while it waits, stealing cores from the stage that has work.
    """
    if client is None:
        run = pipeline.generate
    else:
        run = partial(client.generate, pipeline.endpoint, stream_interval_ms=MAX_STREAM_INTERVAL_MS if whole else None)
    run(PROMPT, 8)  # warm the path
    pids = [p.pid for p in pipeline.local.procs]

    def snapshot() -> tuple[list[dict], list[dict]]:
        return [thread_times(pid) for pid in pids], [_histogram_sums(p) for p in pipeline.metrics_ports]

    prompt_before = snapshot()
    run(PROMPT, 1)
    prompt_after = snapshot()
    full_before = snapshot()
    figures = run(PROMPT, DECODE_TOKENS + 1)
    full_after = snapshot()
    n = figures["completion_tokens"] - 1  # decode steps: the first token comes with the prefill
    threads = [thread_split(_subtract(_subtract(fa, fb), _subtract(pa, pb)), n, pipeline.threads)
               for fb, fa, pb, pa in zip(full_before[0], full_after[0], prompt_before[0], prompt_after[0])]
    cpu = [(t["decoding"] + t["other"]) / 1e3 for t in threads]
    # The decode steps' histogram counts: the whole run's after the prompt-only run's are taken off.
    hist_before = [_shifted(fb, pb, pa) for fb, pb, pa in zip(full_before[1], prompt_before[1], prompt_after[1])]
    hist_after = full_after[1]
    compute = [_mean_delta(b, a, "compute") * 1e3 for b, a in zip(hist_before, hist_after)]
    return (1e3 / figures["tokens_per_s"], cpu, hop_overheads_us(hist_before, hist_after), compute,
            hop_latency_median_us(hist_before, hist_after), threads)
