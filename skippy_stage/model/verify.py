"""The proof that a split computes what the unsplit model computes: ``skippy-stage verify``.

The split runs in this process through the stage runtime the servers use: a chain of one
:class:`StageRuntime` per range. It is held to two unsplit references on the same tokens:

* **llama-cpp-python** (``Llama(logits_all=True)`` loaded as stages load,
  :func:`loader.reference_llama_like`): independent of this project's runtime, and with no
  eval callback. This is the reference an exact split must equal.
* **the project's own runtime over the whole model**, tapping its residual stream after
  each boundary layer, so a report says at which boundary a split stops being exact, not
  only that the logits differ.

All three see the same batches (a prefill, then one token at a time, each one
``llama_decode``) with every row an output (``logits_all``; the split's final stage asks for
``all_rows``), so llama.cpp's kernels see the same shapes everywhere: kernels differ between
one-row and larger batches on some CPUs. The decode feeds llama-cpp-python's greedy token to
every side (teacher forcing), so every position compares like with like even after a miss.
Logits are compared where the pipeline produces them: the last row of each step (the
prefill's last position, then every decoded one). A split is exact when every difference is
0.0 and the references computed finite values (NaN on both sides proves nothing): anything
else is a different model, or no proof.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import loader
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.chain import Chain, Step, chain_configs
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.slicing import ModelInfo, proving, read_model_info

SESSION = "verify"


@dataclass(frozen=True)
class Boundary:
    layer: int  # the first layer of the stage that receives this hidden state
    max_abs_diff: float


@dataclass(frozen=True)
class VerifyReport:
    model: str
    architecture: str
    block_count: int
    layers: tuple[tuple[int, int], ...]
    positions: int
    prefill: int
    boundaries: tuple[Boundary, ...]
    logits_max_abs_diff: float  # vs the project's own runtime on the whole model
    independent_max_abs_diff: float  # vs llama-cpp-python's Llama on the whole model
    greedy_agree: int
    greedy_total: int
    reference_finite: bool = True

    @property
    def exact(self) -> bool:
        return (self.reference_finite and self.logits_max_abs_diff == 0.0 and self.independent_max_abs_diff == 0.0
                and all(b.max_abs_diff == 0.0 for b in self.boundaries) and self.greedy_agree == self.greedy_total)

    @property
    def split(self) -> str:
        return "/".join(f"{a}:{b}" for a, b in self.layers)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["layers"] = self.split
        out["exact"] = self.exact
        return out


def parse_split(text: str) -> tuple[tuple[int, int], ...]:
    """``"0:2,2:3,3:6"`` → ranges; refuses anything that is not a list of ``A:B``."""
    ranges = []
    for part in text.replace("/", ",").split(","):
        a, sep, b = part.strip().partition(":")
        if not sep or not a.isdigit() or not b.isdigit():
            raise ConfigError(f"--layers: {part!r} is not A:B (give ranges like 0:10,10:20,20:30)")
        ranges.append((int(a), int(b)))
    return tuple(ranges)


def check_split(ranges: Sequence[tuple[int, int]], block_count: int) -> None:
    if len(ranges) < 2:
        raise ConfigError("--layers: a split needs at least two ranges")
    if ranges[0][0] != 0 or ranges[-1][1] != block_count:
        raise ConfigError(f"--layers: ranges must run from 0 to the model's {block_count} blocks, got "
                          f"{ranges[0][0]}..{ranges[-1][1]}")
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        if b != c:
            raise ConfigError(f"--layers: {a}:{b} is followed by a range starting at {c}; ranges must be contiguous")
    for a, b in ranges:
        if b <= a:
            raise ConfigError(f"--layers: {a}:{b} is empty")


def prompt_tokens(n_vocab: int, count: int, seed: int) -> list[int]:
    """Token ids drawn from the whole vocabulary: no tokenizer needed, any model takes them."""
    return np.random.default_rng(seed).integers(0, n_vocab, size=count).tolist()


def verify(model: str | Path, ranges: Sequence[tuple[int, int]], *, tokens: int = 8, seed: int = 0,
           cache_dir: str | Path | None = None, n_threads: int | None = None) -> VerifyReport:
    """Run ``ranges`` of ``model`` against the whole model on ``tokens`` positions.

    The first half of the positions is one prefill batch, the rest decode one by one.
    """
    (report,) = verify_splits(model, [ranges], tokens=tokens, seed=seed, cache_dir=cache_dir, n_threads=n_threads)
    return report


def verify_splits(model: str | Path, splits: Sequence[Sequence[tuple[int, int]]], *, tokens: int = 8, seed: int = 0,
                  cache_dir: str | Path | None = None, n_threads: int | None = None) -> list[VerifyReport]:
    """:func:`verify` for several splits of one model: the unsplit references load and run once."""
    info = read_model_info(model)
    splits = [tuple((int(a), int(b)) for a, b in ranges) for ranges in splits]
    for ranges in splits:
        check_split(ranges, info.block_count)
    if tokens < 2:
        raise ConfigError(f"--tokens={tokens}: at least 2 positions (one prefill, one decode)")
    prefill = max(1, tokens // 2)
    settings: dict[str, object] = dict(ctx_size=max(64, tokens + 8), lane_count=1, n_batch=max(64, prefill),
                                       n_ubatch=max(64, prefill))
    if n_threads is not None:
        settings["n_threads"] = n_threads
    with tempfile.TemporaryDirectory(prefix="skippy-verify-") as scratch, proving():
        cache = Path(cache_dir) if cache_dir is not None else Path(scratch)
        (whole_cfg,) = chain_configs(model, [(0, info.block_count)], cache, **settings)
        taps = sorted({b - 1 for ranges in splits for _, b in ranges[:-1]})
        unsplit = _run_unsplit(whole_cfg, taps, prefill, seed, tokens)
        reports = []
        for ranges in splits:
            chain = Chain(chain_configs(model, ranges, cache, **settings))
            try:
                reports.append(_compare(info, ranges, unsplit, chain))
            finally:
                chain.close()
        return reports


@dataclass
class _Unsplit:
    """What the whole model computes, step by step: the feeds, and each step's last row."""

    feeds: list[list[int]]
    logits: list[np.ndarray]  # the project's own runtime
    independent: list[np.ndarray]  # llama-cpp-python's Llama
    taps: list[dict[int, np.ndarray]]  # the own runtime's residual stream after the tapped layers
    finite: bool


def _run_unsplit(cfg: StageConfig, tap_layers: list[int], prefill: int, seed: int, tokens: int) -> _Unsplit:
    """Both references on the same batches: ``prefill`` tokens in one, then greedy tokens one by one."""
    runtime = StageRuntime(cfg, tap_layers=tap_layers)
    try:
        prompt = prompt_tokens(runtime.n_vocab, prefill, seed)
        llm = loader.reference_llama_like(cfg)
        try:
            out = _Unsplit([], [], [], [], True)
            feed, start = prompt, 0
            while start + len(feed) <= tokens:
                positions = np.arange(start, start + len(feed))
                (own,) = runtime.run_batch([BatchEntry(SESSION, positions, token_ids=feed, want_logits=True,
                                                       all_rows=True)])
                tapped = runtime.take_taps()
                llm.eval(feed)  # one llama_decode (len(feed) <= n_batch), every row an output
                independent = np.array(llm.scores[start + len(feed) - 1], dtype=np.float32)
                out.finite = (out.finite and bool(np.isfinite(own.logits).all()) and bool(np.isfinite(independent).all())
                              and all(np.isfinite(t).all() for t in tapped.values()))
                out.feeds.append(list(feed))
                out.logits.append(own.logits)
                out.independent.append(independent)
                out.taps.append(tapped)
                start += len(feed)
                feed = [int(np.argmax(independent))]
            return out
        finally:
            llm.close()
    finally:
        runtime.close()


def _compare(info: ModelInfo, ranges: tuple[tuple[int, int], ...], unsplit: _Unsplit, chain: Chain) -> VerifyReport:
    boundary_layers = [b for _, b in ranges[:-1]]
    hidden_diff = dict.fromkeys(boundary_layers, 0.0)
    logits_diff = independent_diff = 0.0
    agree = 0
    start = 0
    for feed, own, independent, tapped in zip(unsplit.feeds, unsplit.logits, unsplit.independent, unsplit.taps):
        trace: list = []
        (got,) = chain.step([Step(SESSION, start, feed, want_logits=True, sample=False, all_rows=True)], trace)
        for layer, stage_results in zip(boundary_layers, trace):
            hidden_diff[layer] = max(hidden_diff[layer], _max_diff(stage_results[0].hidden, tapped[layer - 1]))
        logits_diff = max(logits_diff, _max_diff(got.logits, own))
        independent_diff = max(independent_diff, _max_diff(got.logits, independent))
        agree += int(int(np.argmax(got.logits)) == int(np.argmax(independent)))
        start += len(feed)
    return VerifyReport(
        model=str(info.path), architecture=info.architecture, block_count=info.block_count,
        layers=tuple(ranges), positions=start, prefill=len(unsplit.feeds[0]),
        boundaries=tuple(Boundary(b, hidden_diff[b]) for b in boundary_layers),
        logits_max_abs_diff=logits_diff, independent_max_abs_diff=independent_diff, greedy_agree=agree,
        greedy_total=len(unsplit.feeds), reference_finite=unsplit.finite,
    )


def _max_diff(a: np.ndarray | None, b: np.ndarray | None) -> float:
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    # NaN on both sides at the same place is the same computation; NaN on one side is not.
    same_nan = np.isnan(a) & np.isnan(b)
    d[same_nan] = 0.0
    if np.isnan(d).any():
        return float("inf")
    return float(d.max()) if d.size else 0.0


def format_report(r: VerifyReport) -> str:
    lines = [f"{r.architecture} ({r.block_count} blocks) {r.model}",
             f"split {r.split}: {r.positions} positions ({r.prefill} prefill, {r.positions - r.prefill} decode)"]
    for b in r.boundaries:
        lines.append(f"  boundary at layer {b.layer}: max |hidden diff| = {b.max_abs_diff:.6g}")
    lines.append(f"  logits: max |diff| = {r.independent_max_abs_diff:.6g} vs llama-cpp-python on the whole model, "
                 f"{r.logits_max_abs_diff:.6g} vs this project's runtime on it")
    lines.append(f"  greedy agreement: {r.greedy_agree}/{r.greedy_total}")
    if not r.reference_finite:
        lines.append("  the unsplit model computes non-finite values here: nothing is proven")
    lines.append("  verdict: " + ("exact" if r.exact else "NOT exact: this split is a different model"))
    return "\n".join(lines)
