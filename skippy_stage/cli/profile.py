"""``skippy-stage profile``: where a token's time goes on its way through a pipeline, step by step.

    skippy-stage profile [--stages 1|2|3] [--tokens 128] [--rounds 3] [--fields '{"n_threads": 1}']

Starts the packaged SmolLM2 split into local ``serve`` processes (as ``skippy-stage bench``
does) with ``SKIPPY_TRACE_DIR`` set, so every stage marks fixed points of its frame path
(``skippy_stage/tracing.py``), decodes greedily, stops the pipeline and lines the stages'
marks up on the host's clock. One decode token is the span from one head step (``S0:proc``)
to the next; the table prints the median of each step between two consecutive marks over the
tokens whose marks came in the most common order, with llama_decode's share and the rest
(the Python around it, serialisation, sockets, wake-ups) summed at the end.

Only medians of one run mean anything: the host is shared and noisy.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from skippy_stage.cli.settings import fields_json
from skippy_stage.errors import SkippyError

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``profile`` on the ``skippy-stage`` subcommand parser."""
    p = subparsers.add_parser("profile", help="follow single tokens through local stage processes: the median "
                                              "time of every step of their path",
                              description=__doc__.split("\n\n", 2)[2].replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=3, choices=sorted(SPLITS), help="pipeline size (default 3)")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per round (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="greedy generations traced (default 3)")
    p.add_argument("--fields", type=fields_json, default="{}", metavar="JSON",
                   help="stage config fields for every stage, e.g. '{\"n_threads\": 1}'")
    p.set_defaults(func=cmd_profile)
    return p


def read_marks(trace_dir: Path) -> list[tuple[int, str]]:
    """(host clock ns, ``S<stage>:<mark>``) of every stage's trace file, in time order."""
    marks = []
    for path in trace_dir.glob("*.trace"):
        stage = path.name.split(".")[0].removeprefix("stage")
        for line in path.read_text().splitlines():
            name, t = line.split()
            marks.append((int(t), f"S{stage}:{name}"))
    marks.sort()
    return marks


def breakdown(marks: list[tuple[int, str]]) -> tuple[int, int, list[tuple[str, str, float]]]:
    """(tokens in the table, tokens seen, [(from, to, median us)]) for the most common path."""
    starts = [i for i, (_, name) in enumerate(marks) if name == "S0:proc"]
    paths: collections.Counter[tuple[str, ...]] = collections.Counter()
    steps: dict[tuple[str, ...], list[list[float]]] = collections.defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        span = marks[a : b + 1]
        names = tuple(name for _, name in span)
        paths[names] += 1
        steps[names].append([(t2 - t1) / 1e3 for (t1, _), (t2, _) in zip(span, span[1:])])
    if not paths:
        raise SkippyError("no head steps were traced")
    names, count = paths.most_common(1)[0]
    columns = list(zip(*steps[names]))
    return count, sum(paths.values()), [(n1, n2, statistics.median(col))
                                        for n1, n2, col in zip(names, names[1:], columns)]


def cmd_profile(args: argparse.Namespace) -> int:
    from skippy_stage.cli import bench
    from skippy_stage.model.packaged import smollm2_path

    with tempfile.TemporaryDirectory(prefix="skippy-trace-") as tmp:
        trace_dir = Path(tmp) / "trace"
        trace_dir.mkdir()
        (Path(tmp) / "work").mkdir()
        saved = os.environ.get("SKIPPY_TRACE_DIR")
        os.environ["SKIPPY_TRACE_DIR"] = str(trace_dir)  # the stages inherit it (this process is not traced)
        try:
            pipeline = bench._Pipeline(smollm2_path(), SPLITS[args.stages], Path(tmp) / "work",
                                       str(Path(tmp) / "slices"), extra=args.fields)
        finally:
            if saved is None:
                del os.environ["SKIPPY_TRACE_DIR"]
            else:
                os.environ["SKIPPY_TRACE_DIR"] = saved
        try:
            pipeline.generate(bench.PROMPT, 8)
            for _ in range(args.rounds):
                figures = pipeline.generate(bench.PROMPT, args.tokens + 1)
                print(f"decode {1e3 / figures['tokens_per_s']:.2f} ms/token (client view)", flush=True)
        finally:
            pipeline.stop()
        count, seen, table = breakdown(read_marks(trace_dir))
    print(f"\n{count} of {seen} tokens took the most common path; medians in us:")
    total = decode = 0.0
    inside = None  # the stage whose llama_decode is under way: from its d0 to its d1
    for n1, n2, us in table:
        total += us
        if n1.endswith(":d0"):
            inside = n1.split(":")[0]
        if inside is not None:
            decode += us
            if n2 == f"{inside}:d1":
                inside = None
        print(f"  {n1:>10} -> {n2:<10} {us:8.0f}")
    # Another stage's marks inside a decode (its Python after a send, on the cores the decode
    # uses) count towards that decode: they are what its wall time held.
    print(f"  sum {total:.0f}: llama_decode {decode:.0f}, the rest {total - decode:.0f}")
    return 0
