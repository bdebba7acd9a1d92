#!/usr/bin/env python3
"""Who holds each core while a pipeline decodes one stream: the time the split loses to others.

    python tools/core_occupancy.py [--stages 2|3] [--seconds 1.0] [--with-single] [--interval-ms 1000]
                                     [--timeline 25]

Starts the packaged SmolLM2 split as ``bench`` starts it, generates through ``bench``'s quiet
client (its own process, nice 19) and records the scheduler's switches with ``perf sched record``
(Debian: ``linux-perf``) for ``--seconds``. Every thread is named by its role: ``S<k>`` one of
stage k's OpenMP threads (the stage's ``n_threads`` busiest over the recording), ``s<k>`` stage
k's other threads (gRPC, handlers, listeners), ``c`` the client, ``.`` idle, ``o`` anything else
(kernel threads, perf). Prints the share of the time each combination of holders held the cores
(``S1S1``: stage 1 on both cores, ``s0S1``: stage 0's Python on core 0 while stage 1 decodes on
core 1 alone), and each role's share per core.

A single stream through co-located stages decodes well only while one stage's OpenMP team holds
every core: anything else on a core (another stage's Python, the client, a team still spinning or
not yet awake) leaves the team's other thread waiting at its next barrier, so it costs about twice
its own CPU. The combinations below the top one or two say what took the cores instead.

``--with-single`` records llama-cpp-python's unsplit model decoding too (same roles: ``S0`` its
two OpenMP threads), for the same table with nothing split. Only shares of one run mean
anything: the host is shared and noisy.

``--timeline MS`` also prints every stretch a thread ran on each core over MS milliseconds from the
middle of the recording, in order: who ran, for how long, and how long it had waited for the core
after being woken — the order of a few tokens' hand-overs, which the shares cannot show (whose work
lands on the core a stage's OpenMP thread is about to need). Threads are named by role and, where
``py-spy`` is installed, by their Python thread name (``s0:ThreadPoolExecutor-0_1`` is a gRPC
handler, ``s0:scheduler-0`` the head's decoding thread).
"""

from __future__ import annotations

import argparse
import collections
import logging
import multiprocessing as mp
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from thread_cpu import _single, task_stats  # tools/, beside this one

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}
STEP_S = 5e-6  # occupancy sampled every 5 us of the recording


def thread_cpu(pid: int) -> dict[int, int]:
    """tid: CPU ns so far, for every thread of ``pid``."""
    return {tid: cpu for tid, (_, cpu, _, _) in task_stats(pid).items()}


def roles(stage_pids: list[int], client_pid: int | None, before: list[dict[int, int]], n_threads: int) -> dict[int, str]:
    """tid: role, from the stages' threads' CPU over the recording (``before`` taken at its start)."""
    named: dict[int, str] = {}
    for k, (pid, start) in enumerate(zip(stage_pids, before)):
        now = thread_cpu(pid)
        busiest = sorted(now, key=lambda tid: start.get(tid, 0) - now[tid])[:n_threads]
        for tid in now:
            named[tid] = f"S{k}" if tid in busiest else f"s{k}"
    if client_pid is not None:
        for tid in thread_cpu(client_pid):
            named[tid] = "c"
    return named


def python_names(pids: list[int]) -> dict[int, str]:
    """tid: Python thread name, from ``py-spy dump`` where it is installed (else nothing)."""
    if shutil.which("py-spy") is None:
        return {}
    names = {}
    for pid in pids:
        out = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
        for match in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', out):
            names[int(match.group(1))] = match.group(2)
    return names


def timeline(data: Path, named: dict[int, str], python: dict[int, str], ms: float) -> None:
    """Every stretch run on each core over ``ms`` from the middle of the recording (see the module)."""
    rows = timehist(data, with_delay=True)
    t0 = rows[len(rows) // 2][0]
    print(f"\n== {ms:.0f} ms of the recording: end of each stretch (ms), core, who, ran (us), woken → ran (us)")
    for end, cpu, tid, run, delay in rows:
        if t0 <= end <= t0 + ms / 1e3:
            who = "idle" if tid == -1 else named.get(tid, "o") + (f":{python[tid]}" if tid in python else "")
            print(f"  {(end - t0) * 1e3:8.3f}  [{cpu}]  {who:34} {run * 1e6:7.0f} {delay * 1e6:7.0f}")


def timehist(data: Path, with_delay: bool = False) -> list[tuple]:
    """(end s, cpu, tid, run s) of every stretch a task ran, from ``perf sched timehist``; with
    ``with_delay``, and the time it waited for the core after its wake-up (s)."""
    text = subprocess.run(["perf", "sched", "timehist", "-i", str(data)], capture_output=True, text=True,
                          check=True).stdout
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or not parts[1].startswith("["):
            continue
        try:
            end, cpu, run_ms, delay_ms = float(parts[0]), int(parts[1].strip("[]")), float(parts[-1]), float(parts[-2])
        except ValueError:
            continue
        task = parts[2]
        tid = -1 if task.startswith("<idle>") else int(task.rsplit("[", 1)[1].split("/")[0].rstrip("]"))
        rows.append((end, cpu, tid, run_ms / 1e3, delay_ms / 1e3) if with_delay else (end, cpu, tid, run_ms / 1e3))
    return rows


def occupancy(rows: list[tuple[float, int, int, float]], named: dict[int, str]) -> tuple[collections.Counter, dict]:
    """(shares of each combination of holders, {cpu: {role: share}}) sampled every ``STEP_S``."""
    spans: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for end, cpu, tid, run in rows:
        spans[cpu].append((end - run, end, "." if tid == -1 else named.get(tid, "o")))
    cpus = sorted(spans)
    t0 = max(spans[c][0][0] for c in cpus)
    t1 = min(spans[c][-1][1] for c in cpus)
    at = {c: 0 for c in cpus}
    combos: collections.Counter[str] = collections.Counter()
    per_cpu: dict[int, collections.Counter[str]] = {c: collections.Counter() for c in cpus}
    n, t = 0, t0
    while t < t1:
        holders = []
        for c in cpus:
            seq = spans[c]
            while at[c] < len(seq) - 1 and seq[at[c]][1] < t:
                at[c] += 1
            start, end, role = seq[at[c]]
            role = role if start <= t <= end else "?"
            holders.append(role.ljust(2))
            per_cpu[c][role] += 1
        combos["".join(holders)] += 1
        n, t = n + 1, t + STEP_S
    return (collections.Counter({k: v / n for k, v in combos.items()}),
            {c: {k: v / n for k, v in per.items()} for c, per in per_cpu.items()})


def record(seconds: float, out: Path) -> None:
    subprocess.run(["perf", "sched", "record", "-o", str(out), "--", "sleep", str(seconds)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(title: str, combos: collections.Counter, per_cpu: dict) -> None:
    print(f"\n== {title}")
    for combo, share in combos.most_common(14):
        print(f"  {combo:10} {100 * share:5.1f} %")
    for cpu, shares in sorted(per_cpu.items()):
        print(f"  core {cpu}: " + ", ".join(f"{role} {100 * s:.1f} %" for role, s in
                                            sorted(shares.items(), key=lambda kv: -kv[1]) if s >= 0.002))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--with-single", action="store_true")
    parser.add_argument("--interval-ms", type=int, default=None,
                        help="the client's stream_interval_ms (1000: the whole completion, as bench's second figure)")
    parser.add_argument("--timeline", type=float, default=0.0, metavar="MS",
                        help="also print who ran on each core, in order, over MS milliseconds of the recording")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("core_occupancy needs perf (Debian: apt-get install linux-perf)")
    import structlog

    from skippy_stage.cli import bench
    from skippy_stage.model.packaged import smollm2_path

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="skippy-occupancy-") as tmp:
        if args.with_single:
            here, there = mp.get_context("spawn").Pipe()
            single = mp.get_context("spawn").Process(target=_single, args=(there, str(smollm2_path()), 2, bench.PROMPT),
                                                     daemon=True)
            single.start()
            try:
                here.send(10_000)  # far more tokens than the recording lasts: the process is killed after it
                here.recv()
                here.send("go")
                time.sleep(0.5)
                start = [thread_cpu(single.pid)]
                record(args.seconds, Path(tmp) / "single.data")
                named = roles([single.pid], None, start, 2)
            finally:
                single.kill()
                single.join()
            report("unsplit model, llama-cpp-python", *occupancy(timehist(Path(tmp) / "single.data"), named))
        (Path(tmp) / "work").mkdir()
        pipeline = bench._Pipeline(smollm2_path(), SPLITS[args.stages], Path(tmp) / "work", str(Path(tmp) / "slices"))
        client = bench.QuietClient()
        try:
            client.generate(pipeline.endpoint, bench.PROMPT, 8)
            figures: dict[str, float] = {}
            tokens = int(args.seconds * 1000 / 5) + 200  # well past the recording at any speed seen
            run = threading.Thread(target=lambda: figures.update(client.generate(pipeline.endpoint, bench.PROMPT, tokens,
                                                                                     args.interval_ms)))
            run.start()
            time.sleep(0.5)
            pids = [p.pid for p in pipeline.local.procs]
            python = python_names(pids) if args.timeline else {}
            start = [thread_cpu(pid) for pid in pids]
            record(args.seconds, Path(tmp) / "pipeline.data")
            named = roles(pids, client._proc.pid, start, pipeline.threads)
            run.join()
        finally:
            client.close()
            pipeline.stop()
        title = f"{args.stages} stage(s), {1e3 / figures['tokens_per_s']:.2f} ms/token (client view)"
        report(title, *occupancy(timehist(Path(tmp) / "pipeline.data"), named))
        if args.timeline:
            timeline(Path(tmp) / "pipeline.data", named, python, args.timeline)


if __name__ == "__main__":
    main()
