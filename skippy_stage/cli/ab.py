"""``skippy-stage ab``: is B faster than A? Single-stream decode of two set-ups, all loaded, in alternating rounds.

    skippy-stage ab --a '{"native_frames": false}' --b '{}' [--stages 2,3] [--rounds 16]
    skippy-stage ab --a-env GOMP_SPINCOUNT=2000 --b-env GOMP_SPINCOUNT=1000

A and B differ by stage config fields (JSON, on every stage) and/or the stages' environment
(KEY=VALUE,...). Every set-up of every pipeline size is started once and stays loaded; each round
decodes greedily through ``bench``'s quiet client (its own process, nice 19) on A and on B (B
first in odd rounds) while every other pipeline is frozen (as ``bench`` does).
Prints each round, and per size the mean of the per-round ratios A/B (above 1: B faster) with
two standard errors, and how many rounds B won.

The host's noise between minutes is 3-5 %: a set-up measured in one minute and the other in the
next says little, which is why each round times both back to back, and why a result needs 16
rounds or so before its ±2 standard errors are narrower than the 1-2 % effects in question.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from skippy_stage.cli.settings import fields_json

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}


def add_ab_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ab`` on the ``skippy-stage`` subcommand parser."""
    p = subparsers.add_parser("ab", help="is B faster than A? two pipeline set-ups decoded in alternating rounds, "
                                         "with the ratio's error",
                              description=__doc__.split("\n\n", 2)[2].replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=fields_json, default="{}", metavar="JSON", help="A's stage config fields")
    p.add_argument("--b", type=fields_json, default="{}", metavar="JSON", help="B's stage config fields")
    p.add_argument("--a-env", type=_env, default="", metavar="KEY=VALUE,...", help="A's stage environment")
    p.add_argument("--b-env", type=_env, default="", metavar="KEY=VALUE,...", help="B's stage environment")
    p.add_argument("--stages", type=_sizes, default="2,3", help="pipeline sizes, of 1, 2 and 3 (default 2,3)")
    p.add_argument("--rounds", type=int, default=16, help="rounds, each timing A and B back to back (default 16)")
    p.add_argument("--tokens", type=int, default=100, help="tokens decoded per generation (default 100)")
    p.set_defaults(func=cmd_ab)
    return p


def _sizes(text: str) -> list[int]:
    sizes = [int(n) for n in text.split(",")]
    if not sizes or any(n not in SPLITS for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: pipeline sizes are 1, 2 or 3")
    return sizes


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
    """(mean, two standard errors) of the per-round ratios; one round has no error (nan)."""
    if len(values) < 2:
        return values[0], math.nan
    return statistics.fmean(values), 2 * statistics.stdev(values) / math.sqrt(len(values))


def cmd_ab(args: argparse.Namespace) -> int:
    from skippy_stage.cli import bench

    sides = {"A": (args.a, args.a_env), "B": (args.b, args.b_env)}
    sizes = args.stages
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
    return 0
