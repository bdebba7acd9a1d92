#!/usr/bin/env python3
"""Where a token's CPU goes, thread by thread: the unsplit model against the pipelines.

    python tools/thread_cpu.py [--rounds 4] [--tokens 256] [--whole]

Loads llama-cpp-python's unsplit model in a process of its own and the 1-, 2- and 3-stage
pipelines ``bench`` measures, then in interleaved rounds (the others frozen, as ``bench`` does)
decodes greedily and reads every thread's ``/proc/<pid>/task/<tid>/schedstat`` before and after:
CPU time, time spent runnable but waiting for a core, and timeslices. Printed per token (medians
over the rounds): each process's threads, busiest first, named by what they are (OpenMP's
threads are the two busiest of a stage; the rest by their kernel name), and the sums.

On a host whose cores are all busy for the whole token (two cores, co-located stages), the
token takes (sum of every thread's CPU) / cores: CPU above the unsplit model's own is the split's
cost, whatever thread spends it. ``--whole``: the client asks for the whole completion (no
message per token).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path


def task_stats(pid: int) -> dict[int, tuple[str, int, int, int]]:
    """tid: (name, cpu ns, runnable-waiting ns, timeslices) for every thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu, wait, slices = (int(v) for v in (task / "schedstat").read_text().split())
            name = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        out[int(task.name)] = (name, cpu, wait, slices)
    return out


def delta(before: dict, after: dict, n: int) -> list[tuple[str, float, float, float]]:
    """(name, cpu us, wait us, slices) per token for each thread, busiest first."""
    rows = []
    for tid, (name, cpu, wait, slices) in after.items():
        b = before.get(tid, (name, 0, 0, 0))
        rows.append((name, (cpu - b[1]) / n / 1e3, (wait - b[2]) / n / 1e3, (slices - b[3]) / n))
    rows.sort(key=lambda r: -r[1])
    return rows


def _minus(before: dict, part_after: dict, part_before: dict) -> dict:
    """``before`` moved on by the part (so ``after - result`` leaves that part out)."""
    out = {}
    for tid, (name, cpu, wait, slices) in before.items():
        pa, pb = part_after.get(tid, (name, 0, 0, 0)), part_before.get(tid, (name, 0, 0, 0))
        out[tid] = (name, cpu + pa[1] - pb[1], wait + pa[2] - pb[2], slices + pa[3] - pb[3])
    return out


def _single(conn, model: str, threads: int, prompt: str) -> None:
    from skippy_stage.model.loader import reference_llama

    llm = reference_llama(Path(model), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    tokens = llm.tokenize(prompt.encode())
    while (n := conn.recv()) is not None:
        count = 0
        for _ in llm.generate(tokens, temp=0.0, reset=True):
            count += 1
            if count == 1:
                conn.send("first")  # decode from here: the caller reads the threads' counters
                conn.recv()
            if count == n + 1:
                break
        conn.send("done")
    llm.close()


def label(rows: list, omp: int) -> list[tuple[str, float, float, float]]:
    """The ``omp`` busiest threads are the decode's (OpenMP's); the rest keep their names."""
    return [(f"omp-{i}" if i < omp else name, cpu, wait, slices) for i, (name, cpu, wait, slices) in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--whole", action="store_true", help="the client asks for the whole completion")
    args = parser.parse_args()

    from skippy_stage.cli import bench
    from skippy_stage.config import MAX_STREAM_INTERVAL_MS
    from skippy_stage.model.packaged import smollm2_path

    model = smollm2_path()
    cores = os.cpu_count() or 1
    contenders = {k: v for k, v in bench.HEADLINE_CONTENDERS.items()}
    table: dict[str, list[list]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="skippy-threads-") as tmp:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        single = ctx.Process(target=_single, args=(there, str(model), cores, bench.PROMPT), daemon=True)
        single.start()
        quiet = bench.QuietClient()
        pipelines = {}
        try:
            for name, (ranges, return_path, transport) in contenders.items():
                sub = Path(tmp) / name
                sub.mkdir()
                pipelines[name] = bench._Pipeline(model, ranges, sub, tmp, return_path=return_path, transport=transport)
            interval = MAX_STREAM_INTERVAL_MS if args.whole else None
            for _ in range(args.rounds):
                with bench._awake(pipelines.values(), None):
                    here.send(args.tokens)
                    here.recv()
                    before = task_stats(single.pid)
                    started = time.perf_counter()
                    here.send("go")
                    here.recv()
                    wall = (time.perf_counter() - started) / args.tokens * 1e3
                    table["single"].append([wall, label(delta(before, task_stats(single.pid), args.tokens), 2)])
                for name, pipeline in pipelines.items():
                    def measure(pipeline=pipeline) -> list:
                        quiet.generate(pipeline.endpoint, bench.PROMPT, 8, interval)
                        pids = [p.pid for p in pipeline.local.procs]
                        # The prompt alone first: its counters come off the whole run's (decode steps only).
                        prompt_before = [task_stats(pid) for pid in pids]
                        quiet.generate(pipeline.endpoint, bench.PROMPT, 1, interval)
                        prompt_after = [task_stats(pid) for pid in pids]
                        before = [task_stats(pid) for pid in pids]
                        figures = quiet.generate(pipeline.endpoint, bench.PROMPT, args.tokens + 1, interval)
                        after = [task_stats(pid) for pid in pids]
                        n = figures["completion_tokens"] - 1
                        rows = [label(delta(_minus(b, pa, pb), a, n), 2)
                                for b, a, pb, pa in zip(before, after, prompt_before, prompt_after)]
                        return [1e3 / figures["tokens_per_s"], *rows]

                    with bench._awake(pipelines.values(), pipeline):
                        table[name].append(bench.after_freeze(measure))
        finally:
            here.send(None)
            single.join(30)
            quiet.close()
            for pipeline in pipelines.values():
                pipeline.stop()
    single_ms = statistics.median(r[0] for r in table["single"])
    for name, rounds in table.items():
        ms = statistics.median(r[0] for r in rounds)
        print(f"\n== {name}: {ms:.2f} ms/token ({single_ms / ms:.3f} of the unsplit model)")
        total_cpu = 0.0
        for proc in range(1, len(rounds[0])):
            merged: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
            for r in rounds:
                groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
                for tname, cpu, wait, slices in r[proc]:
                    g = groups[tname]
                    g[0] += cpu
                    g[1] += wait
                    g[2] += slices
                for tname, g in groups.items():
                    merged[tname].append(tuple(g))
            lines = sorted(((t, [statistics.median(v[i] for v in vals) for i in range(3)]) for t, vals in merged.items()),
                           key=lambda x: -x[1][0])
            proc_cpu = sum(v[0] for _, v in lines)
            total_cpu += proc_cpu
            label_ = "process" if name == "single" else f"stage {proc - 1}"
            print(f"  {label_}: {proc_cpu:8.0f} us CPU a token")
            for tname, (cpu, wait, slices) in lines:
                if cpu >= 5:
                    print(f"    {tname:18} cpu {cpu:7.0f} us  waiting for a core {wait:6.0f} us  slices {slices:5.1f}")
        print(f"  all: {total_cpu:.0f} us CPU a token = {total_cpu / 1e3 / ms:.2f} cores busy")


if __name__ == "__main__":
    main()
