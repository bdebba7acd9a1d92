"""Stage planning: which node runs which layer range, and the files that deploy the split.

Pure policy (no grpc, no llama.cpp): the inputs are a GGUF's tensor sizes and metadata, the
nodes' memory budgets, and the KV settings; the output is a :class:`Plan` and, on request,
one StageConfig JSON per node plus the matching Compose and Kubernetes files.

What a stage costs, in bytes (the same tensors :mod:`skippy_stage.slicing` puts in its file):

- its layers' tensors ``blk.{i}.*``, read from the GGUF tensor table;
- the non-layer tensors every stage file carries (``token_embd.weight``, which llama.cpp
  insists on even when the stage never embeds, ``output_norm.weight``, ...);
- ``output.*`` only on the final stage (tied-embedding models have none);
- the KV cache of its layers: 2 (K and V) x cells x n_embd_kv x bytes per element of the
  cache type, where n_embd_kv = head_count_kv x head size;
- a stated fixed overhead per node (runtime, compute buffers, Python), 512 MiB by default.

Context is counted **per lane**: ``--ctx-size 4096 --lanes 8`` means every session may hold
4096 tokens at once, so the stage config gets ``ctx_size = 4096 x 8`` cells and the KV cache
grows linearly with both numbers. With ``kv_unified`` (the stage default) the lanes share that
pool, so one session may also use more than its share while others are idle. Every layer is charged the full cache, an upper
bound for sliding-window layers.

Layer ranges are contiguous and follow the node order (node 0 is the head). The split
minimises the largest share of any node's free room (budget less its fixed costs) that its
layers take; nodes are then filled greedily in order up to that share, so a node with twice
the room gets about twice the layers. A model that does not fit is refused with a
:class:`PlanError` that says by how much.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from skippy_stage.config import CACHE_TYPE_BYTES, MAX_LANES
from skippy_stage.errors import PlanError

MIB = 1 << 20
GIB = 1 << 30

DEFAULT_OVERHEAD_MIB = 512
DEFAULT_PORT = 7000
# The TCP frame listener (StageConfig.frame_port): fixed, so a Service can forward it.
DEFAULT_FRAME_PORT = DEFAULT_PORT + 1
DEFAULT_METRICS_PORT = 9100
DEFAULT_IMAGE = "skippy-stage:latest"
DEFAULT_MODEL_DIR = "/models"
# Where stage files (slices) are cached inside the container; a writable volume.
CONTAINER_CACHE_DIR = "/var/cache/skippy-stage"
# serve's --grace; orchestrators wait a bit longer before they SIGKILL.
DRAIN_GRACE_S = 10
STOP_GRACE_S = 30
CONTAINER_UID = 10001

_UNQUANTISED = ("f32", "f16", "bf16")

# A node name becomes a stage_id, a hostname in endpoints, a Compose service and a
# Kubernetes Service name, so it must be an RFC 1035 label.
_NODE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

# The gRPC health check the image, Compose and the Dockerfile run: exits 0 only on SERVING.
HEALTH_PROBE_PY = (
    "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; "
    "r = g.HealthStub(grpc.insecure_channel('127.0.0.1:{port}')).Check(h.HealthCheckRequest(), timeout=4); "
    "sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"
)


def format_bytes(n: float) -> str:
    """GiB with two decimals from 1 GiB up, MiB with one decimal below."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class NodeSpec:
    """One machine (or GPU) that will run one stage, with its memory budget."""

    name: str
    mem_gib: float

    @property
    def budget_bytes(self) -> int:
        return int(self.mem_gib * GIB)


@dataclass(frozen=True)
class ModelFootprint:
    """A GGUF's tensor bytes split the way stage files are built, and its KV shape."""

    path: Path
    name: str
    architecture: str
    block_count: int
    layer_weight_bytes: tuple[int, ...]
    shared_bytes: int  # non-layer tensors every stage file carries
    output_bytes: int  # output.* tensors, final stage only
    n_embd_k: tuple[int, ...]  # per layer: head_count_kv x key_length
    n_embd_v: tuple[int, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(self.layer_weight_bytes) + self.shared_bytes + self.output_bytes


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

    def format_table(self) -> str:
        head = (
            f"{self.model.path.name} ({self.model.architecture}, {self.model.block_count} layers): "
            f"ctx {self.ctx_size}/lane x {self.lanes} lanes, KV cache {self.cache_type}, "
            f"overhead {self.overhead_bytes / MIB:.0f} MiB/node"
        )
        width = max(4, *(len(s.node) for s in self.stages))
        cols = f"{'node':<{width}}  {'layers':>7}  {'weights MiB':>11}  {'KV MiB':>8}  {'overhead MiB':>12}  " \
               f"{'total MiB':>9}  {'budget MiB':>10}  {'used':>5}"
        lines = [head, cols]
        for s in self.stages:
            lines.append(
                f"{s.node:<{width}}  {f'{s.layer_start}:{s.layer_end}':>7}  {s.weight_bytes / MIB:>11.1f}  "
                f"{s.kv_bytes / MIB:>8.1f}  {s.overhead_bytes / MIB:>12.1f}  {s.total_bytes / MIB:>9.1f}  "
                f"{s.budget_bytes / MIB:>10.1f}  {100 * s.total_bytes / s.budget_bytes:>4.0f}%"
            )
        budget = sum(s.budget_bytes for s in self.stages)
        weights = sum(s.weight_bytes for s in self.stages)
        kv = sum(s.kv_bytes for s in self.stages)
        overhead = sum(s.overhead_bytes for s in self.stages)
        lines.append(
            f"{'all':<{width}}  {f'0:{self.model.block_count}':>7}  {weights / MIB:>11.1f}  {kv / MIB:>8.1f}  "
            f"{overhead / MIB:>12.1f}  {self.total_bytes / MIB:>9.1f}  {budget / MIB:>10.1f}  "
            f"{100 * self.total_bytes / budget:>4.0f}%"
        )
        return "\n".join(lines)


# --------------------------------------------------------------------------- reading


def _per_layer(value: object, block_count: int, key: str, path: Path) -> tuple[int, ...]:
    """A metadata value that may be one number or one number per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != block_count:
            raise PlanError(f"model file {path}: {key} has {len(value)} entries for {block_count} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * block_count


def read_footprint(model_path: str | Path) -> ModelFootprint:
    """Read tensor sizes and the KV shape from a GGUF (refusing unsupported architectures)."""
    from gguf import GGUFReader

    from skippy_stage.model.slicing import check_architecture, layer_index, read_model_info

    info = read_model_info(model_path)  # ConfigError for a missing or non-GGUF file
    check_architecture(info.architecture)
    reader = GGUFReader(info.path, "r")
    arch, n = info.architecture, info.block_count

    def meta(key: str) -> object | None:
        field = reader.get_field(f"{arch}.{key}")
        return None if field is None else field.contents()

    layers = [0] * n
    shared = output = 0
    for tensor in reader.tensors:
        size = int(tensor.n_bytes)
        index = layer_index(tensor.name)
        if index is not None:
            if not 0 <= index < n:
                raise PlanError(f"model file {info.path}: tensor {tensor.name} is beyond block_count {n}")
            layers[index] += size
        elif tensor.name.startswith("output."):  # as slicing._is_kept: the head only in the final stage
            output += size
        else:
            shared += size

    head_count = meta("attention.head_count")
    if head_count is None:
        raise PlanError(f"model file {info.path} lacks {arch}.attention.head_count")
    heads = _per_layer(head_count, n, f"{arch}.attention.head_count", info.path)
    kv_raw = meta("attention.head_count_kv")
    heads_kv = heads if kv_raw is None else _per_layer(kv_raw, n, f"{arch}.attention.head_count_kv", info.path)
    key_length, value_length = meta("attention.key_length"), meta("attention.value_length")
    n_embd_k, n_embd_v = [], []
    for il in range(n):
        head_dim = info.n_embd // heads[il] if heads[il] else 0
        n_embd_k.append(heads_kv[il] * (int(key_length) if key_length is not None else head_dim))
        n_embd_v.append(heads_kv[il] * (int(value_length) if value_length is not None else head_dim))
    return ModelFootprint(
        path=info.path,
        name=info.name,
        architecture=arch,
        block_count=n,
        layer_weight_bytes=tuple(layers),
        shared_bytes=shared,
        output_bytes=output,
        n_embd_k=tuple(n_embd_k),
        n_embd_v=tuple(n_embd_v),
    )


# --------------------------------------------------------------------------- arithmetic


def _bytes_for(cells: int, width: int, cache_type: str) -> int:
    per = CACHE_TYPE_BYTES[cache_type]
    return -(-cells * width * per.numerator // per.denominator)  # round up


def kv_bytes_per_layer(
    model: ModelFootprint, ctx_size: int, lanes: int, cache_type_k: str = "f16", cache_type_v: str | None = None
) -> tuple[int, ...]:
    """KV cache bytes of each layer for ``lanes`` sessions of ``ctx_size`` tokens each."""
    cache_type_v = cache_type_k if cache_type_v is None else cache_type_v
    for name, value in (("cache type", cache_type_k), ("cache type", cache_type_v)):
        if value not in CACHE_TYPE_BYTES:
            raise PlanError(f"{name} {value!r} is not one of {', '.join(CACHE_TYPE_BYTES)}")
    _check_kv_settings(ctx_size, lanes)
    cells = ctx_size * lanes
    return tuple(
        _bytes_for(cells, k, cache_type_k) + _bytes_for(cells, v, cache_type_v)
        for k, v in zip(model.n_embd_k, model.n_embd_v)
    )


def _check_kv_settings(ctx_size: int, lanes: int) -> None:
    if not isinstance(ctx_size, int) or ctx_size < 1:
        raise PlanError(f"ctx_size={ctx_size!r} must be a positive number of tokens per lane")
    if not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise PlanError(f"lanes={lanes!r} must be between 1 and {MAX_LANES} (llama.cpp's sequence limit)")


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


# --------------------------------------------------------------------------- planning


def plan_stages(
    model: ModelFootprint,
    nodes: list[NodeSpec],
    *,
    ctx_size: int = 4096,
    lanes: int = 4,
    cache_type: str = "f16",
    overhead_mib: float = DEFAULT_OVERHEAD_MIB,
) -> Plan:
    """Split ``model`` into contiguous layer ranges over ``nodes`` (in order), or refuse."""
    _check_nodes(nodes)
    if overhead_mib < 0:
        raise PlanError(f"overhead {overhead_mib!r} MiB must be >= 0")
    n_layers, n_nodes = model.block_count, len(nodes)
    if n_nodes > n_layers:
        raise PlanError(f"{n_nodes} nodes for {n_layers} layers: every node needs at least one layer")
    kv = kv_bytes_per_layer(model, ctx_size, lanes, cache_type)
    overhead = int(overhead_mib * MIB)
    layer_cost = [w + k for w, k in zip(model.layer_weight_bytes, kv)]
    prefix = [0]
    for c in layer_cost:
        prefix.append(prefix[-1] + c)
    fixed = [overhead + model.shared_bytes + (model.output_bytes if j == n_nodes - 1 else 0) for j in range(n_nodes)]
    budgets = [node.budget_bytes for node in nodes]
    room = [b - f for b, f in zip(budgets, fixed)]

    _refuse_if_short(model, nodes, budgets, fixed, room, layer_cost, prefix[-1], kv, overhead)

    def cost(s: int, e: int) -> int:
        return prefix[e] - prefix[s]

    # Every possible share cost(s, e) / room_j; the answer is the smallest one that admits a split.
    candidates = sorted({cost(s, e) / room[j] for j in range(n_nodes) for s in range(n_layers)
                         for e in range(s + 1, n_layers + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _split(prefix, room, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    share = candidates[lo]
    ranges = _split(prefix, room, share)
    assert ranges is not None  # the largest candidate always admits a split (each room > 0)
    if share > 1:
        over = max((cost(s, e) - r, nodes[j].name) for j, ((s, e), r) in enumerate(zip(ranges, room)))
        raise PlanError(
            f"model {model.path.name} does not fit these nodes in contiguous layer ranges: the closest split "
            f"({', '.join(f'{nd.name}={s}:{e}' for nd, (s, e) in zip(nodes, ranges))}) still overcommits node "
            f"{over[1]} by {format_bytes(over[0])}"
        )
    stages = []
    for j, (node, (s, e)) in enumerate(zip(nodes, ranges)):
        weights = sum(model.layer_weight_bytes[s:e]) + model.shared_bytes
        weights += model.output_bytes if j == n_nodes - 1 else 0
        kv_stage = sum(kv[s:e])
        stages.append(StagePlan(
            node=node.name, layer_start=s, layer_end=e, weight_bytes=weights, kv_bytes=kv_stage,
            overhead_bytes=overhead, total_bytes=weights + kv_stage + overhead, budget_bytes=budgets[j],
        ))
    return Plan(model=model, stages=tuple(stages), ctx_size=ctx_size, lanes=lanes, cache_type=cache_type,
                overhead_bytes=overhead)


def _refuse_if_short(model: ModelFootprint, nodes: list[NodeSpec], budgets: list[int], fixed: list[int],
                     room: list[int], layer_cost: list[int], layers_total: int, kv: tuple[int, ...],
                     overhead: int) -> None:
    """Refuse, saying by how much, when the budgets add up short or a node cannot take one layer."""
    problems = []
    need = layers_total + sum(fixed)
    if need > sum(budgets):
        problems.append(
            f"model {model.path.name} does not fit: it needs {format_bytes(need)} on these {len(nodes)} nodes "
            f"(tensors {format_bytes(model.tensor_bytes + model.shared_bytes * (len(nodes) - 1))}, "
            f"KV {format_bytes(sum(kv))}, overhead {len(nodes)} x {format_bytes(overhead)}) but their budgets "
            f"sum to {format_bytes(sum(budgets))}: short by {format_bytes(need - sum(budgets))}"
        )
    smallest = min(layer_cost)
    for node, budget, f, r in zip(nodes, budgets, fixed, room):
        if r < smallest:
            problems.append(
                f"node {node.name} ({node.mem_gib:g} GiB) cannot hold its fixed costs ({format_bytes(f)}: overhead "
                f"{format_bytes(overhead)} + non-layer tensors {format_bytes(f - overhead)}) plus one layer "
                f"({format_bytes(smallest)}): short by {format_bytes(f + smallest - budget)}"
            )
    if problems:
        raise PlanError("; ".join(problems))


def _split(prefix: list[int], room: list[int], share: float) -> list[tuple[int, int]] | None:
    """Contiguous ranges where node j's layers cost at most ``share`` of room[j], or None.

    ok[j][s]: layers s.. can be split among nodes j..; nodes are then filled greedily in
    order, each taking the most layers that still leave the rest splittable.
    """
    n_layers, n_nodes = len(prefix) - 1, len(room)

    def reach(j: int, s: int) -> int:
        """The largest end e such that layers s:e fit node j at this share."""
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


def make_plan(model_path: str | Path, nodes: list[NodeSpec], **kwargs: Any) -> Plan:
    """Read the GGUF and plan it over ``nodes``; keyword arguments as :func:`plan_stages`."""
    return plan_stages(read_footprint(model_path), nodes, **kwargs)


# --------------------------------------------------------------------------- writing


def stage_configs(
    plan: Plan,
    model_path: str,
    *,
    run_id: str = "skippy",
    port: int = DEFAULT_PORT,
    frame_port: int = DEFAULT_FRAME_PORT,
    metrics_port: int | None = DEFAULT_METRICS_PORT,
    cache_dir: str | None = CONTAINER_CACHE_DIR,
    n_gpu_layers: int = -1,
) -> list[dict[str, Any]]:
    """One StageConfig dict per stage, chained upstream to downstream at ``<node>:<port>``.

    Every stage's frame listener is fixed at ``frame_port`` (peers find it through GetStatus;
    a Kubernetes Service forwards only the ports it declares).
    """
    flash = "disabled" if plan.cache_type in _UNQUANTISED else "enabled"  # llama.cpp: quantised V needs it
    stages = plan.stages
    configs = []
    for i, stage in enumerate(stages):
        cfg: dict[str, Any] = {
            "run_id": run_id,
            "topology_id": run_id,
            "model_id": plan.model.name,
            "model_path": model_path,
            "stage_id": stage.node,
            "stage_index": i,
            "layer_start": stage.layer_start,
            "layer_end": stage.layer_end,
            "bind_addr": f"0.0.0.0:{port}",
            "frame_port": frame_port,
            "ctx_size": plan.kv_cells,
            "lane_count": plan.lanes,
            "cache_type_k": plan.cache_type,
            "cache_type_v": plan.cache_type,
            "flash_attn_type": flash,
            "n_gpu_layers": n_gpu_layers,
        }
        if cache_dir is not None:
            cfg["cache_dir"] = cache_dir
        if metrics_port is not None:
            cfg["metrics_port"] = metrics_port
        if i > 0:
            up = stages[i - 1].node
            cfg["upstream"] = {"stage_id": up, "stage_index": i - 1, "endpoint": f"{up}:{port}"}
        if i + 1 < len(stages):
            down = stages[i + 1].node
            cfg["downstream"] = {"stage_id": down, "stage_index": i + 1, "endpoint": f"{down}:{port}"}
        elif i > 0:
            # Sampled tokens straight back to the head's frame listener; relayed up the edges only
            # when it cannot be reached.
            head = stages[0].node
            cfg["return_to"] = {"stage_id": head, "stage_index": 0, "endpoint": f"{head}:{port}"}
        configs.append(cfg)
    return configs


class _Dumper(yaml.SafeDumper):
    """Block style, no anchors, and multi-line strings (a ConfigMap's config JSON) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _literal_str(dumper: Any, data: str) -> Any:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _literal_str)


def _yaml(*docs: dict[str, Any]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)


def health_probe(port: int = DEFAULT_PORT) -> str:
    """The one-line Python gRPC health check (exit 0 only when the stage is SERVING)."""
    return HEALTH_PROBE_PY.replace("{port}", str(port))


def compose_document(configs: list[dict[str, Any]], *, image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
                     config_dir: str = "./configs", models_dir: str = "./models") -> dict[str, Any]:
    """A Compose project with one service per stage, started downstream-first."""
    services: dict[str, Any] = {}
    volumes: dict[str, Any] = {}
    for i, cfg in enumerate(configs):
        name = cfg["stage_id"]
        service: dict[str, Any] = {
            "image": image,
            "command": ["serve", "--config", f"/config/{name}.json", "--grace", str(DRAIN_GRACE_S)],
            "volumes": [
                f"{config_dir}/{name}.json:/config/{name}.json:ro",
                f"{models_dir}:{DEFAULT_MODEL_DIR}:ro",
                f"{name}-cache:{CONTAINER_CACHE_DIR}",
            ],
            "healthcheck": {
                "test": ["CMD", "python", "-c", health_probe(port)],
                "interval": "10s",
                "timeout": "5s",
                "retries": 3,
                "start_period": "300s",
            },
            "stop_signal": "SIGTERM",
            "stop_grace_period": f"{STOP_GRACE_S}s",
            "restart": "on-failure",
        }
        if i == 0:
            service["ports"] = [f"{port}:{port}"]  # the head is where clients connect
        if "downstream" in cfg:
            service["depends_on"] = {cfg["downstream"]["stage_id"]: {"condition": "service_healthy"}}
        services[name] = service
        volumes[f"{name}-cache"] = {}
    return {"services": services, "volumes": volumes}


def k8s_documents(cfg: dict[str, Any], *, image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
                  frame_port: int = DEFAULT_FRAME_PORT,
                  memory_request_bytes: int | None = None, memory_limit_bytes: int | None = None,
                  node_selector: dict[str, str] | None = None, models_host_path: str = DEFAULT_MODEL_DIR,
                  ) -> list[dict[str, Any]]:
    """ConfigMap, Deployment and Service for one stage; both declare ``frame_port`` as ``frames``."""
    name, run_id = cfg["stage_id"], cfg["run_id"]
    labels = {
        "app.kubernetes.io/name": "skippy-stage",
        "app.kubernetes.io/instance": run_id,
        "app.kubernetes.io/component": name,
    }
    resources: dict[str, Any] = {"requests": {"cpu": "2", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    if memory_request_bytes is not None:
        resources["requests"]["memory"] = f"{-(-memory_request_bytes // MIB)}Mi"
    if memory_limit_bytes is not None:
        resources["limits"]["memory"] = f"{-(-memory_limit_bytes // MIB)}Mi"
    container: dict[str, Any] = {
        "name": "stage",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["serve", "--config", "/config/stage.json", "--grace", str(DRAIN_GRACE_S)],
        "ports": [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "frames", "containerPort": frame_port, "protocol": "TCP"},
        ],
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 120},
        "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 5, "failureThreshold": 2},
        # A stage also reports NOT_SERVING while its downstream is down, so liveness waits
        # long enough for a neighbour's restart before it restarts this one.
        "livenessProbe": {"grpc": {"port": port, "service": "liveness"}, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 30},
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/config", "readOnly": True},
            {"name": "models", "mountPath": DEFAULT_MODEL_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CONTAINER_CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    metrics = cfg.get("metrics_port")
    if metrics is not None:
        container["ports"].append({"name": "metrics", "containerPort": metrics, "protocol": "TCP"})
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": STOP_GRACE_S,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": CONTAINER_UID,
            "runAsGroup": CONTAINER_UID,
            "fsGroup": CONTAINER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{name}-config"}},
            {"name": "models", "hostPath": {"path": models_host_path, "type": "Directory"}},
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    service_ports = [
        {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "frames", "port": frame_port, "targetPort": "frames", "protocol": "TCP"},
    ]
    if metrics is not None:
        service_ports.append({"name": "metrics", "port": metrics, "targetPort": "metrics", "protocol": "TCP"})
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", "labels": labels},
            "data": {"stage.json": json.dumps(cfg, indent=2) + "\n"},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},  # one stage per GPU: never two pods at once
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "labels": labels},
            "spec": {"type": "ClusterIP", "selector": labels, "ports": service_ports},
        },
    ]


def write_plan(
    plan: Plan,
    out_dir: str | Path,
    model_path: str,
    *,
    run_id: str = "skippy",
    port: int = DEFAULT_PORT,
    frame_port: int = DEFAULT_FRAME_PORT,
    metrics_port: int | None = DEFAULT_METRICS_PORT,
    image: str = DEFAULT_IMAGE,
    pin_nodes: bool = False,
) -> list[Path]:
    """Write ``configs/<node>.json``, ``compose.yaml`` and ``k8s/<node>.yaml`` under ``out_dir``.

    ``model_path`` is the model as the nodes see it (``/models/...`` in the containers).
    ``pin_nodes`` adds a ``kubernetes.io/hostname`` nodeSelector, for node names that are
    the cluster's node names. Returns the files written.
    """
    if not _LABEL_VALUE.match(run_id):
        raise PlanError(f"run_id {run_id!r} must be a Kubernetes label value (letters, digits, '-', '_', '.')")
    if frame_port == port or (metrics_port is not None and frame_port == metrics_port):
        raise PlanError(f"frame port {frame_port} must differ from the gRPC and metrics ports")
    out = Path(out_dir)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "k8s").mkdir(parents=True, exist_ok=True)
    configs = stage_configs(plan, model_path, run_id=run_id, port=port, frame_port=frame_port,
                            metrics_port=metrics_port)
    written: list[Path] = []
    header = (f"# Written by `skippy-stage plan` for {plan.model.path.name}: "
              f"{', '.join(f'{s.node}={s.layer_start}:{s.layer_end}' for s in plan.stages)}.\n")
    for cfg in configs:
        path = out / "configs" / f"{cfg['stage_id']}.json"
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        written.append(path)
    compose = out / "compose.yaml"
    compose.write_text(
        header
        + "# Every stage on this one Docker host (a trial of the split; the k8s/ files place one stage per\n"
        + "# GPU node). Put the model under ./models (or set SKIPPY_MODELS) and run: docker compose up\n"
        + _yaml(compose_document(configs, image=image, port=port, models_dir="${SKIPPY_MODELS:-./models}"))
    )
    written.append(compose)
    for cfg, stage in zip(configs, plan.stages):
        docs = k8s_documents(
            cfg, image=image, port=port, frame_port=frame_port, memory_request_bytes=stage.total_bytes,
            memory_limit_bytes=max(stage.budget_bytes, stage.total_bytes),
            node_selector={"kubernetes.io/hostname": stage.node} if pin_nodes else None,
        )
        path = out / "k8s" / f"{stage.node}.yaml"
        path.write_text(header + _yaml(*docs))
        written.append(path)
    return written


# --------------------------------------------------------------------------- CLI


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``skippy-stage`` subcommand parser."""
    from skippy_stage.config import CACHE_TYPES

    p = subparsers.add_parser(
        "plan", help="split a model's layers over nodes by memory; optionally write configs, Compose and Kubernetes",
        description="Assign contiguous layer ranges to nodes (in the order given; the first is the head) by "
                    "their memory budgets, and optionally write the deployment files.",
    )
    p.add_argument("--model", required=True, help="the GGUF file to read tensor sizes from")
    p.add_argument("--nodes", required=True, help="NAME=MEM_GIB[,NAME=MEM_GIB...] in pipeline order")
    p.add_argument("--ctx-size", type=int, default=4096, help="tokens of context per lane (default 4096)")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions per stage (default 4)")
    p.add_argument("--cache-type", choices=CACHE_TYPES, default="f16", help="KV cache type for K and V (default f16)")
    p.add_argument("--overhead-mib", type=float, default=DEFAULT_OVERHEAD_MIB,
                   help=f"fixed per-node cost: runtime, compute buffers, Python (default {DEFAULT_OVERHEAD_MIB})")
    p.add_argument("--out", help="write configs/, compose.yaml and k8s/ here")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                   help=f"where the nodes see the model file (default {DEFAULT_MODEL_DIR}, the volume the files mount)")
    p.add_argument("--run-id", default="skippy")
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port of every stage (default {DEFAULT_PORT})")
    p.add_argument("--frame-port", type=int, default=DEFAULT_FRAME_PORT,
                   help=f"TCP frame listener port of every stage, exposed by each Service (default {DEFAULT_FRAME_PORT})")
    p.add_argument("--pin-nodes", action="store_true",
                   help="pin each Kubernetes Deployment to the node of the same name (kubernetes.io/hostname)")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    nodes = parse_nodes(args.nodes)
    plan = make_plan(args.model, nodes, ctx_size=args.ctx_size, lanes=args.lanes, cache_type=args.cache_type,
                     overhead_mib=args.overhead_mib)
    print(plan.format_table(), flush=True)
    if args.out:
        model_path = f"{args.model_dir.rstrip('/')}/{Path(args.model).name}"
        written = write_plan(plan, args.out, model_path, run_id=args.run_id, port=args.port,
                             frame_port=args.frame_port, image=args.image, pin_nodes=args.pin_nodes)
        print(f"# wrote {len(written)} files under {args.out}: configs/, compose.yaml, k8s/", file=sys.stderr)
    return 0


__all__ = [
    "ModelFootprint",
    "NodeSpec",
    "Plan",
    "PlanError",
    "StagePlan",
    "add_plan_parser",
    "cmd_plan",
    "kv_bytes_per_layer",
    "make_plan",
    "parse_nodes",
    "plan_stages",
    "read_footprint",
    "stage_configs",
    "write_plan",
]
