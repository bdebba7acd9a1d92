"""The proof that a split computes what the unsplit model computes: ``skippy-stage verify``.

Both sides run in this process through the stage runtime the servers use: the split as a
chain of one :class:`StageRuntime` per range, the reference as one runtime over the whole
model. They see the same batches (a prefill, then one token at a time), so llama.cpp's
kernels see the same shapes on both sides; the decode feeds the reference's greedy token
to both (teacher forcing), so every position compares like with like even after a miss.

The reference also taps its residual stream after each boundary layer, so a report says
at which boundary a split stops being exact, not only that the logits differ. Logits are
compared where the pipeline produces them: the last row of each step (the prefill's last
position, then every decoded one). A split is exact when every difference is 0.0 and the
reference computed finite values (NaN on both sides proves nothing): anything else is a
different model, or no proof.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from skippy_stage.errors import ConfigError
from skippy_stage.model.chain import Chain, Step, chain_configs
from skippy_stage.model.runtime import BatchEntry, StageRuntime
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
    logits_max_abs_diff: float
    greedy_agree: int
    greedy_total: int
    reference_finite: bool = True

    @property
    def exact(self) -> bool:
        return (self.reference_finite and self.logits_max_abs_diff == 0.0
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
    info = read_model_info(model)
    ranges = tuple((int(a), int(b)) for a, b in ranges)
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
        boundary_layers = [b for _, b in ranges[:-1]]
        reference = StageRuntime(whole_cfg, tap_layers=[b - 1 for b in boundary_layers])
        try:
            chain = Chain(chain_configs(model, ranges, cache, **settings))
            try:
                return _compare(info, ranges, reference, chain, boundary_layers, tokens, prefill, seed)
            finally:
                chain.close()
        finally:
            reference.close()


def _compare(info: ModelInfo, ranges: tuple[tuple[int, int], ...], reference: StageRuntime, chain: Chain,
             boundary_layers: list[int], tokens: int, prefill: int, seed: int) -> VerifyReport:
    feed = prompt_tokens(reference.n_vocab, prefill, seed)
    start = 0
    hidden_diff = dict.fromkeys(boundary_layers, 0.0)
    logits_diff = 0.0
    agree = 0
    steps = 0
    finite = True
    while start + len(feed) <= tokens:
        positions = np.arange(start, start + len(feed))
        (ref,) = reference.run_batch([BatchEntry(SESSION, positions, token_ids=feed, want_logits=True)])
        tapped = reference.take_taps()
        finite = finite and bool(np.isfinite(ref.logits).all()) and all(np.isfinite(t).all() for t in tapped.values())
        trace: list = []
        (got,) = chain.step([Step(SESSION, start, feed, want_logits=True, sample=False)], trace)
        for layer, stage_results in zip(boundary_layers, trace):
            hidden_diff[layer] = max(hidden_diff[layer], _max_diff(stage_results[0].hidden, tapped[layer - 1]))
        logits_diff = max(logits_diff, _max_diff(got.logits, ref.logits))
        want = int(np.argmax(ref.logits))
        agree += int(int(np.argmax(got.logits)) == want)
        steps += 1
        start += len(feed)
        feed = [want]
    return VerifyReport(
        model=str(info.path), architecture=info.architecture, block_count=info.block_count,
        layers=tuple(ranges), positions=start, prefill=prefill,
        boundaries=tuple(Boundary(b, hidden_diff[b]) for b in boundary_layers),
        logits_max_abs_diff=logits_diff, greedy_agree=agree, greedy_total=steps, reference_finite=finite,
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
    lines.append(f"  logits: max |diff| = {r.logits_max_abs_diff:.6g}")
    lines.append(f"  greedy agreement: {r.greedy_agree}/{r.greedy_total}")
    if not r.reference_finite:
        lines.append("  the unsplit model computes non-finite values here: nothing is proven")
    lines.append("  verdict: " + ("exact" if r.exact else "NOT exact: this split is a different model"))
    return "\n".join(lines)
