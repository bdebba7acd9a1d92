"""``skippy-stage floor``: what a split costs before any protocol, the floor under ``bench``'s decode ratios.

    skippy-stage floor [--rounds 8] [--tokens 100]

Runs the packaged SmolLM2 greedy, one token at a time, four ways, in interleaved rounds (medians):

* ``whole``   — the unsplit model: one ``StageRuntime`` of layers 0:30 in a process of its own;
* ``chain3``  — the three slices 0:10 / 10:20 / 20:30 one after another in one process;
* ``pipe2``, ``pipe3`` — the slices in processes of their own, the hidden rows handed on over
  ``multiprocessing`` pipes.

Every contender is the project's own runtime (``StageRuntime.run_batch``, the same slices, 2
threads, OpenMP's spin count and binding as co-located stages get them) and the driver sends
each token over a pipe, so ``whole`` pays a hand-off too. The pipes carry no protocol at all: no
gRPC, no framing, no checks, no lanes beyond the runtime's, no metrics, no return path. What
separates ``pipe3`` from ``whole`` is therefore the split itself (three decodes instead of one:
``chain3``) and processes taking turns on the cores; what separates ``bench``'s 3-stage pipeline
from ``pipe3`` is everything the data plane adds.

Where it may (root), the run holds idle CPUs to polling as ``bench``'s stages do
(``cpu_wake_latency_us: 0``; ``SKIPPY_BENCH_WAKE_LATENCY_US=host`` leaves the host's policy), so
the floor is taken under the wake policy the pipelines it bounds are measured under.

Only ratios within one run mean anything: the host is shared and noisy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any

from skippy_stage.errors import SkippyError

SPLITS = {"whole": [(0, 30)], "pipe2": [(0, 15), (15, 30)], "pipe3": [(0, 10), (10, 20), (20, 30)],
          "chain3": [(0, 10), (10, 20), (20, 30)]}


def add_floor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``floor`` on the ``skippy-stage`` subcommand parser."""
    p = subparsers.add_parser("floor", help="the split's floor with no protocol: the unsplit model against its "
                                            "slices chained and in processes over pipes",
                              description=__doc__.split("\n\n", 2)[2].replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per round; positions grow across rounds (default 100)")
    p.set_defaults(func=cmd_floor)
    return p


def _runtimes(ranges, cache_dir: str, indexes):
    from skippy_stage.model.chain import chain_configs
    from skippy_stage.model.packaged import smollm2_path
    from skippy_stage.model.runtime import StageRuntime

    configs = chain_configs(smollm2_path(), ranges, cache_dir, n_threads=2, ctx_size=4096)
    return [StageRuntime(configs[i]) for i in indexes]


def _entry(position: int, token: int, hidden, final: bool):
    import numpy as np

    from skippy_stage.model.runtime import BatchEntry

    return BatchEntry("s", np.arange(position, position + 1), token_ids=[token], hidden=hidden,
                      want_logits=False, sample=final)


def _serve(ranges, indexes, cache_dir: str, inbox, outbox, ready) -> None:
    """One process: run its slices (one, or all of them for ``chain3``) on every message."""
    runtimes = _runtimes(ranges, cache_dir, indexes)
    last = len(ranges) - 1
    decode_s: list[float] = []
    ready.put("ready")
    while (message := inbox.recv()) is not None:
        if message == "stats":
            ready.put(decode_s)
            decode_s = []
            continue
        position, token, hidden = message
        started = time.perf_counter()
        for index, runtime in zip(indexes, runtimes):
            result = runtime.run_batch([_entry(position, token, hidden, index == last)])[0]
            hidden = result.hidden
        decode_s.append(time.perf_counter() - started)
        outbox.send((position, result.token if indexes[-1] == last else token, hidden))
    for runtime in runtimes:
        runtime.close()


class Contender:
    def __init__(self, name: str, cache_dir: str) -> None:
        ctx = mp.get_context("spawn")
        ranges = SPLITS[name]
        groups = [list(range(len(ranges)))] if name in ("whole", "chain3") else [[i] for i in range(len(ranges))]
        self.pipes = [ctx.Pipe(duplex=False) for _ in range(len(groups) + 1)]
        self.ready = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(ranges, group, cache_dir, self.pipes[i][0],
                                                       self.pipes[i + 1][1], self.ready), daemon=True)
                      for i, group in enumerate(groups)]
        for proc in self.procs:
            proc.start()
        for _ in self.procs:
            self.ready.get(timeout=300)
        self.position, self.token = 0, 1
        self.tokens: list[int] = []

    def round(self, tokens: int) -> tuple[float, float]:
        """(ms per token, summed median decode ms per token over the processes)."""
        started = time.perf_counter()
        for _ in range(tokens):
            self.pipes[0][1].send((self.position, self.token, None))
            _, self.token, _ = self.pipes[-1][0].recv()
            self.tokens.append(self.token)
            self.position += 1
        wall = (time.perf_counter() - started) / tokens * 1e3
        for pipe in self.pipes[:-1]:
            pipe[1].send("stats")
        decode = sum(statistics.median(self.ready.get(timeout=60)) for _ in self.procs) * 1e3
        return wall, decode

    def close(self) -> None:
        for pipe in self.pipes[:-1]:
            pipe[1].send(None)
        for proc in self.procs:
            proc.join(30)


def cmd_floor(args: argparse.Namespace) -> int:
    from skippy_stage.cli.bench import wake_latency_setting
    from skippy_stage.config import shared_host_openmp
    from skippy_stage.server.wake_latency import WakeLatencyRequest

    os.environ.update(shared_host_openmp(dict(os.environ)))  # as co-located stages get it (children inherit it)
    held = wake_latency_setting()
    request = None if held is None else WakeLatencyRequest(held, stage_id="floor")
    with tempfile.TemporaryDirectory(prefix="skippy-floor-") as cache_dir:
        contenders = {name: Contender(name, cache_dir) for name in SPLITS}
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        try:
            for _ in range(args.rounds):
                for name, contender in contenders.items():
                    runs[name].append(contender.round(args.tokens))
        finally:
            for contender in contenders.values():
                contender.close()
            if request is not None:
                request.close()
    # Every contender runs the same model greedily: the split is exact (the equivalence tests), so
    # the tokens must agree, or the figures compare different work.
    reference = contenders["whole"].tokens
    for name, contender in contenders.items():
        if contender.tokens != reference:
            at = next(i for i, (a, b) in enumerate(zip(contender.tokens, reference)) if a != b)
            raise SkippyError(f"{name} decoded token {contender.tokens[at]} at step {at}, whole {reference[at]}")
    print(f"{len(reference)} greedy tokens, the same from every contender; idle CPUs "
          + ("held to polling (cpu_wake_latency_us 0)" if request is not None else "under the host's idle policy"))
    whole = statistics.median(w for w, _ in runs["whole"])
    print(f"{'':8} {'ms/token':>9} {'vs whole':>9} {'decode ms':>10}   rounds (ms/token)")
    for name, values in runs.items():
        wall = statistics.median(w for w, _ in values)
        decode = statistics.median(d for _, d in values)
        print(f"{name:8} {wall:9.2f} {whole / wall:9.3f} {decode:10.2f}   " + ", ".join(f"{w:.2f}" for w, _ in values))
    return 0
