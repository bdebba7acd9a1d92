"""The files that deploy a plan: one StageConfig JSON per node, a Compose project and
Kubernetes manifests, all wired as one chain.

Every stage binds an address other hosts reach, so every stage carries the chain's bearer token
(``auth_token_path``; without it ``check_exposure`` refuses to start the stage). The token is one
file: ``token`` beside the plan's files, a Compose secret, a Kubernetes Secret, mounted in every
container at the same path, so the configs, the ConfigMaps and the Compose project agree.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any

import yaml

from skippy_stage.config import chain_links, shared_host_openmp
from skippy_stage.errors import PlanError
from skippy_stage.ops.footprint import MIB
from skippy_stage.ops.plan import Plan

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


# The chain's bearer token: the file ``write_plan`` creates, the Compose secret and the Kubernetes
# Secret (key ``token``) that hold it, and where every stage reads it. Kubernetes mounts the one
# file there (subPath), never a volume over /run/secrets, which would hide the service-account token.
TOKEN_FILE = "token"
TOKEN_SECRET = "skippy-token"
TOKEN_KEY = "token"
CONTAINER_TOKEN_PATH = f"/run/secrets/{TOKEN_SECRET}"


_UNQUANTISED = ("f32", "f16", "bf16")


_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


# The gRPC health check the image, Compose and the Dockerfile run: exits 0 only on SERVING.
HEALTH_PROBE_PY = (
    "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; "
    "r = g.HealthStub(grpc.insecure_channel('127.0.0.1:{port}')).Check(h.HealthCheckRequest(), timeout=4); "
    "sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"
)


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
    a Kubernetes Service forwards only the ports it declares). Every stage listens on all
    interfaces, so every stage reads the chain's token from ``CONTAINER_TOKEN_PATH``.
    """
    flash = "disabled" if plan.cache_type in _UNQUANTISED else "enabled"  # llama.cpp: quantised V needs it
    stages = plan.stages
    links = chain_links([s.node for s in stages], [f"{s.node}:{port}" for s in stages])
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
            "auth_token_path": CONTAINER_TOKEN_PATH,
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
        if plan.quantized:  # the stage quantizes its own slice at start, into cache_dir
            cfg["checkpoint_quantization"] = stage.quantization
        if metrics_port is not None:
            cfg["metrics_port"] = metrics_port
        # The final stage sends sampled tokens straight back to the head's frame listener;
        # they are relayed up the edges only when it cannot be reached.
        cfg.update(links[i])
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
                     config_dir: str = "./configs", models_dir: str = "./models",
                     token_file: str = f"./{TOKEN_FILE}") -> dict[str, Any]:
    """A Compose project with one service per stage, started downstream-first; ``token_file`` is
    the secret mounted where each stage's ``auth_token_path`` says."""
    services: dict[str, Any] = {}
    volumes: dict[str, Any] = {}
    token_used = False
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
            # every stage on one host: OpenMP workers must not spin on the cores the next stage needs,
            # and are bound one to a core
            "environment": shared_host_openmp({}),
        }
        if cfg.get("auth_token_path"):
            service["secrets"] = [{"source": TOKEN_SECRET, "target": cfg["auth_token_path"]}]
            token_used = True
        if i == 0:
            service["ports"] = [f"{port}:{port}"]  # the head is where clients connect
        if "downstream" in cfg:
            service["depends_on"] = {cfg["downstream"]["stage_id"]: {"condition": "service_healthy"}}
        services[name] = service
        volumes[f"{name}-cache"] = {}
    document: dict[str, Any] = {"services": services, "volumes": volumes}
    if token_used:
        document["secrets"] = {TOKEN_SECRET: {"file": token_file}}
    return document


def k8s_documents(cfg: dict[str, Any], *, image: str = DEFAULT_IMAGE, port: int = DEFAULT_PORT,
                  frame_port: int = DEFAULT_FRAME_PORT,
                  memory_request_bytes: int | None = None, memory_limit_bytes: int | None = None,
                  node_selector: dict[str, str] | None = None, models_host_path: str = DEFAULT_MODEL_DIR,
                  ) -> list[dict[str, Any]]:
    """ConfigMap, Deployment and Service for one stage; both declare ``frame_port`` as ``frames``.

    A stage with ``auth_token_path`` reads it from Secret ``TOKEN_SECRET`` (key ``TOKEN_KEY``),
    mounted as that one file; the gRPC probes need no token (Health is exempt).
    """
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
    token_path = cfg.get("auth_token_path")
    if token_path:
        container["volumeMounts"].append({"name": "token", "mountPath": token_path, "subPath": TOKEN_KEY,
                                          "readOnly": True})
        pod_spec["volumes"].append({"name": "token", "secret": {
            "secretName": TOKEN_SECRET,
            "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
            "defaultMode": 0o440,  # the pod's group (fsGroup) reads it
        }})
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


def write_token(path: Path) -> bool:
    """Create ``path`` holding a fresh random bearer token, readable by its owner only, unless it
    exists (stages already started hold that one). Returns whether it was created."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return True


def kubectl_create_secret(token_path: str | Path) -> str:
    """The command that loads the token file into the cluster as the Secret the Deployments mount."""
    return f"kubectl create secret generic {TOKEN_SECRET} --from-file={TOKEN_KEY}={token_path}"


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
    """Write ``configs/<node>.json``, ``compose.yaml``, ``k8s/<node>.yaml`` and, unless one is
    there already, the chain's ``token`` (mode 0600) under ``out_dir``.

    ``model_path`` is the model as the nodes see it (``/models/...`` in the containers).
    ``pin_nodes`` adds a ``kubernetes.io/hostname`` nodeSelector, for node names that are
    the cluster's node names. Returns the files written (``token`` only when created).
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
    token = out / TOKEN_FILE
    if write_token(token):
        written.append(token)
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
        + f"# Every stage reads the chain's bearer token from {token} (secret {TOKEN_SECRET}). Compose mounts the\n"
        + f"# file as it is, so let the image's user read it: setfacl -m u:{CONTAINER_UID}:r {token}\n"
        + f"# Clients pass it too: skippy-stage generate --endpoint 127.0.0.1:{port} --token-file {token} ...\n"
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
        path.write_text(header
                        + f"# The stage reads the chain's bearer token from Secret {TOKEN_SECRET}; create it once:\n"
                        + f"#   {kubectl_create_secret(token)}\n"
                        + _yaml(*docs))
        written.append(path)
    return written
