#!/usr/bin/env python3
"""Is B faster than A? Single-stream decode of pipeline set-ups, all loaded, in alternating rounds.

    python scripts/ab_decode.py --a '{"native_frames": false}' --b '{}' [--stages 2,3] [--rounds 16]
    python scripts/ab_decode.py --a-env GOMP_SPINCOUNT=2000 --b-env GOMP_SPINCOUNT=1000

A and B differ by stage config fields (JSON, on every stage) and/or the stages' environment
(KEY=VALUE,...). Every set-up of every pipeline size is started once and stays loaded; each round
decodes greedily through ``bench``'s quiet client (its own process, nice 19) on A and on B (B
first in odd rounds) while every other pipeline is frozen (``bench._awake``, as ``bench`` does).
Prints each round, and per size the mean of the per-round ratios A/B (above 1: B faster) with
two standard errors, and how many rounds B won.

The host's noise between minutes is 3-5 %: a set-up measured in one minute and the other in the
next says little, which is why each round times both back to back, and why a result needs 16
rounds or so before its ±2 standard errors are narrower than the 1-2 % effects in question.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import tempfile
from pathlib import Path

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}


def _env(text: str) -> dict[str, str]:
    """KEY=VALUE,KEY=VALUE: a comma starts a new item only before KEY= (values may hold commas)."""
    return dict(item.split("=", 1) for item in re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", text) if item)


def _start(n_stages: int, extra: dict, env: dict[str, str], workdir: Path, cache_dir: str):
    """A pipeline whose stages inherit ``env``."""
    from skippy_stage.cli import bench
    from skippy_stage.model.packaged import smollm2_path

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return bench._Pipeline(smollm2_path(), SPLITS[n_stages], workdir, cache_dir, extra=extra)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mean_2se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], math.nan
    return statistics.fmean(values), 2 * statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="{}", help="A's stage config fields (JSON)")
    parser.add_argument("--b", default="{}", help="B's stage config fields (JSON)")
    parser.add_argument("--a-env", default="", help="A's stage environment, KEY=VALUE,...")
    parser.add_argument("--b-env", default="", help="B's stage environment, KEY=VALUE,...")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    import structlog

    from skippy_stage.cli import bench

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sides = {"A": (json.loads(args.a), _env(args.a_env)), "B": (json.loads(args.b), _env(args.b_env))}
    sizes = [int(n) for n in args.stages.split(",")]
    runs: dict[tuple[int, str], list[float]] = {(n, side): [] for n in sizes for side in sides}
    # The median "frame sent -> compute starts at the next stage" of each measured run (stage histograms).
    hop_us: dict[tuple[int, str], list[float]] = {(n, side): [] for n in sizes for side in sides}
    with tempfile.TemporaryDirectory(prefix="skippy-ab-") as tmp:
        cache_dir = str(Path(tmp) / "slices")
        client = bench.QuietClient()
        pipelines = {}
        try:
            for n in sizes:
                for side, (extra, env) in sides.items():
                    workdir = Path(tmp) / f"{n}-{side}"
                    workdir.mkdir()
                    pipelines[(n, side)] = _start(n, extra, env, workdir, cache_dir)
            for index in range(args.rounds):
                order = ("A", "B") if index % 2 == 0 else ("B", "A")
                for n in sizes:
                    for side in order:
                        pipeline = pipelines[(n, side)]
                        def measure(pipeline=pipeline) -> tuple[dict[str, float], float]:
                            client.generate(pipeline.endpoint, bench.PROMPT, 8)
                            before = [bench._histogram_sums(p) for p in pipeline.metrics_ports]
                            figures = client.generate(pipeline.endpoint, bench.PROMPT, args.tokens + 1)
                            after = [bench._histogram_sums(p) for p in pipeline.metrics_ports]
                            return figures, bench.hop_latency_median_us(before, after)

                        with bench._awake(pipelines.values(), pipeline):
                            figures, hop = bench.after_freeze(measure)
                        runs[(n, side)].append(1e3 / figures["tokens_per_s"])
                        hop_us[(n, side)].append(hop)
                print(f"round {index}: " + ", ".join(f"{n} stages {side} {runs[(n, side)][-1]:.2f}"
                                                     for n in sizes for side in sides), flush=True)
        finally:
            client.close()
            for pipeline in pipelines.values():
                pipeline.stop()
    for n in sizes:
        a, b = runs[(n, "A")], runs[(n, "B")]
        ratios = [x / y for x, y in zip(a, b)]
        mean, two_se = mean_2se(ratios)
        print(f"{n} stages: A {statistics.median(a):.2f} B {statistics.median(b):.2f} ms/token (medians); A/B per "
              f"round {mean:.3f} ± {two_se:.3f} (mean ± 2 s.e.), {sum(r > 1 for r in ratios)} of {len(ratios)} B faster; "
              f"hop latency A {statistics.median(hop_us[(n, 'A')]):.0f} B {statistics.median(hop_us[(n, 'B')]):.0f} us "
              f"(medians of the runs' medians)")


if __name__ == "__main__":
    main()
