"""Speculative decoding on 3 stages: the ngram drafter against no speculation, on a prompt whose
answer quotes it and on a free one."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.pipeline import _Pipeline
from skippy_stage.cli.bench.readings import _scrape
from skippy_stage.cli.bench.workload import DECODE_ROUNDS, QUICK, THREE
from skippy_stage.cli.client import generate

# Speculative decoding: a prompt whose answer quotes it (prompt lookup drafts well) and a free one.
SPEC_PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and watched "
                "the ships pass safely through the narrow strait. In winter the storms came early, and he kept the "
                "fire burning through the night, writing the names of the ships in a worn leather book. When the "
                "keeper grew old, his granddaughter took the lamp, and the book, and the stairs.")
SPEC_PROMPTS = {"repetitive": f"Repeat the following passage exactly.\n\nPassage: {SPEC_PASSAGE}\n\nRepeated passage:",
                "free_form": "Write a short story about a fox who learns to fly. Once upon a time,"}
SPEC_TOKENS = 24 if QUICK else 96


def spec_run(generate: Callable[[str, int, dict[str, object]], dict], head_metrics: int, prompt: str,
             drafter: str) -> tuple[float, float, float, str]:
    """One greedy generation of ``prompt`` with ``drafter`` (``k: "auto"``: adaptive drafting, the
    speed setting; a number k drafts as the reference does, every step up to k rows, which on a CPU
    can cost more than it saves), through ``generate(prompt, max_tokens, speculative)``: ms per
    token after the first, decoded tokens per decode step through the chain and rows per step (the
    head's batches, from its metrics at ``head_metrics``), and the text (empty when ``generate``
    does not return it)."""
    before = _scrape(head_metrics)
    figures = generate(prompt, SPEC_TOKENS, {"drafter": drafter, "k": "auto"})
    after = _scrape(head_metrics)
    steps, rows = (after.get(name, 0.0) - before.get(name, 0.0)
                   for name in ("skippy_batch_entries_count", "skippy_batch_tokens_sum"))
    n = figures["completion_tokens"]
    ms = (figures["seconds"] - figures["ttft_s"]) / max(n - 1, 1) * 1e3
    # the first step is the prompt's prefill: its rows are the prompt's tokens
    prompt_rows = figures["prompt_tokens"]
    decode_steps = max(steps - 1, 1)
    return ms, (n - 1) / decode_steps, (rows - prompt_rows) / decode_steps, str(figures.get("text", ""))


def _speculative(model: Path, workdir: Path, cache_dir: str) -> dict[str, dict[str, object]]:
    """3 stages, greedy, one stream: each prompt without speculation and with the ngram drafter
    (``spec_run``), interleaved in rounds (medians). ``tokens_per_trip``: decoded tokens per decode
    step through the chain; ``ms_per_token``: after the first token."""
    (workdir / "speculative").mkdir()
    pipeline = _Pipeline(model, THREE, workdir / "speculative", cache_dir, kv_unified=False)

    def generate_here(prompt: str, max_tokens: int, speculative: dict[str, object]) -> dict[str, float]:
        return generate(pipeline.endpoint, prompt, max_tokens=max_tokens, temperature=0.0, seed=None, chat=False,
                        out=io.StringIO(), speculative=speculative)

    def one(prompt: str, drafter: str) -> tuple[float, float, float]:
        return spec_run(generate_here, pipeline.metrics_ports[0], prompt, drafter)[:3]

    out: dict[str, dict[str, object]] = {}
    try:
        for name, prompt in SPEC_PROMPTS.items():
            one(prompt, "ngram")  # warm
            runs: dict[str, list[tuple[float, float, float]]] = {"none": [], "ngram": []}
            for _ in range(DECODE_ROUNDS):
                for drafter in runs:
                    runs[drafter].append(one(prompt, drafter))
            figures = {drafter: {"ms_per_token": float(np.median([r[0] for r in rs])),
                                 "tokens_per_trip": float(np.median([r[1] for r in rs])),
                                 "rows_per_trip": float(np.median([r[2] for r in rs])),
                                 "ms_per_trip": float(np.median([r[0] * r[1] for r in rs]))}
                       for drafter, rs in runs.items()}
            # What bounds the speed-up: tokens per trip over what a trip of that many rows costs
            # (every drafted row runs every layer and the output head: on a CPU nearly linear).
            out[name] = {**figures, "speedup": figures["none"]["ms_per_token"] / figures["ngram"]["ms_per_token"],
                         "trip_cost_ratio": figures["ngram"]["ms_per_trip"] / figures["none"]["ms_per_trip"]}
    finally:
        pipeline.stop()
    return out
