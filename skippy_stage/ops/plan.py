"""Stage planning: which node runs which layer range, by memory.

Pure policy (no grpc, no llama.cpp): the inputs are a model's footprint (``footprint``),
the nodes' memory budgets, and the KV settings; the output is a :class:`Plan`.

Context is counted **per lane**: ``--ctx-size 4096 --lanes 8`` means every session may hold
4096 tokens at once, so the stage config gets ``ctx_size = 4096 x 8`` cells and the KV cache
grows linearly with both numbers. Each lane has its share of its own (``kv_unified: false``, the
stage default); with ``kv_unified: true`` the lanes share the pool, so one session may also use
more than its share while others are idle. A fixed
overhead per node (runtime, compute buffers, Python) is charged too, 512 MiB by default.

Layer ranges are contiguous and follow the node order (node 0 is the head). The split
minimises the largest share of any node's free room (budget less its fixed costs) that its
layers take; nodes are then filled greedily in order up to that share, so a node with twice
the room gets about twice the layers. A model that does not fit is refused with a
:class:`DoesNotFitError` that says by how much.

A stage's weights depend on its quantization (``checkpoint_quantization``): each node may be
given its own footprint (the model at that node's type). :func:`plan_quantized` picks, per node,
the highest precision of a ladder that still admits a split: every node starts at the top, the node
whose step down relieves the split most steps down until one fits, then each node steps back up
while the split still fits.

Which nodes to use, and in which order, when the links between them cost time: ``placement``.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy_stage.errors import DoesNotFitError, PlanError
from skippy_stage.ops.footprint import GIB, MIB, ModelFootprint, format_bytes, kv_bytes_per_layer, read_footprint

DEFAULT_OVERHEAD_MIB = 512


# A node name becomes a stage_id, a hostname in endpoints, a Compose service and a
# Kubernetes Service name, so it must be an RFC 1035 label.
_NODE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class NodeSpec:
    """One machine (or GPU) that will run one stage, with its memory budget."""

    name: str
    mem_gib: float

    @property
    def budget_bytes(self) -> int:
        return int(self.mem_gib * GIB)


@dataclass(frozen=True)
class StagePlan:
    """One node's share: a layer range and what it costs against the node's budget."""

    node: str
    layer_start: int
    layer_end: int
    weight_bytes: int  # every tensor in the stage file, shared ones included
    kv_bytes: int
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int
    quantization: str = "preserve"  # the stage's checkpoint_quantization

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes


@dataclass(frozen=True)
class Plan:
    """The split of one model over ordered nodes; stage 0 is the head."""

    model: ModelFootprint
    stages: tuple[StagePlan, ...]
    ctx_size: int  # tokens per lane
    lanes: int
    cache_type: str
    overhead_bytes: int

    @property
    def kv_cells(self) -> int:
        """The stage config's ctx_size: the cell pool the lanes share."""
        return self.ctx_size * self.lanes

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.stages)

    @property
    def quantized(self) -> bool:
        """Whether some stage quantizes its slice (the configs then name every stage's type)."""
        return any(s.quantization != "preserve" for s in self.stages)

    def format_table(self) -> str:
        head = (
            f"{self.model.path.name} ({self.model.architecture}, {self.model.block_count} layers): "
            f"ctx {self.ctx_size}/lane x {self.lanes} lanes, KV cache {self.cache_type}, "
            f"overhead {self.overhead_bytes / MIB:.0f} MiB/node"
        )
        width = max(4, *(len(s.node) for s in self.stages))
        quantized = self.quantized
        cols = f"{'node':<{width}}  {'layers':>7}  " + (f"{'quant':>8}  " if quantized else "") + \
               f"{'weights MiB':>11}  {'KV MiB':>8}  {'overhead MiB':>12}  {'total MiB':>9}  {'budget MiB':>10}  " \
               f"{'used':>5}"
        lines = [head, cols]
        for s in self.stages:
            lines.append(
                f"{s.node:<{width}}  {f'{s.layer_start}:{s.layer_end}':>7}  "
                + (f"{s.quantization:>8}  " if quantized else "")
                + f"{s.weight_bytes / MIB:>11.1f}  "
                f"{s.kv_bytes / MIB:>8.1f}  {s.overhead_bytes / MIB:>12.1f}  {s.total_bytes / MIB:>9.1f}  "
                f"{s.budget_bytes / MIB:>10.1f}  {100 * s.total_bytes / s.budget_bytes:>4.0f}%"
            )
        budget = sum(s.budget_bytes for s in self.stages)
        weights = sum(s.weight_bytes for s in self.stages)
        kv = sum(s.kv_bytes for s in self.stages)
        overhead = sum(s.overhead_bytes for s in self.stages)
        lines.append(
            f"{'all':<{width}}  {f'0:{self.model.block_count}':>7}  " + (f"{'':>8}  " if quantized else "")
            + f"{weights / MIB:>11.1f}  {kv / MIB:>8.1f}  "
            f"{overhead / MIB:>12.1f}  {self.total_bytes / MIB:>9.1f}  {budget / MIB:>10.1f}  "
            f"{100 * self.total_bytes / budget:>4.0f}%"
        )
        return "\n".join(lines)


def parse_nodes(text: str) -> list[NodeSpec]:
    """``NAME=MEM_GIB[,NAME=MEM_GIB...]`` in pipeline order (the first node is the head)."""
    nodes: list[NodeSpec] = []
    for part in text.split(","):
        name, sep, mem = part.strip().partition("=")
        name = name.strip()
        if not sep:
            raise PlanError(f"--nodes part {part!r} must be NAME=MEM_GIB")
        try:
            mem_gib = float(mem)
        except ValueError:
            raise PlanError(f"--nodes part {part!r}: memory {mem.strip()!r} is not a number of GiB") from None
        nodes.append(NodeSpec(name=name, mem_gib=mem_gib))
    _check_nodes(nodes)
    return nodes


def _check_nodes(nodes: list[NodeSpec]) -> None:
    if not nodes:
        raise PlanError("no nodes given")
    seen: set[str] = set()
    for node in nodes:
        if not _NODE_NAME.match(node.name):
            raise PlanError(
                f"node name {node.name!r} must be a lowercase DNS label (a-z, 0-9, '-', starting with a letter, "
                f"at most 63 characters): it becomes the stage_id, the hostname and the Service name"
            )
        if node.name in seen:
            raise PlanError(f"node name {node.name!r} appears twice")
        seen.add(node.name)
        if not node.mem_gib > 0:
            raise PlanError(f"node {node.name}: memory {node.mem_gib!r} GiB must be > 0")


def plan_stages(
    model: ModelFootprint,
    nodes: list[NodeSpec],
    *,
    ctx_size: int = 4096,
    lanes: int = 4,
    cache_type: str = "f16",
    overhead_mib: float = DEFAULT_OVERHEAD_MIB,
    models: list[ModelFootprint] | None = None,
) -> Plan:
    """Split ``model`` into contiguous layer ranges over ``nodes`` (in order), or refuse.

    ``models``, one per node, are the model's footprint at each node's quantization (default: ``model``
    on every node).
    """
    _check_nodes(nodes)
    if overhead_mib < 0:
        raise PlanError(f"overhead {overhead_mib!r} MiB must be >= 0")
    n_layers, n_nodes = model.block_count, len(nodes)
    if n_nodes > n_layers:
        raise DoesNotFitError(f"{n_nodes} nodes for {n_layers} layers: every node needs at least one layer",
                              brief=f"{n_nodes} stages for {n_layers} layers")
    per_node = [model] * n_nodes if models is None else list(models)
    if len(per_node) != n_nodes:
        raise PlanError(f"{len(per_node)} footprints for {n_nodes} nodes")
    kv = kv_bytes_per_layer(model, ctx_size, lanes, cache_type)
    overhead = int(overhead_mib * MIB)
    layer_costs = [[w + k for w, k in zip(m.layer_weight_bytes, kv)] for m in per_node]
    prefixes = [_prefix(c) for c in layer_costs]
    fixed = [overhead + m.fixed_bytes(j == 0, j == n_nodes - 1) for j, m in enumerate(per_node)]
    budgets = [node.budget_bytes for node in nodes]
    room = [b - f for b, f in zip(budgets, fixed)]

    _refuse_if_short(model, nodes, budgets, fixed, room, layer_costs, kv, overhead)
    share, ranges = _best_split(prefixes, room)
    if share > 1:
        over = max((prefixes[j][e] - prefixes[j][s] - r, nodes[j].name)
                   for j, ((s, e), r) in enumerate(zip(ranges, room)))
        raise DoesNotFitError(
            f"model {model.path.name} does not fit these nodes in contiguous layer ranges: the closest split "
            f"({', '.join(f'{nd.name}={s}:{e}' for nd, (s, e) in zip(nodes, ranges))}) still overcommits node "
            f"{over[1]} by {format_bytes(over[0])}",
            brief=f"no whole-layer split fits: node {over[1]} over by {format_bytes(over[0])}",
        )
    stages = []
    for j, (node, (s, e)) in enumerate(zip(nodes, ranges)):
        m = per_node[j]
        weights = sum(m.layer_weight_bytes[s:e]) + m.fixed_bytes(j == 0, j == n_nodes - 1)
        kv_stage = sum(kv[s:e])
        stages.append(StagePlan(
            node=node.name, layer_start=s, layer_end=e, weight_bytes=weights, kv_bytes=kv_stage,
            overhead_bytes=overhead, total_bytes=weights + kv_stage + overhead, budget_bytes=budgets[j],
            quantization=m.quantization,
        ))
    return Plan(model=model, stages=tuple(stages), ctx_size=ctx_size, lanes=lanes, cache_type=cache_type,
                overhead_bytes=overhead)


def _prefix(costs: list[int]) -> list[int]:
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    return prefix


def _best_split(prefixes: list[list[int]], room: list[int]) -> tuple[float, list[tuple[int, int]]]:
    """The smallest largest share of any node's room its layers take, and the split that achieves it
    (``prefixes[j]``: node j's cumulative layer costs; every room > 0)."""
    n_layers, n_nodes = len(prefixes[0]) - 1, len(room)
    # Every possible share cost_j(s, e) / room_j; the answer is the smallest one that admits a split.
    candidates = sorted({(prefixes[j][e] - prefixes[j][s]) / room[j] for j in range(n_nodes)
                         for s in range(n_layers) for e in range(s + 1, n_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _split(prefixes, room, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    ranges = _split(prefixes, room, candidates[lo])
    assert ranges is not None  # the largest candidate always admits a split (each room > 0)
    return candidates[lo], ranges


def _refuse_if_short(model: ModelFootprint, nodes: list[NodeSpec], budgets: list[int], fixed: list[int],
                     room: list[int], layer_costs: list[list[int]], kv: tuple[int, ...], overhead: int) -> None:
    """Refuse, saying by how much, when the budgets add up short or a node cannot take one layer."""
    problems, briefs = [], []
    # Each layer on the node where it costs least: a bound no split can beat.
    layers_total = sum(min(costs) for costs in zip(*layer_costs))
    need = layers_total + sum(fixed)
    if need > sum(budgets):
        briefs.append(f"short by {format_bytes(need - sum(budgets))} in all")
        problems.append(
            f"model {model.path.name} does not fit: it needs {format_bytes(need)} on these {len(nodes)} nodes "
            f"(tensors {format_bytes(model.tensor_bytes + model.shared_bytes * (len(nodes) - 1))}, "
            f"KV {format_bytes(sum(kv))}, overhead {len(nodes)} x {format_bytes(overhead)}) but their budgets "
            f"sum to {format_bytes(sum(budgets))}: short by {format_bytes(need - sum(budgets))}"
        )
    for node, budget, f, r, costs in zip(nodes, budgets, fixed, room, layer_costs):
        smallest = min(costs)
        if r < smallest:
            briefs.append(f"node {node.name} cannot hold one layer")
            problems.append(
                f"node {node.name} ({node.mem_gib:g} GiB) cannot hold its fixed costs ({format_bytes(f)}: overhead "
                f"{format_bytes(overhead)} + non-layer tensors {format_bytes(f - overhead)}) plus one layer "
                f"({format_bytes(smallest)}): short by {format_bytes(f + smallest - budget)}"
            )
    if problems:
        raise DoesNotFitError("; ".join(problems), brief=", ".join(briefs))


def _split(prefixes: list[list[int]], room: list[int], share: float) -> list[tuple[int, int]] | None:
    """Contiguous ranges where node j's layers cost at most ``share`` of room[j], or None.

    ok[j][s]: layers s.. can be split among nodes j..; nodes are then filled greedily in
    order, each taking the most layers that still leave the rest splittable.
    """
    n_layers, n_nodes = len(prefixes[0]) - 1, len(room)

    def reach(j: int, s: int) -> int:
        """The largest end e such that layers s:e fit node j at this share."""
        prefix = prefixes[j]
        limit = share * room[j]
        # prefix is increasing: find the last e with prefix[e] - prefix[s] <= limit
        e = bisect.bisect_right(prefix, prefix[s] + limit) - 1
        while e > s and (prefix[e] - prefix[s]) / room[j] > share:  # float rounding at the edge
            e -= 1
        while e < n_layers and (prefix[e + 1] - prefix[s]) / room[j] <= share:
            e += 1
        return e

    ok = [[False] * (n_layers + 1) for _ in range(n_nodes + 1)]
    ok[n_nodes][n_layers] = True
    for j in range(n_nodes - 1, -1, -1):
        below = ok[j + 1]
        count = [0]  # count[e] = how many of below[0:e] are True
        for flag in below:
            count.append(count[-1] + flag)
        for s in range(n_layers):
            e_max = reach(j, s)
            ok[j][s] = e_max > s and count[e_max + 1] - count[s + 1] > 0
    if not ok[0][0]:
        return None
    ranges, s = [], 0
    for j in range(n_nodes):
        e = reach(j, s)
        while not ok[j + 1][e]:
            e -= 1
        ranges.append((s, e))
        s = e
    return ranges


def make_plan(model_path: str | Path, nodes: list[NodeSpec], quantization: str = "preserve", **kwargs: Any) -> Plan:
    """Read the GGUF and plan it over ``nodes``, every stage at ``quantization``; keyword arguments as
    :func:`plan_stages`."""
    return plan_stages(read_footprint(model_path, quantization), nodes, **kwargs)


# ``plan --quantization auto``: the types tried, highest precision first. None needs an imatrix.
AUTO_QUANTIZATIONS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS")


def quantization_ladder(footprints: list[ModelFootprint]) -> list[ModelFootprint]:
    """The model's footprints at several types ordered from the highest precision down: by the bytes
    the whole model's weights take (``preserve`` ranks where its own type falls, first on a tie)."""
    return sorted(footprints, key=lambda m: (-m.tensor_bytes, m.quantization != "preserve"))


def plan_quantized(ladder: list[ModelFootprint], nodes: list[NodeSpec], **kwargs: Any) -> Plan:
    """The plan with, per node, the highest precision of ``ladder`` (the model's footprints, highest
    first) that still lets the split fit; keyword arguments as :func:`plan_stages`.

    Every node starts at the top; while no split fits, the node whose step down relieves the split
    most (the nodes short of one layer first, then the largest share of a node's room) steps down;
    once a split fits, each node in order steps back up while it still fits.
    """
    if not ladder:
        raise PlanError("no quantization to choose from")
    _check_nodes(nodes)
    model, n_nodes = ladder[0], len(nodes)
    kv = kv_bytes_per_layer(model, kwargs.get("ctx_size", 4096), kwargs.get("lanes", 4),
                            kwargs.get("cache_type", "f16"))
    overhead = int(kwargs.get("overhead_mib", DEFAULT_OVERHEAD_MIB) * MIB)
    if n_nodes > model.block_count:
        return plan_stages(model, nodes, **kwargs)  # refused there, by name

    def pressure(levels: list[int]) -> tuple[int, float]:
        """(bytes the nodes short of one layer lack, the best split's largest share): fits at (0, <= 1)."""
        prefixes, room, short = [], [], 0
        for j, (node, level) in enumerate(zip(nodes, levels)):
            m = ladder[level]
            costs = [w + k for w, k in zip(m.layer_weight_bytes, kv)]
            r = node.budget_bytes - overhead - m.fixed_bytes(j == 0, j == n_nodes - 1)
            short += max(0, min(costs) - r)
            prefixes.append(_prefix(costs))
            room.append(r)
        if short:
            return short, float("inf")
        return 0, _best_split(prefixes, room)[0]

    def fits(levels: list[int]) -> bool:
        short, share = pressure(levels)
        return short == 0 and share <= 1

    levels = [0] * n_nodes
    while not fits(levels):
        steps = [(pressure(levels[:j] + [levels[j] + 1] + levels[j + 1:]), j)
                 for j in range(n_nodes) if levels[j] + 1 < len(ladder)]
        if not steps:
            break  # every node at the lowest: plan_stages says by how much it misses
        levels[min(steps)[1]] += 1
    if fits(levels):
        for j in range(n_nodes):
            while levels[j] > 0 and fits(levels[:j] + [levels[j] - 1] + levels[j + 1:]):
                levels[j] -= 1
    # Refused there when nothing fits (every node then at the lowest type, which the message names).
    return plan_stages(ladder[max(levels)], nodes, models=[ladder[level] for level in levels], **kwargs)
