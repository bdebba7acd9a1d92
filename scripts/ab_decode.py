#!/usr/bin/env python3
"""Is B faster than A? Single-stream decode of two pipeline set-ups in interleaved rounds.

    python scripts/ab_decode.py --a '{"native_frames": false}' --b '{}' [--stages 2,3] [--rounds 6]
    python scripts/ab_decode.py --a-env GOMP_SPINCOUNT=2000 --b-env GOMP_SPINCOUNT=300

A and B differ by stage config fields (JSON, on every stage) and/or the stages' environment
(KEY=VALUE,...). Each round starts the packaged SmolLM2 split into local stages once per set-up
and pipeline size, decodes greedily through ``bench``'s quiet client (its own process, nice 19),
and stops them; odd rounds run B first. Prints each round and, per size, the medians and the
median of the per-round ratios A/B (above 1: B faster) with how many rounds B won.

Only ratios within one run mean anything: the host is shared and noisy, and a fixed cost of
20-30 us a token (0.3 %) is below what a handful of rounds can tell apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}


def _env(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def _run(n_stages: int, extra: dict, env: dict[str, str], workdir: Path, cache_dir: str, tokens: int) -> float:
    from skippy_stage.cli import bench
    from skippy_stage.model.packaged import smollm2_path

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the stages inherit it
    client = bench.QuietClient()
    pipeline = bench._Pipeline(smollm2_path(), SPLITS[n_stages], workdir, cache_dir, extra=extra)
    try:
        client.generate(pipeline.endpoint, bench.PROMPT, 8)
        return min(1e3 / client.generate(pipeline.endpoint, bench.PROMPT, tokens + 1)["tokens_per_s"]
                   for _ in range(2))
    finally:
        pipeline.stop()
        client.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="{}", help="A's stage config fields (JSON)")
    parser.add_argument("--b", default="{}", help="B's stage config fields (JSON)")
    parser.add_argument("--a-env", default="", help="A's stage environment, KEY=VALUE,...")
    parser.add_argument("--b-env", default="", help="B's stage environment, KEY=VALUE,...")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sides = {"A": (json.loads(args.a), _env(args.a_env)), "B": (json.loads(args.b), _env(args.b_env))}
    sizes = [int(n) for n in args.stages.split(",")]
    runs: dict[tuple[int, str], list[float]] = {(n, side): [] for n in sizes for side in sides}
    with tempfile.TemporaryDirectory(prefix="skippy-ab-") as tmp:
        cache_dir = str(Path(tmp) / "slices")
        for index in range(args.rounds):
            order = ("A", "B") if index % 2 == 0 else ("B", "A")
            for n in sizes:
                for side in order:
                    workdir = Path(tmp) / f"r{index}-{n}-{side}"
                    workdir.mkdir()
                    runs[(n, side)].append(_run(n, *sides[side], workdir, cache_dir, args.tokens))
            print(f"round {index}: " + ", ".join(f"{n} stages {side} {runs[(n, side)][-1]:.2f}"
                                                 for n in sizes for side in sides), flush=True)
    for n in sizes:
        a, b = runs[(n, "A")], runs[(n, "B")]
        ratios = [x / y for x, y in zip(a, b)]
        print(f"{n} stages: A {statistics.median(a):.2f} B {statistics.median(b):.2f} ms/token; A/B per round "
              f"median {statistics.median(ratios):.3f} ({sum(r > 1 for r in ratios)} of {len(ratios)} B faster)")


if __name__ == "__main__":
    main()
