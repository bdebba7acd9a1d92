"""Deployment files: the Dockerfile, deploy/compose.yaml, deploy/k8s/ and the systemd unit.

Docker and a cluster are not available here, so the files are checked the way their tools
would read them: every Kubernetes manifest against the official schemas (strict, offline,
through ``kubernetes-validate``), every stage config through ``load_config``, the Compose
file and the chain it wires by parsing, and the health check the image runs against a real
gRPC health server. Every stage binds 0.0.0.0, so every config must pass the protected-mode check
``serve`` makes, with the chain's token mounted where the config reads it; no token is committed.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support.deploy import (
    CONFIG_FILES,
    DEPLOY,
    K8S_FILES,
    ROOT,
    by_kind,
    check_chain,
    check_stage_manifests,
    check_token_required,
    compose_service_configs,
    load_docs,
    validate_manifest,
)

from skippy_stage.config import SHARED_HOST_SPINCOUNT, load_config, shared_host_openmp
from skippy_stage.errors import ConfigError
from skippy_stage.model.packaged import SMOLLM2_FILE
from skippy_stage.model.slicing import read_model_info
from skippy_stage.ops.deploy import CONTAINER_TOKEN_PATH, health_probe
from skippy_stage.security import check_exposure


def test_k8s_has_one_file_per_stage() -> None:
    assert [p.name for p in K8S_FILES] == ["stage-0.yaml", "stage-1.yaml", "stage-2.yaml"]


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_k8s_manifests_match_the_kubernetes_schemas(path: Path) -> None:
    docs = load_docs(path)
    assert docs
    for doc in docs:
        validate_manifest(doc)


def test_schema_validation_catches_a_mistake() -> None:
    """The validator is strict: a misspelt field or a wrong type is refused."""
    service = by_kind(load_docs(K8S_FILES[0]))["Service"]
    misspelt = {**service, "spec": {**service["spec"], "portz": service["spec"]["ports"]}}
    with pytest.raises(AssertionError, match="portz"):
        validate_manifest(misspelt)
    deployment = by_kind(load_docs(K8S_FILES[0]))["Deployment"]
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(AssertionError, match="replicas"):
        validate_manifest(deployment)


def test_k8s_stages_are_wired_and_chained() -> None:
    configs = []
    for path in K8S_FILES:
        config = check_stage_manifests(load_docs(path))
        # The ConfigMap carries the same config as deploy/configs (one source of truth for both).
        assert config == load_config(DEPLOY / "configs" / f"{config.stage_id}.json")
        configs.append(config)
    check_chain(configs)


# --------------------------------------------------------------------------- stage configs


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_stage_config_under_deploy_loads(path: Path) -> None:
    config = load_config(path)
    assert config.bind_addr == "0.0.0.0:7000"
    assert config.frame_port == 7001, "the port the k8s Services forward as frames"
    check_token_required(config)
    assert config.auth_token_path == CONTAINER_TOKEN_PATH, "where Compose, Kubernetes and systemd mount the token"


def test_without_its_token_a_deploy_config_would_not_start() -> None:
    """What the token buys: ``serve`` refuses the same config with no credentials."""
    config = load_config(CONFIG_FILES[0]).replace(auth_token_path=None)
    with pytest.raises(ConfigError, match="auth_token_path"):
        check_exposure(config)


def test_no_token_is_committed() -> None:
    assert "deploy/token" in (ROOT / ".gitignore").read_text().splitlines()
    tracked = subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True, check=False)
    if tracked.returncode == 0:  # a git checkout
        assert "deploy/token" not in tracked.stdout.splitlines()
    for path in (DEPLOY / "compose.yaml", *K8S_FILES, DEPLOY / "systemd" / "skippy-stage@.service"):
        assert "secrets.token_urlsafe(32)" in path.read_text(), f"{path.name} says how to make the token"


def test_deploy_configs_split_smollm2_0_10_20_30(smollm2: Path) -> None:
    configs = [load_config(DEPLOY / "configs" / f"stage-{i}.json") for i in range(3)]
    assert [(c.layer_start, c.layer_end) for c in configs] == [(0, 10), (10, 20), (20, 30)]
    assert configs[-1].layer_end == read_model_info(smollm2).block_count
    assert {c.model_path for c in configs} == {f"/models/{SMOLLM2_FILE}"}
    check_chain(configs)


# --------------------------------------------------------------------------- Compose


def test_compose_runs_a_chained_three_stage_pipeline() -> None:
    configs = compose_service_configs(DEPLOY / "compose.yaml")
    assert sorted(configs) == ["stage-0", "stage-1", "stage-2"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert compose["services"]["stage-0"]["ports"] == ["7000:7000"], "the head is published"
    assert compose["services"]["stage-2"]["build"]["dockerfile"] == "Dockerfile"
    assert (DEPLOY / compose["services"]["stage-2"]["build"]["context"] / "Dockerfile").is_file()
    # all three stages share one host's cores
    assert {s["environment"]["GOMP_SPINCOUNT"] for s in compose["services"].values()} == {SHARED_HOST_SPINCOUNT}
    assert all(s["environment"] == shared_host_openmp({}) for s in compose["services"].values()), \
        "every stage shares the host's cores as a local pipeline's stages do"
    assert compose["secrets"] == {"skippy-token": {"file": "./token"}}, "deploy/token, made by the operator"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    lines = [ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln.strip() else "")
            for ln in text.splitlines() if ln.strip()]


def test_dockerfile_is_multi_stage_non_root_with_a_grpc_healthcheck() -> None:
    steps = dockerfile_instructions()
    froms = [args for op, args in steps if op == "FROM"]
    assert len(froms) >= 2 and any(" AS builder" in f for f in froms), "builder + runtime stages"
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime runs as a non-root user"
    assert not any("build-essential" in args for _, args in runtime), "no compiler in the runtime image"
    assert any(op == "RUN" and "--no-index" in args and "/wheels" in args for op, args in runtime), "wheels only"
    assert any(op == "EXPOSE" and {"7000", "7001"} <= set(args.split()) for op, args in runtime)
    (healthcheck,) = [args for op, args in steps if op == "HEALTHCHECK"]
    exec_form = json.loads(healthcheck[healthcheck.index("CMD") + 3:].strip())
    assert exec_form[:2] == ["python", "-c"]
    assert exec_form[2] == health_probe(7000), "the image runs the same check as the Compose files"
    assert ("ENTRYPOINT", '["skippy-stage"]') in steps
    assert ("CMD", '["serve", "--config", "/config/stage.json"]') in steps


def test_dockerfile_builds_portable_cpu_kernels_by_default() -> None:
    """An image built on an AVX-512 host must run on an AVX2 one: every CPU variant, chosen at start."""
    steps = dockerfile_instructions()
    runtime_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    (cmake_args,) = [args for op, args in steps[:runtime_from] if op == "ARG" and args.startswith("CMAKE_ARGS=")]
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"):
        assert flag in cmake_args
    builder_runs = " ".join(args for op, args in steps[:runtime_from] if op == "RUN")
    assert 'CMAKE_ARGS="${CMAKE_ARGS}" pip wheel' in builder_runs, "llama-cpp-python is built with them"
    runtime_runs = " ".join(args for op, args in steps[runtime_from:] if op == "RUN")
    assert "skippy-stage info" in runtime_runs, "the image proves at build time that a CPU backend loads"
    assert 'CMAKE_ARGS="-DGGML_NATIVE=ON"' in (ROOT / "Dockerfile").read_text(), "the native build is one flag away"


def test_compose_runs_the_images_health_check() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for service in compose["services"].values():
        assert service["healthcheck"]["test"] == ["CMD", "python", "-c", health_probe(7000)]


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(0)


def run_probe(port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", health_probe(port)], check=False, capture_output=True, text=True,
                          timeout=30)


def test_health_check_passes_only_on_serving(health_server) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    not_serving = run_probe(port)
    assert (not_serving.returncode, not_serving.stderr) == (1, ""), "a clean 'unhealthy', not a crash"
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run_probe(port).returncode == 0


def test_health_check_fails_when_nothing_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert run_probe(port).returncode != 0


# --------------------------------------------------------------------------- systemd


def test_systemd_unit_runs_one_stage_per_instance() -> None:
    unit: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd" / "skippy-stage@.service").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            unit.setdefault(key.strip(), []).append(value.strip())
    (exec_start,) = unit["ExecStart"]
    argv = exec_start.split()
    assert argv[0].endswith("skippy-stage") and argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == "/etc/skippy-stage/%i.json"
    assert unit["User"][0] not in ("root", "0")
    (bind,) = unit["BindReadOnlyPaths"]
    source, target = bind.split(":")
    assert source == "/etc/skippy-stage/token", "the file the operator installs"
    assert {load_config(p).auth_token_path for p in CONFIG_FILES} == {target}, "mounted where the configs read it"
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillSignal"] == ["SIGTERM"]
    grace = float(argv[argv.index("--grace") + 1]) if "--grace" in argv else 10.0
    (stop,) = unit["TimeoutStopSec"]
    assert grace < float(stop.rstrip("s")) <= grace + 30, "a bit above the drain grace"
