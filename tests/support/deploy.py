"""Checks of the deployment files (Kubernetes manifests, Compose, stage configs).

Every stage they start binds an address other hosts reach, so every config must pass the
protected-mode check ``serve`` makes (``check_exposure``) with a token, and every orchestrator
must mount that token where the config says.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import kubernetes_validate
import yaml

from skippy_stage.config import StageConfig, load_config, parse_endpoint
from skippy_stage.security import check_exposure

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"  # native gRPC probes are GA since 1.27; kubernetes-validate ships this schema

K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
CONFIG_FILES = sorted(DEPLOY.rglob("*.json"))

# Kubernetes mounts the service-account token under here: a volume over it (or over a parent) hides it.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def check_token_required(config: StageConfig) -> None:
    """The config passes the check ``serve`` makes before it listens (protected mode) with a token,
    not with ``allow_insecure``."""
    assert config.auth_token_path is not None, f"{config.stage_id}: binds {config.bind_addr} with no auth_token_path"
    assert not config.allow_insecure, f"{config.stage_id}: allow_insecure instead of a token"
    check_exposure(config)


def _hides(mount_path: str, path: Path) -> bool:
    """Whether a volume at ``mount_path`` covers ``path`` (/var/run is /run in the images)."""
    def norm(p: Path) -> Path:
        return Path("/run", *p.parts[3:]) if p.parts[1:3] == ("var", "run") else p
    return norm(path).is_relative_to(norm(Path(mount_path)))


def validate_manifest(doc: dict) -> None:
    """Raise unless ``doc`` matches its kind's schema (unknown fields refused)."""
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {exc.message}") from None


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    kinds: dict[str, dict] = {}
    for doc in docs:
        assert doc["kind"] not in kinds, f"two {doc['kind']}s in one stage file"
        kinds[doc["kind"]] = doc
    return kinds


def check_stage_manifests(docs: list[dict], *, port: int = 7000, frame_port: int = 7001) -> StageConfig:
    """One stage's ConfigMap + Deployment/StatefulSet + Service, wired to each other.

    The frame listener is fixed at ``frame_port`` and declared by the container and the Service
    (a Service forwards only the ports it declares; peers dial it for frames and direct returns).
    """
    kinds = by_kind(docs)
    workload = kinds.get("Deployment") or kinds.get("StatefulSet")
    assert workload is not None and "ConfigMap" in kinds and "Service" in kinds, sorted(kinds)
    config_map, service = kinds["ConfigMap"], kinds["Service"]
    (key, text), = config_map["data"].items()
    config = StageConfig.from_dict(json.loads(text))
    check_token_required(config)
    assert service["metadata"]["name"] == config.stage_id, "peers reach the stage by its stage_id"

    pod = workload["spec"]["template"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {"name": "grpc", "port": port} in [{k: p[k] for k in ("name", "port")} for p in service["spec"]["ports"]]
    assert config.frame_port == frame_port, "a fixed frame listener port, not any free one"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert "frames" in service_ports, "the Service forwards the frame listener"
    assert service_ports["frames"]["port"] == frame_port
    assert service_ports["frames"]["targetPort"] == "frames"
    assert service_ports["frames"].get("protocol", "TCP") == "TCP"

    spec = pod["spec"]
    (container,) = spec["containers"]
    container_ports = {p["name"]: p for p in container["ports"]}
    assert "frames" in container_ports, "the container declares the frame listener"
    assert container_ports["frames"]["containerPort"] == frame_port
    assert container_ports["frames"].get("protocol", "TCP") == "TCP"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
    bind = parse_endpoint(config.bind_addr, stage_id=config.stage_id, field_name="bind_addr", allow_port_zero=True)
    assert bind.port == port
    for side in ("requests", "limits"):
        assert int(container["resources"][side]["nvidia.com/gpu"]) == 1, side
    assert "memory" in container["resources"]["requests"]

    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    assert security["runAsNonRoot"] is True and security.get("runAsUser", 1) != 0
    assert security["allowPrivilegeEscalation"] is False

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "/models" in mounts, "a volume for model files"
    models = volumes[mounts["/models"]]
    assert "hostPath" in models or "persistentVolumeClaim" in models
    assert Path(config.model_path).parent == Path("/models")

    # The token: a Secret's key mounted as the one file the config names, hiding nothing.
    assert config.auth_token_path in mounts, f"no volume mounted at auth_token_path {config.auth_token_path}"
    token_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == config.auth_token_path)
    assert token_mount.get("readOnly") is True and token_mount.get("subPath"), "one file, read-only"
    secret = volumes[token_mount["name"]]["secret"]
    keys = [item["path"] for item in secret.get("items", [])]
    assert token_mount["subPath"] in keys, "the subPath is a key the volume projects"
    assert secret["secretName"]
    for mount in container["volumeMounts"]:
        assert not _hides(mount["mountPath"], SERVICE_ACCOUNT_DIR / "token"), f"{mount['mountPath']} hides the SA token"

    config_flag = container["args"][container["args"].index("--config") + 1]
    config_volume = volumes[mounts[str(Path(config_flag).parent)]]
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(config_flag).name == key
    return config


def check_chain(configs: list[StageConfig]) -> None:
    """Ordered stages whose layer ranges tile the model and whose peers point at each other."""
    configs = sorted(configs, key=lambda c: c.stage_index)
    assert [c.stage_index for c in configs] == list(range(len(configs)))
    assert configs[0].layer_start == 0 and configs[0].upstream is None
    assert configs[-1].downstream is None
    for above, below in itertools.pairwise(configs):
        assert above.layer_end == below.layer_start
        assert above.downstream is not None and below.upstream is not None
        assert (above.downstream.stage_id, above.downstream.stage_index) == (below.stage_id, below.stage_index)
        assert (below.upstream.stage_id, below.upstream.stage_index) == (above.stage_id, above.stage_index)
        assert above.downstream.address.host == below.stage_id
        assert below.upstream.address.host == above.stage_id
        assert above.downstream.address.port == parse_endpoint(
            below.bind_addr, stage_id=below.stage_id, field_name="bind_addr").port


def compose_service_configs(compose_file: Path) -> dict[str, StageConfig]:
    """Each service's StageConfig, found through its --config flag and its bind mounts."""
    compose = yaml.safe_load(compose_file.read_text())
    services = compose["services"]
    configs: dict[str, StageConfig] = {}
    for name, service in services.items():
        command = service["command"]
        command = command.split() if isinstance(command, str) else command
        assert command[0] == "serve", f"{name}: the image's entrypoint is skippy-stage; the command is serve"
        in_container = command[command.index("--config") + 1]
        mounts = {}
        for volume in service["volumes"]:
            # ${VAR:-default} as Compose reads it with VAR unset
            source, target, *_ = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", volume).split(":")
            mounts[target] = source
        assert in_container in mounts, f"{name}: {in_container} is not mounted"
        on_host = compose_file.parent / mounts[in_container]
        assert on_host.is_file(), f"{name}: {on_host} does not exist"
        assert "/models" in mounts, f"{name}: no model volume"
        config = load_config(on_host)
        assert config.stage_id == name, "peers reach the stage by its service name"
        check_token_required(config)
        # the token: a top-level file secret mounted where the config reads it
        targets = {}
        for secret in service.get("secrets", []):
            long = secret if isinstance(secret, dict) else {"source": secret}
            target = long.get("target", long["source"])
            targets[target if target.startswith("/") else f"/run/secrets/{target}"] = long["source"]
        assert config.auth_token_path in targets, f"{name}: no secret mounted at {config.auth_token_path}"
        assert "file" in compose["secrets"][targets[config.auth_token_path]], f"{name}: the token secret is a file"
        healthcheck = " ".join(service["healthcheck"]["test"])
        assert "grpc_health" in healthcheck and "SERVING" in healthcheck
        configs[name] = config
    for name, config in configs.items():
        if config.downstream is not None:
            below = config.downstream.stage_id
            assert below in services, f"{name}: downstream {below} is not a service"
            assert services[name]["depends_on"][below]["condition"] == "service_healthy"
        else:
            assert not services[name].get("depends_on"), "the final stage waits for nobody"
    check_chain(list(configs.values()))
    return configs


# --------------------------------------------------------------------------- Kubernetes


