"""Native multi-token prediction on 2 stages: the final stage's MTP layers draft one token with
each sample, the head verifies it the next step; against no drafting and the unsplit model.

No model with MTP layers ships on PyPI: without ``bench --mtp-model`` the section runs a
random-weight DeepSeek-2 with one next-n block (``mtp_fixture``) built from the architecture
description in the source checkout's tests, and is skipped, with the reason, outside one.
Random weights draft right about as often as chance: the acceptance of the fixture says
nothing about a trained model's, only what a trip with a draft costs.
"""

from __future__ import annotations

import io
import time
from functools import partial
from pathlib import Path

import numpy as np

import skippy_stage
from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze, stage_threads
from skippy_stage.cli.bench.readings import _scrape
from skippy_stage.cli.bench.repack import _llama_decode_ms
from skippy_stage.cli.bench.workload import DECODE_ROUNDS, QUICK
from skippy_stage.cli.client import generate

MTP_PROMPT = "Hello world, the cat sat on the mat."
MTP_TOKENS = 16 if QUICK else 64
# The architecture descriptions the fixture is built from: in the source checkout, not the wheel.
ARCHS = Path(skippy_stage.__file__).resolve().parent.parent / "tests" / "fixtures" / "archs.jsonl.gz"
FIXTURE_ARCH = "deepseek2-moe"
RANDOM_NOTE = "random weights: acceptance means nothing about a trained model"
_DRAFTED, _ACCEPTED = "skippy_spec_drafted_tokens_total", "skippy_spec_accepted_tokens_total"
_STEPS = "skippy_batch_entries_count"


def mtp_model(workdir: Path, given: str | None) -> tuple[Path | None, str]:
    """The model to measure and what it is: ``given`` (``bench --mtp-model``), else the random
    fixture written to ``workdir``; ``(None, why)`` when there is neither."""
    if given is not None:
        return Path(given), Path(given).name
    if not ARCHS.is_file():
        return None, (f"no model with MTP layers: pass --mtp-model FILE (a GGUF with next-n layers); the "
                      f"random-weight fixture needs the source checkout's {ARCHS.relative_to(ARCHS.parents[2])}")
    from skippy_stage.model import synthetic
    from skippy_stage.model.mtp_fixture import with_nextn

    spec = with_nextn(synthetic.load_specs(ARCHS)[FIXTURE_ARCH])
    return synthetic.write_model(spec, workdir / "mtp-fixture.gguf", seed=42), f"{FIXTURE_ARCH} + 1 next-n block, random weights"


def mtp_ranges(block_count: int) -> list[tuple[int, int]]:
    """Two stages, the blocks split evenly (the last one the larger): the final stage holds the
    next-n block(s), which are a model's last blocks."""
    half = block_count // 2
    return [(0, half), (half, block_count)]


def _mtp_run(pipeline: _Pipeline, drafter: str) -> dict[str, float]:
    """One greedy generation with ``drafter`` (k 1: the one draft MTP returns): ms per token after
    the first, tokens per decode step through the chain, and the drafts the head verified and kept."""
    port = pipeline.metrics_ports[0]
    before = _scrape(port)
    figures = generate(pipeline.endpoint, MTP_PROMPT, max_tokens=MTP_TOKENS, temperature=0.0, seed=None, chat=False,
                       out=io.StringIO(), speculative={"drafter": drafter, "k": 1})
    after = _scrape(port)
    drafted, accepted, steps = (after.get(name, 0.0) - before.get(name, 0.0) for name in (_DRAFTED, _ACCEPTED, _STEPS))
    n = figures["completion_tokens"]
    return {"ms_per_token": (figures["seconds"] - figures["ttft_s"]) / max(n - 1, 1) * 1e3,
            "tokens_per_trip": (n - 1) / max(steps - 1, 1),  # the first step is the prompt's prefill
            "drafted": drafted, "accepted": accepted, "tokens": n}


def _mtp(workdir: Path, cache_dir: str, given: str | None) -> dict[str, object]:
    """2 stages, ``native_mtp_enabled`` on the final one, one lane: greedy generations with the
    ``mtp`` drafter and with none, and the unsplit model in this process (``reference_llama``,
    decode steps after the first token, as the pipeline's figures), in interleaved rounds
    (medians), the pipeline frozen while the reference runs. ``{"skipped": why}`` without a model."""
    from skippy_stage.model.loader import reference_llama
    from skippy_stage.model.slicing import read_model_info

    started = time.perf_counter()
    (workdir / "mtp").mkdir()
    model, name = mtp_model(workdir / "mtp", given)
    if model is None:
        return {"skipped": name}
    fixture = given is None
    ranges = mtp_ranges(read_model_info(model).block_count)
    ctx = 256 if fixture else 2048  # the fixture was "trained" on 256
    threads = stage_threads(len(ranges))
    runs: dict[str, list[dict[str, float]]] = {"mtp": [], "none": []}
    single_ms: list[float] = []
    llm = pipeline = None
    try:
        llm = reference_llama(model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        prompt_tokens = llm.tokenize(MTP_PROMPT.encode())
        pipeline = _Pipeline(model, ranges, workdir / "mtp", cache_dir, extra={"lane_count": 1, "ctx_size": ctx},
                             per_stage=[{}] * (len(ranges) - 1) + [{"native_mtp_enabled": True}])
        for drafter in runs:
            _mtp_run(pipeline, drafter)  # warm
        with _awake([pipeline], None):
            _llama_decode_ms(llm, prompt_tokens, 2)  # warm
        for _ in range(DECODE_ROUNDS):
            with _awake([pipeline], None):
                single_ms.append(_llama_decode_ms(llm, prompt_tokens, MTP_TOKENS - 1))
            with _awake([pipeline], pipeline):
                for drafter in runs:
                    runs[drafter].append(after_freeze(partial(_mtp_run, pipeline, drafter)))
    finally:
        if llm is not None:
            llm.close()
        if pipeline is not None:
            pipeline.stop()
    figures = {drafter: {key: float(np.median([r[key] for r in rs])) for key in ("ms_per_token", "tokens_per_trip")}
               for drafter, rs in runs.items()}
    drafted = sum(r["drafted"] for r in runs["mtp"])
    accepted = sum(r["accepted"] for r in runs["mtp"])
    single = float(np.median(single_ms))
    return {"model": name, "random_weights": fixture, "stages": [list(r) for r in ranges], "tokens": MTP_TOKENS,
            "rounds": DECODE_ROUNDS, "seconds": time.perf_counter() - started, **figures,
            "single_process_ms_per_token": single,
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
            # above 1: the pipeline, or MTP, is the faster
            "ratios": {"mtp_vs_none": figures["none"]["ms_per_token"] / figures["mtp"]["ms_per_token"],
                       "mtp_vs_single_process": single / figures["mtp"]["ms_per_token"],
                       "none_vs_single_process": single / figures["none"]["ms_per_token"]}}
