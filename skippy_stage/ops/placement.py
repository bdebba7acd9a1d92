"""Latency-aware planning: how many stages, on which nodes, in which order.

Pure policy (no grpc, no llama.cpp), on top of the memory split (``plan``). Every candidate (a stage
count from 1 to the number of nodes, and an order of that many nodes) is split by memory as
``plan_stages`` splits it; each one that fits gets an estimated time per output token of one
session's decode, and the lowest wins:

    ms/token = sum over the edges a token crosses of (one-way link latency + HOP_OVERHEAD_MS)
             + sum over the stages of token_ms x (the stage's share of the weights read per token)
                                             / (the node's speed)

A token crosses every edge once: stage i to stage i+1, and the final stage's direct return to the
head (``return_to``), so N stages pay N edges and one stage pays none. Each stage's compute is its
share of the bytes a decode step reads: its layers' weights, and on the final stage the output head
(``output.weight``, or the token embeddings it is tied to). ``token_ms`` is the whole model's decode
time on a node of speed 1 (``--token-ms``); by default it is those bytes read at
:data:`DECODE_GB_PER_S`. Speeds are relative (``--speed gpu=4``); every node's is 1 unless given.

With equal speeds the compute sum is the same for every split, so the fewest stages that fit win at
any latency: splitting one session's decode only pays when it puts layers on a faster node. The
estimate is for one session; concurrent sessions overlap their trips, which this does not model.

Ties (equal estimates) go to fewer stages, then to the order that comes first in the node list.
Up to :data:`MAX_PERMUTED_NODES` nodes every order is tried; past that, each stage count takes the
first nodes in the order given.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skippy_stage.errors import DoesNotFitError, PlanError
from skippy_stage.ops.footprint import ModelFootprint
from skippy_stage.ops.plan import NodeSpec, Plan, plan_stages

if TYPE_CHECKING:
    from skippy_stage.stage.reports import StageReport

# What one edge adds beside the link's own latency: sending, receiving, parsing and checking a
# frame and waking the next stage. ``bench`` measures a hop on one host (loopback, no delay) at
# 83-147 us (docs/performance.md, "hop latency").
HOP_OVERHEAD_MS = 0.1
# Bytes a decode step reads per second on a node of speed 1: SmolLM2-135M Q4_1 reads 92 MiB of
# weights per token and decodes at 9.81 ms/token unsplit on a 2-vCPU AMD EPYC VM
# (docs/performance.md), ~10 GB/s. Give ``--token-ms`` for the nodes at hand.
DECODE_GB_PER_S = 10.0
# Orders tried: every ordered choice of k of N nodes (6 nodes: 1,956 candidates).
MAX_PERMUTED_NODES = 6


@dataclass(frozen=True)
class Links:
    """One-way latencies between nodes, the same both ways: named pairs, measured pairs, and a
    default for every other pair (None: unknown)."""

    default_ms: float | None = None
    given: Mapping[frozenset[str], float] = field(default_factory=dict)
    measured: Mapping[frozenset[str], float] = field(default_factory=dict)

    def one_way_ms(self, a: str, b: str) -> float | None:
        """A pair's latency: as given, else as measured, else the default."""
        pair = frozenset((a, b))
        if pair in self.given:
            return self.given[pair]
        if pair in self.measured:
            return self.measured[pair]
        return self.default_ms

    def describe(self) -> str:
        """The latencies in use, one clause per source."""
        def pairs(found: Mapping[frozenset[str], float]) -> str:
            return ", ".join(f"{'-'.join(sorted(p))} {ms:g} ms" for p, ms in sorted(found.items(), key=_pair_key))
        parts = []
        if self.given:
            parts.append(f"given {pairs(self.given)}")
        measured = {p: ms for p, ms in self.measured.items() if p not in self.given}
        if measured:
            parts.append(f"measured {pairs(measured)} (half the round trip)")
        if self.default_ms is not None:
            parts.append(f"{'every other pair' if parts else 'every pair'} {self.default_ms:g} ms")
        return "; ".join(parts) or "none known"


def _pair_key(item: tuple[frozenset[str], float]) -> list[str]:
    return sorted(item[0])


def parse_links(text: str, nodes: Sequence[NodeSpec]) -> Links:
    """``--link-ms``: ``MS`` for every pair, ``A-B=MS[,C-D=MS...]`` per pair, or both
    (``5,a-b=0.5``). Node names may hold '-': a pair is split where both halves name nodes."""
    names = {n.name for n in nodes}
    default: float | None = None
    given: dict[frozenset[str], float] = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.rpartition("=")
        ms = _milliseconds(value if sep else part, part)
        if not sep:
            if default is not None:
                raise PlanError(f"--link-ms {text!r}: more than one latency for every pair")
            default = ms
            continue
        splits = [(key[:i], key[i + 1:]) for i, ch in enumerate(key) if ch == "-"
                  and key[:i] in names and key[i + 1:] in names and key[:i] != key[i + 1:]]
        if len(splits) != 1:
            why = "names two nodes in more than one way" if splits else f"is not A-B for two of {sorted(names)}"
            raise PlanError(f"--link-ms part {part!r}: {key!r} {why}")
        pair = frozenset(splits[0])
        if pair in given:
            raise PlanError(f"--link-ms names the link {key} twice")
        given[pair] = ms
    return Links(default_ms=default, given=given)


def _milliseconds(value: str, part: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        raise PlanError(f"--link-ms part {part!r}: {value.strip()!r} is not a number of milliseconds") from None
    if not (math.isfinite(ms) and ms >= 0):
        raise PlanError(f"--link-ms part {part!r}: a latency must be a number of milliseconds >= 0")
    return ms


def measured_links(reports: Iterable[StageReport]) -> dict[frozenset[str], float]:
    """One-way latencies from running stages' reports (``GetStatus``): half of each measured round
    trip, to a stage's downstream and from a final stage back to the head (the stage of index 0
    among ``reports``), by stage_id. A pair measured from both ends gets the mean."""
    reports = list(reports)
    head = next((r.stage_id for r in reports if r.stage_index == 0), None)
    found: dict[frozenset[str], list[float]] = {}
    for r in reports:
        if r.downstream_rtt_samples and r.downstream_stage_id and r.downstream_stage_id != r.stage_id:
            found.setdefault(frozenset((r.stage_id, r.downstream_stage_id)), []).append(r.downstream_rtt_us / 2e3)
        if r.return_rtt_samples and head is not None and head != r.stage_id:
            found.setdefault(frozenset((r.stage_id, head)), []).append(r.return_rtt_us / 2e3)
    return {pair: sum(ms) / len(ms) for pair, ms in found.items()}


def parse_speeds(text: str, nodes: Sequence[NodeSpec]) -> dict[str, float]:
    """``--speed NAME=FACTOR[,...]``: relative decode speed (1 for every node not named)."""
    names = [n.name for n in nodes]
    speeds = dict.fromkeys(names, 1.0)
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in speeds:
            raise PlanError(f"--speed part {part!r} must be NAME=FACTOR for one of {names}")
        try:
            factor = float(value)
        except ValueError:
            raise PlanError(f"--speed part {part!r}: {value.strip()!r} is not a number") from None
        if not (math.isfinite(factor) and factor > 0):
            raise PlanError(f"--speed part {part!r}: a speed must be > 0")
        speeds[name.strip()] = factor
    return speeds


def decode_bytes(model: ModelFootprint) -> int:
    """Weight bytes one decode step reads: every layer, and the output head (``output.weight``, or
    the token embeddings when they are tied to it: then the shared tensors)."""
    return sum(model.layer_weight_bytes) + _head_bytes(model)


def _head_bytes(model: ModelFootprint) -> int:
    return model.output_bytes or model.shared_bytes


def default_token_ms(model: ModelFootprint) -> float:
    """The whole model's decode time per token on a node of speed 1, if unmeasured."""
    return decode_bytes(model) / (DECODE_GB_PER_S * 1e9) * 1e3


@dataclass(frozen=True)
class Estimate:
    """One candidate's estimated time per output token, by part (milliseconds)."""

    links_ms: float  # the edges' one-way latencies
    hops_ms: float  # HOP_OVERHEAD_MS per edge
    compute_ms: float  # every stage's compute

    @property
    def total_ms(self) -> float:
        return self.links_ms + self.hops_ms + self.compute_ms


@dataclass(frozen=True)
class Candidate:
    """An order of nodes, its memory split (None: it does not fit) and its estimate (None: it
    cannot be had; ``reason`` says why)."""

    order: tuple[str, ...]
    plan: Plan | None
    estimate: Estimate | None
    reason: str = ""

    @property
    def feasible(self) -> bool:
        return self.estimate is not None


@dataclass(frozen=True)
class Placement:
    """Every candidate, best first (those that cannot be had last), and the one chosen."""

    candidates: tuple[Candidate, ...]
    links: Links
    speeds: Mapping[str, float]
    token_ms: float
    hop_overhead_ms: float
    every_order: bool  # False past MAX_PERMUTED_NODES: the first k nodes only

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def plan(self) -> Plan:
        plan = self.chosen.plan
        assert plan is not None  # choose_placement refuses when nothing fits
        return plan

    def format_table(self) -> str:
        lines = [
            f"estimated ms per output token of one session's decode: for every edge a token crosses (the final "
            f"stage's return to the head included) its one-way latency + {self.hop_overhead_ms:g} ms;",
            f"plus each stage's share of {self.token_ms:.2f} ms/token (the whole model at speed 1) over its "
            f"node's speed",
            f"links (one-way): {self.links.describe()}",
        ]
        faster = {name: f for name, f in self.speeds.items() if f != 1}
        if faster:
            lines.append("speeds: " + ", ".join(f"{name} {f:g}" for name, f in faster.items()) + "; every other 1")
        if not self.every_order:
            lines.append(f"more than {MAX_PERMUTED_NODES} nodes: each stage count takes the first nodes in the "
                         f"order given")
        rows = []
        for c in self.candidates:
            layers = " ".join(f"{s.layer_start}:{s.layer_end}" for s in c.plan.stages) if c.plan else "-"
            if c.estimate is None:
                rows.append((str(len(c.order)), " > ".join(c.order), layers, "", "", "", "-", c.reason))
            else:
                e = c.estimate
                rows.append((str(len(c.order)), " > ".join(c.order), layers, f"{e.links_ms:.2f}",
                             f"{e.hops_ms:.2f}", f"{e.compute_ms:.2f}", f"{e.total_ms:.2f}",
                             "<- chosen" if c is self.chosen else ""))
        head = ("stages", "order", "layers", "links ms", "hops ms", "compute ms", "ms/token", "")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head) - 1)]
        left = {1, 2}  # order and layers read left to right; numbers align right
        for row in (head, *rows):
            cells = [cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
            lines.append(("  ".join(cells) + "  " + row[-1]).rstrip())
        return "\n".join(lines)


def estimate(plan: Plan, links: Links, speeds: Mapping[str, float], token_ms: float,
             hop_overhead_ms: float = HOP_OVERHEAD_MS) -> Estimate | str:
    """``plan``'s estimated time per output token, or why it has none (a link of unknown latency)."""
    order = [s.node for s in plan.stages]
    edges = list(zip(order, order[1:] + order[:1])) if len(order) > 1 else []
    links_ms = 0.0
    for a, b in edges:
        ms = links.one_way_ms(a, b)
        if ms is None:
            return f"no latency for the link {a}-{b}"
        links_ms += ms
    model = plan.model
    per_byte = token_ms / decode_bytes(model)
    compute_ms = 0.0
    for j, stage in enumerate(plan.stages):
        work = sum(model.layer_weight_bytes[stage.layer_start:stage.layer_end])
        work += _head_bytes(model) if j == len(plan.stages) - 1 else 0
        compute_ms += work * per_byte / speeds.get(stage.node, 1.0)
    return Estimate(links_ms=links_ms, hops_ms=len(edges) * hop_overhead_ms, compute_ms=compute_ms)


def choose_placement(model: ModelFootprint, nodes: Sequence[NodeSpec], links: Links, *,
                     speeds: Mapping[str, float] | None = None, token_ms: float | None = None,
                     hop_overhead_ms: float = HOP_OVERHEAD_MS, **plan_kwargs: Any) -> Placement:
    """Every candidate over ``nodes``, estimated; refused (DoesNotFitError) when none can be had.
    ``plan_kwargs`` as :func:`~skippy_stage.ops.plan.plan_stages` (ctx_size, lanes, ...)."""
    if token_ms is None:
        token_ms = default_token_ms(model)
    if not (math.isfinite(token_ms) and token_ms >= 0):
        raise PlanError(f"token_ms {token_ms!r} must be a number of milliseconds >= 0")
    if not (math.isfinite(hop_overhead_ms) and hop_overhead_ms >= 0):
        raise PlanError(f"hop overhead {hop_overhead_ms!r} ms must be >= 0")
    speeds = dict(speeds or {})
    every_order = len(nodes) <= MAX_PERMUTED_NODES
    orders = itertools.chain.from_iterable(
        itertools.permutations(nodes, k) if every_order else [tuple(nodes[:k])] for k in range(1, len(nodes) + 1))
    ranked: list[tuple[float, int, int, Candidate]] = []
    refused: list[Candidate] = []
    for index, order in enumerate(orders):
        names = tuple(n.name for n in order)
        try:
            plan = plan_stages(model, list(order), **plan_kwargs)
        except DoesNotFitError as exc:
            refused.append(Candidate(names, None, None, f"does not fit: {exc.brief}"))
            continue
        found = estimate(plan, links, speeds, token_ms, hop_overhead_ms)
        if isinstance(found, str):
            refused.append(Candidate(names, plan, None, found))
            continue
        # Equal estimates (to a nanosecond, against float noise) go to fewer stages, then the node list's order.
        ranked.append((round(found.total_ms, 6), len(names), index, Candidate(names, plan, found)))
    if not ranked:
        reasons = [f"{' > '.join(c.order)}: {c.reason}" for c in reversed(refused)]  # the most stages first
        more = f"; and {len(reasons) - 6} more" if len(reasons) > 6 else ""
        raise DoesNotFitError(f"none of the {len(reasons)} candidates over these nodes can be had: "
                              + "; ".join(reasons[:6]) + more, brief="no candidate can be had")
    ranked.sort(key=lambda r: r[:3])
    return Placement(candidates=tuple(r[3] for r in ranked) + tuple(refused), links=links, speeds=speeds,
                     token_ms=token_ms, hop_overhead_ms=hop_overhead_ms, every_order=every_order)
