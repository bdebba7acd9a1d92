"""The planner on the real SmolLM2 GGUF: byte accounting, splits by memory, refusals, written files.

SmolLM2-135M (llama, 30 layers, n_embd 576, 9 heads, 3 KV heads) has tied embeddings: no
``output.weight``, so every stage file carries the same non-layer tensors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import yaml
from support.deploy import (
    check_chain,
    check_stage_manifests,
    check_token_required,
    compose_service_configs,
    load_docs,
    validate_manifest,
)

from skippy_stage.cli.plan import add_plan_parser, cmd_plan
from skippy_stage.config import load_config
from skippy_stage.errors import PlanError
from skippy_stage.model.slicing import stage_file
from skippy_stage.ops.deploy import CONTAINER_TOKEN_PATH, DEFAULT_FRAME_PORT, write_plan
from skippy_stage.ops.footprint import GIB, MIB, ModelFootprint, format_bytes, kv_bytes_per_layer, read_footprint
from skippy_stage.ops.plan import NodeSpec, parse_nodes, plan_stages

N_LAYERS = 30
N_EMBD_KV = 3 * (576 // 9)  # head_count_kv x head size = 192


@pytest.fixture(scope="module")
def footprint(smollm2: Path) -> ModelFootprint:
    return read_footprint(smollm2)


@pytest.fixture(scope="module")
def reader(smollm2: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2, "r")


def nodes(text: str) -> list[NodeSpec]:
    return parse_nodes(text)


# --------------------------------------------------------------------------- reading the GGUF


def test_tensor_bytes_add_up_to_the_files_tensor_data(smollm2: Path, reader: gguf.GGUFReader,
                                                      footprint: ModelFootprint) -> None:
    # Sizes from shapes and ggml block sizes, independent of the reader's n_bytes.
    from_shapes = 0
    for tensor in reader.tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        from_shapes += int(tensor.n_elements) // block * type_size
    assert len(footprint.layer_weight_bytes) == N_LAYERS
    assert sum(footprint.layer_weight_bytes) + footprint.shared_bytes + footprint.output_bytes == from_shapes
    assert footprint.tensor_bytes == from_shapes
    # The tensor data section is those bytes plus at most one alignment pad per tensor.
    data_section = smollm2.stat().st_size - reader.data_offset
    assert 0 <= data_section - from_shapes < 32 * len(reader.tensors)


def test_non_layer_tensors_are_the_embeddings_and_the_final_norm(reader: gguf.GGUFReader,
                                                                footprint: ModelFootprint) -> None:
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert footprint.shared_bytes == sizes["token_embd.weight"] + sizes["output_norm.weight"]
    assert footprint.output_bytes == 0, "SmolLM2 ties its output head to the embeddings"
    assert footprint.layer_weight_bytes[7] == sum(v for k, v in sizes.items() if k.startswith("blk.7."))
    assert len(set(footprint.layer_weight_bytes)) == 1, "every SmolLM2 layer has the same tensors"
    assert footprint.n_embd_k == footprint.n_embd_v == (N_EMBD_KV,) * N_LAYERS


def test_a_stages_weight_bytes_are_its_slice_files_tensors(smollm2: Path, footprint: ModelFootprint,
                                                           slice_cache: Path) -> None:
    """What the planner charges a stage is exactly what the stage file it loads holds."""
    plan = plan_stages(footprint, nodes("a=1,b=1,c=1"))
    head = plan.stages[0]  # 0:10, the slice tests/test_slicing.py also builds
    path = stage_file(smollm2, head.layer_start, head.layer_end, final=False, cache_dir=slice_cache).path
    assert head.weight_bytes == sum(int(t.n_bytes) for t in gguf.GGUFReader(path, "r").tensors)


# --------------------------------------------------------------------------- KV cache


def test_kv_bytes_follow_the_formula(footprint: ModelFootprint) -> None:
    per_layer = kv_bytes_per_layer(footprint, 4096, 1, "f16")
    assert per_layer == (2 * 4096 * N_EMBD_KV * 2,) * N_LAYERS  # K and V, f16 = 2 bytes
    assert kv_bytes_per_layer(footprint, 4096, 1, "f32")[0] == 2 * per_layer[0]


def test_kv_bytes_grow_linearly_with_ctx_size_and_lanes(footprint: ModelFootprint) -> None:
    def total(ctx: int, lanes: int, cache_type: str = "f16") -> int:
        return sum(kv_bytes_per_layer(footprint, ctx, lanes, cache_type))

    base = total(1024, 2)
    assert total(2048, 2) == 2 * base
    assert total(4096, 2) == 4 * base
    assert total(1024, 6) == 3 * base
    assert total(3072, 8) == 12 * base


def test_quantised_kv_cache_is_smaller(footprint: ModelFootprint) -> None:
    f16 = sum(kv_bytes_per_layer(footprint, 4096, 4, "f16"))
    q8 = sum(kv_bytes_per_layer(footprint, 4096, 4, "q8_0"))
    q4 = sum(kv_bytes_per_layer(footprint, 4096, 4, "q4_0"))
    assert q4 < q8 < f16
    assert q8 * 64 == f16 * 34  # 34 bytes per 32 elements against 2 bytes per element


def test_plan_charges_the_kv_cache(footprint: ModelFootprint) -> None:
    small = plan_stages(footprint, nodes("a=2,b=2"), ctx_size=1024, lanes=1)
    large = plan_stages(footprint, nodes("a=2,b=2"), ctx_size=1024, lanes=8)
    assert sum(s.kv_bytes for s in large.stages) == 8 * sum(s.kv_bytes for s in small.stages)
    for stage in large.stages:
        assert stage.total_bytes == stage.weight_bytes + stage.kv_bytes + stage.overhead_bytes


# --------------------------------------------------------------------------- splitting


def test_three_equal_nodes_get_contiguous_thirds_in_order(footprint: ModelFootprint) -> None:
    plan = plan_stages(footprint, nodes("gpu-a=1,gpu-b=1,gpu-c=1"))
    assert [s.node for s in plan.stages] == ["gpu-a", "gpu-b", "gpu-c"]
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 10), (10, 20), (20, 30)]
    for stage in plan.stages:
        assert stage.total_bytes <= stage.budget_bytes == GIB
        assert stage.overhead_bytes == 512 * MIB


def test_every_split_is_contiguous_covers_every_layer_and_fits(footprint: ModelFootprint) -> None:
    for spec in ("a=0.6,b=3,c=0.7,d=1", "a=8", "a=0.6,b=0.6,c=0.6,d=0.6,e=0.6,f=0.6"):
        plan = plan_stages(footprint, nodes(spec), ctx_size=2048, lanes=2)
        ranges = [(s.layer_start, s.layer_end) for s in plan.stages]
        assert ranges[0][0] == 0 and ranges[-1][1] == N_LAYERS
        assert all(a_end == b_start for (_, a_end), (b_start, _) in itertools.pairwise(ranges))
        assert all(s.n_layers >= 1 and s.total_bytes <= s.budget_bytes for s in plan.stages)


def test_twice_the_memory_gets_about_twice_the_layers(footprint: ModelFootprint) -> None:
    # Without the fixed per-node overhead the layers follow the budgets.
    plan = plan_stages(footprint, nodes("small=1,big=2"), overhead_mib=0)
    small, big = plan.stages
    assert abs(big.n_layers - 2 * small.n_layers) <= 2, (small.n_layers, big.n_layers)
    # Fixed costs are paid first, so with them the bigger node's share only grows.
    small, big = plan_stages(footprint, nodes("small=1,big=2")).stages
    assert big.n_layers >= 2 * small.n_layers


def test_the_split_balances_free_room_not_layer_counts(footprint: ModelFootprint) -> None:
    plan = plan_stages(footprint, nodes("a=0.3,b=0.3,c=0.6"), overhead_mib=128)
    used = [(s.total_bytes - s.overhead_bytes - footprint.shared_bytes) / (s.budget_bytes - s.overhead_bytes
            - footprint.shared_bytes) for s in plan.stages]
    assert max(used) - min(used) < 0.1, used
    assert plan.stages[2].n_layers > plan.stages[0].n_layers + plan.stages[1].n_layers


def test_too_little_memory_is_refused_saying_by_how_much(footprint: ModelFootprint) -> None:
    specs = nodes("a=0.3,b=0.3,c=0.6")
    kv = sum(kv_bytes_per_layer(footprint, 4096, 4))
    need = sum(footprint.layer_weight_bytes) + kv + 3 * (footprint.shared_bytes + 512 * MIB)
    budgets = sum(n.budget_bytes for n in specs)
    with pytest.raises(PlanError) as caught:
        plan_stages(footprint, specs)
    message = str(caught.value)
    assert "does not fit" in message
    assert f"short by {format_bytes(need - budgets)}" in message
    assert "node a (0.3 GiB) cannot hold its fixed costs" in message and "node c" not in message


def test_a_node_too_small_for_one_layer_is_refused_even_when_the_sum_fits(footprint: ModelFootprint) -> None:
    with pytest.raises(PlanError, match=r"node tiny \(0.5 GiB\) cannot hold .* short by \d+\.\d MiB"):
        plan_stages(footprint, nodes("big=8,tiny=0.5"))


def test_a_split_that_only_fits_in_total_is_refused(footprint: ModelFootprint) -> None:
    """Budgets that add up but cannot be met in whole layers say which node overflows."""
    fixed = footprint.shared_bytes + 512 * MIB
    layer = footprint.layer_weight_bytes[0] + kv_bytes_per_layer(footprint, 4096, 4)[0]
    # Each node has room for 14.6 layers: 29.2 in all, but 30 layers in whole numbers do not fit.
    mem = (fixed + 14.6 * layer) / GIB
    with pytest.raises(PlanError, match=r"overcommits node|short by"):
        plan_stages(footprint, [NodeSpec("a", mem), NodeSpec("b", mem)])
    mem = (fixed + 15.2 * layer) / GIB
    a, b = plan_stages(footprint, [NodeSpec("a", mem), NodeSpec("b", mem)]).stages
    assert (a.n_layers, b.n_layers) == (15, 15)


def test_bad_nodes_are_refused(footprint: ModelFootprint) -> None:
    for text, why in [("a", "NAME=MEM_GIB"), ("a=lots", "not a number"), ("A_1=1", "DNS label"),
                      ("a=1,a=2", "twice"), ("a=0", "must be > 0")]:
        with pytest.raises(PlanError, match=why):
            parse_nodes(text)
    many = ",".join(f"n{i}=1" for i in range(N_LAYERS + 1))
    with pytest.raises(PlanError, match="at least one layer"):
        plan_stages(footprint, parse_nodes(many))
    with pytest.raises(PlanError, match="lanes"):
        plan_stages(footprint, nodes("a=1"), lanes=0)


# --------------------------------------------------------------------------- written files


@pytest.fixture(scope="module")
def written(footprint: ModelFootprint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    plan = plan_stages(footprint, nodes("gpu-a=1,gpu-b=1.5,gpu-c=1"), ctx_size=2048, lanes=8, cache_type="q8_0")
    out = tmp_path_factory.mktemp("plan")
    return out, write_plan(plan, out, "/models/SmolLM2-135M-Instruct.Q4_1.gguf", run_id="test-run")


def test_written_configs_load_and_chain(written: tuple[Path, list[Path]]) -> None:
    out, files = written
    configs = [load_config(out / "configs" / f"{name}.json") for name in ("gpu-a", "gpu-b", "gpu-c")]
    check_chain(configs)
    assert [c.stage_id for c in configs] == ["gpu-a", "gpu-b", "gpu-c"]
    assert configs[0].downstream.endpoint == "gpu-b:7000" and configs[2].upstream.endpoint == "gpu-b:7000"
    for config in configs:
        assert config.ctx_size == 2048 * 8, "ctx_size is the cell pool the lanes share"
        assert (config.lane_count, config.cache_type_k, config.cache_type_v) == (8, "q8_0", "q8_0")
        assert config.flash_attn_type == "enabled", "llama.cpp needs flash attention for a quantised V cache"
        assert config.bind_addr == "0.0.0.0:7000" and config.run_id == "test-run"
        assert config.frame_port == DEFAULT_FRAME_PORT == 7001, "a fixed frame listener a Service can forward"
        check_token_required(config)
        assert config.auth_token_path == CONTAINER_TOKEN_PATH
    assert configs[-1].layer_end == N_LAYERS
    assert {p.relative_to(out).as_posix() for p in files} == {
        "configs/gpu-a.json", "configs/gpu-b.json", "configs/gpu-c.json", "compose.yaml",
        "k8s/gpu-a.yaml", "k8s/gpu-b.yaml", "k8s/gpu-c.yaml", "token",
    }


def test_written_token_is_fresh_random_and_private(footprint: ModelFootprint, written: tuple[Path, list[Path]],
                                                   tmp_path: Path) -> None:
    out, _ = written
    token = (out / "token").read_text()
    assert stat.S_IMODE((out / "token").stat().st_mode) == 0o600
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}\n", token), "secrets.token_urlsafe(32)"
    plan = plan_stages(footprint, nodes("a=1,b=1"))
    files = write_plan(plan, tmp_path, "/models/m.gguf")
    assert (tmp_path / "token") in files and (tmp_path / "token").read_text() != token, "one token per plan"
    first = (tmp_path / "token").read_text()
    again = write_plan(plan, tmp_path, "/models/m.gguf")
    assert (tmp_path / "token") not in again, "a token the stages already hold is kept"
    assert (tmp_path / "token").read_text() == first


def test_written_compose_mounts_the_written_token(written: tuple[Path, list[Path]]) -> None:
    out, _ = written
    compose = yaml.safe_load((out / "compose.yaml").read_text())
    assert (out / compose["secrets"]["skippy-token"]["file"]).resolve() == (out / "token").resolve()
    k8s = (out / "k8s" / "gpu-a.yaml").read_text()
    assert f"kubectl create secret generic skippy-token --from-file=token={out / 'token'}" in k8s


def test_a_written_stage_config_passes_check_with_its_token_only(smollm2: Path, written: tuple[Path, list[Path]],
                                                                 tmp_path: Path) -> None:
    """``check`` refuses what ``serve`` refuses: the config as written, pointed at this host's files."""
    out, _ = written
    config = json.loads((out / "configs" / "gpu-a.json").read_text())
    config.update(model_path=str(smollm2), cache_dir=str(tmp_path / "cache"), auth_token_path=str(out / "token"))

    def check(changes: dict) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "stage.json"
        path.write_text(json.dumps({**config, **changes}))
        return subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", "check", "--config",
                               str(path)], capture_output=True, text=True, timeout=120)

    done = check({})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bind_addr"] == "0.0.0.0:7000"
    refused = check({"auth_token_path": None})
    assert refused.returncode == 2 and refused.stdout == ""
    assert "auth_token_path" in refused.stderr and "allow_insecure" in refused.stderr
    missing = check({"auth_token_path": str(tmp_path / "no-token")})
    assert missing.returncode == 2 and "cannot read auth token" in missing.stderr


def test_written_k8s_manifests_validate_and_chain(written: tuple[Path, list[Path]]) -> None:
    out, _ = written
    configs = []
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        docs = load_docs(out / "k8s" / f"{name}.yaml")
        for doc in docs:
            validate_manifest(doc)
        config = check_stage_manifests(docs)
        assert config == load_config(out / "configs" / f"{name}.json")
        configs.append(config)
    check_chain(configs)


def test_written_compose_chains_the_services(written: tuple[Path, list[Path]]) -> None:
    out, _ = written
    configs = compose_service_configs(out / "compose.yaml")
    assert list(configs) == ["gpu-a", "gpu-b", "gpu-c"]
    compose = yaml.safe_load((out / "compose.yaml").read_text())
    assert compose["services"]["gpu-a"]["ports"] == ["7000:7000"]
    assert compose["services"]["gpu-b"]["environment"] == {"GOMP_SPINCOUNT": "2000", "OMP_WAIT_POLICY": "active",
                                                              "OMP_PROC_BIND": "true",
                                                              "SKIPPY_OMP_PLACES_BY_STAGE": "1",
                                                              "SKIPPY_GGML_POLL": "0"}, \
        "one host's cores, shared"
    deployment = next(d for d in load_docs(out / "k8s" / "gpu-b.yaml") if d["kind"] == "Deployment")
    assert "env" not in deployment["spec"]["template"]["spec"]["containers"][0], "a node of its own: libgomp's default"


def test_memory_requests_follow_the_plan(footprint: ModelFootprint, written: tuple[Path, list[Path]]) -> None:
    out, _ = written
    deployment = next(d for d in load_docs(out / "k8s" / "gpu-b.yaml") if d["kind"] == "Deployment")
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    plan = plan_stages(footprint, nodes("gpu-a=1,gpu-b=1.5,gpu-c=1"), ctx_size=2048, lanes=8, cache_type="q8_0")
    assert resources["requests"]["memory"] == f"{-(-plan.stages[1].total_bytes // MIB)}Mi"
    assert resources["limits"]["memory"] == f"{int(1.5 * 1024)}Mi"


# --------------------------------------------------------------------------- the command


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="skippy-stage")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_plan_command_prints_the_table_and_writes_files(smollm2: Path, tmp_path: Path, capsys) -> None:
    args = parse(["plan", "--model", str(smollm2), "--nodes", "a=1,b=1,c=1", "--ctx-size", "2048",
                  "--lanes", "2", "--out", str(tmp_path)])
    assert args.func(args) == 0 and args.func is cmd_plan
    table, said = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert [rows[n][1] for n in ("a", "b", "c", "all")] == ["0:10", "10:20", "20:30", "0:30"]
    assert re.search(r"ctx 2048/lane x 2 lanes, KV cache f16, overhead 512 MiB/node", table)
    assert rows["a"][-1].endswith("%") and float(rows["a"][-2]) == 1024.0  # budget MiB
    config = json.loads((tmp_path / "configs" / "a.json").read_text())
    assert config["model_path"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (tmp_path / "compose.yaml").is_file() and (tmp_path / "k8s" / "c.yaml").is_file()
    assert f"kubectl create secret generic skippy-token --from-file=token={tmp_path / 'token'}" in said, \
        "how to load the new token into the cluster"
    assert args.func(args) == 0
    assert f"kept the chain's bearer token already in {tmp_path / 'token'}" in capsys.readouterr().err


def test_plan_command_frame_port_reaches_configs_and_manifests(smollm2: Path, tmp_path: Path, capsys) -> None:
    args = parse(["plan", "--model", str(smollm2), "--nodes", "a=1,b=1", "--port", "7100", "--frame-port", "7205",
                  "--out", str(tmp_path)])
    assert args.frame_port == 7205 and args.func(args) == 0
    capsys.readouterr()
    for name in ("a", "b"):
        config = load_config(tmp_path / "configs" / f"{name}.json")
        assert (config.frame_port, config.bind_addr) == (7205, "0.0.0.0:7100")
        docs = load_docs(tmp_path / "k8s" / f"{name}.yaml")
        for doc in docs:
            validate_manifest(doc)
        assert check_stage_manifests(docs, port=7100, frame_port=7205) == config
    assert parse(["plan", "--model", str(smollm2), "--nodes", "a=1"]).frame_port == DEFAULT_FRAME_PORT


def test_plan_refuses_a_frame_port_that_clashes(footprint: ModelFootprint, tmp_path: Path) -> None:
    plan = plan_stages(footprint, nodes("a=1,b=1"))
    for kwargs in ({"frame_port": 7000}, {"frame_port": 9100}, {"port": 7001}):
        with pytest.raises(PlanError, match="frame port"):
            write_plan(plan, tmp_path, "/models/m.gguf", **kwargs)
    assert not any(tmp_path.iterdir()), "nothing is written for a clash"


def test_plan_command_refuses_what_does_not_fit(smollm2: Path, tmp_path: Path) -> None:
    args = parse(["plan", "--model", str(smollm2), "--nodes", "a=0.3,b=0.3,c=0.6", "--out", str(tmp_path)])
    with pytest.raises(PlanError, match="short by"):
        args.func(args)
    assert not any(tmp_path.iterdir()), "nothing is written for a refused plan"
