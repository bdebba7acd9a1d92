"""``skippy-stage check`` and ``skippy-stage info``, run as an operator runs them: as commands.

``check`` exits 0 and prints the effective config as JSON (every default filled in, the
context size resolved) with the stage's quantization and the bytes its weights take on stderr
(equal to the stage file's tensors), or exits 2 with one line naming the field and the value.
``info`` prints what a bug report needs, the quantization types this build makes among it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from skippy_stage.model import host
from skippy_stage.model.chain import chain_configs
from skippy_stage.model.preflight import stage_memory
from skippy_stage.model.stage_file import resolve_stage_file


def skippy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", *args],
                          capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(config))
    return path


def seed_style(model: Path, **changes: object) -> dict:
    """Stage 1 of 0:10/10:20/20:30, as the seed writes a config (nulls, tcp:// endpoints)."""
    config = {
        "run_id": "r", "topology_id": "t", "model_id": "smollm2", "model_path": str(model), "package_ref": None,
        "stage_id": "stage-1", "stage_index": 1, "layer_start": 10, "layer_end": 20, "ctx_size": None,
        "lane_count": 4, "n_batch": None, "n_ubatch": None, "mmap": None, "repack": False, "kv_unified": None,
        "selected_device": {"backend_device": "CPU", "index": 0}, "native_mtp_enabled": False, "kv_cache": None,
        "load_mode": "runtime-slice", "bind_addr": "tcp://127.0.0.1:7001",
        "upstream": {"stage_id": "stage-0", "stage_index": 0, "endpoint": "tcp://127.0.0.1:7000"},
        "downstream": {"stage_id": "stage-2", "stage_index": 2, "endpoint": "tcp://127.0.0.1:7002"},
    }
    config.update(changes)
    return config


def test_check_prints_the_effective_config_with_defaults_filled_in(smollm2, tmp_path):
    done = skippy("check", "--config", str(write(tmp_path, seed_style(smollm2))))

    assert done.returncode == 0, done.stderr
    effective = json.loads(done.stdout)
    assert effective["ctx_size"] == 4 * 8192  # SmolLM2's training context for each of 4 lanes: ctx_size was null
    assert (effective["n_batch"], effective["kv_unified"], effective["repack"]) == (512, False, False)
    assert effective["bind_addr"] == "127.0.0.1:7001"
    assert effective["downstream"]["endpoint"] == "127.0.0.1:7002"
    assert effective["selected_device"] == "CPU"
    assert "training context" in done.stderr


@pytest.mark.parametrize(("changes", "named"), [
    ({"lane_count": 0}, "lane_count=0"),
    ({"package_ref": "hf://org/pkg"}, "package_ref='hf://org/pkg'"),
    ({"layer_end": 31}, "layer_end=31"),
    ({"selected_device": "CUDA9"}, "selected_device='CUDA9'"),
    ({"model_path": "/nowhere/model.gguf"}, "model_path='/nowhere/model.gguf'"),
    ({"split_mode": "diagonal"}, "split_mode='diagonal'"),
])
def test_check_exits_2_naming_the_field_and_value(smollm2, tmp_path, changes, named):
    done = skippy("check", "--config", str(write(tmp_path, seed_style(smollm2, **changes))))

    assert done.returncode == 2
    assert done.stdout == ""
    assert named in done.stderr and "stage-1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_check_refuses_repack_where_llama_cpp_would_crash(smollm2, tmp_path):
    done = skippy("check", "--config", str(write(tmp_path, seed_style(smollm2, repack=True))))

    if host.host_info().amx:
        assert done.returncode == 2 and "repack=true is refused" in done.stderr and "repack=false" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["repack"] is True


def test_info_json_has_what_a_bug_report_needs():
    done = skippy("info", "--json")

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["llama_cpp_python_version"] and report["skippy_stage_version"]
    assert report["system_info"].startswith("CPU :") or "CPU" in report["system_info"]
    assert report["cpu_model"]
    assert any(d["type"] == "cpu" for d in report["devices"])
    assert report["amx"] is host.host_info().amx
    policy = report["loader_policy"]
    assert policy["repack"]["default"] is False
    assert policy["repack"]["true_allowed"] is (not report["amx"])
    assert report["hidden_state_capture"].startswith("native")


def test_info_prints_a_readable_summary():
    done = skippy("info")

    assert done.returncode == 0, done.stderr
    for label in ("llama-cpp-python", "llama.cpp system", "CPU flags", "devices", "loader policy", "repack"):
        assert label in done.stdout


def test_check_names_the_stages_quantization_and_the_bytes_its_weights_take(smollm2, tmp_path):
    kept = skippy("check", "--config", str(write(tmp_path, seed_style(smollm2))))
    q8 = skippy("check", "--config", str(write(tmp_path, seed_style(smollm2, checkpoint_quantization="Q8_0"))))

    assert kept.returncode == 0 and q8.returncode == 0, kept.stderr + q8.stderr
    assert "quantization preserve (the GGUF's own types: Q4_1 x" in kept.stderr
    assert "quantization Q8_0 (requantized at start: Q8_0 x" in q8.stderr
    kept_bytes, q8_bytes = (int(re.search(r"weights (\d+) bytes", d.stderr)[1]) for d in (kept, q8))
    assert q8_bytes > kept_bytes
    assert json.loads(q8.stdout)["checkpoint_quantization"] == "Q8_0"


def test_checks_bytes_at_q8_0_are_the_tensors_of_the_stage_file_each_stage_writes(smollm2, slice_cache):
    for cfg in chain_configs(smollm2, [(0, 10), (10, 20), (20, 30)], slice_cache, checkpoint_quantization="Q8_0"):
        memory = stage_memory(cfg)
        path, _, _ = resolve_stage_file(cfg)
        reader = gguf.GGUFReader(path)
        held = sum(int(t.n_bytes) for t in reader.tensors)
        print(f"SmolLM2 {cfg.layer_start}:{cfg.layer_end} at Q8_0: check says {memory.weight_bytes} bytes, "
              f"the stage file holds {held} bytes of tensors ({path.stat().st_size} with its header)")
        assert memory.quantization == "Q8_0" and memory.weight_bytes == held
        assert 0 <= path.stat().st_size - memory.weight_bytes <= reader.data_offset


def test_info_lists_the_quantizations_this_build_makes_and_which_need_an_imatrix():
    done = skippy("info", "--json")

    assert done.returncode == 0, done.stderr
    types = {q["name"]: q["needs_imatrix"] for q in json.loads(done.stdout)["quantizations"]}
    assert types["preserve"] is False and types["Q4_K_M"] is False and types["Q8_0"] is False
    assert types["IQ2_XXS"] is True and types["IQ1_S"] is True


def test_check_refuses_a_projector_libmtmd_would_crash_on_naming_the_tensor(smollm2, tmp_path):
    """A head's projector is read before any weight loads: one without mm.2.weight (libmtmd would
    segfault) exits 2 naming the tensor; a good one passes."""
    from gguf import GGUFReader

    from skippy_stage.model import gguf_file
    from skippy_stage.model.projector_fixture import write_projector

    good = write_projector(smollm2, tmp_path / "mmproj.gguf", seed=1).path
    reader = GGUFReader(str(good))
    bad = tmp_path / "broken.gguf"
    gguf_file.write_gguf(bad, [(n, gguf_file.raw_value(f)) for n, f in reader.fields.items() if not n.startswith("GGUF.")],
                         [gguf_file.tensor_from_reader(reader, t, t.name) for t in reader.tensors
                          if t.name != "mm.2.weight"])
    head = seed_style(smollm2, stage_id="stage-0", stage_index=0, layer_start=0, layer_end=10, upstream=None,
                      downstream={"stage_id": "stage-1", "stage_index": 1, "endpoint": "tcp://127.0.0.1:7001"})
    done = skippy("check", "--config", str(write(tmp_path, {**head, "projector_path": str(bad)})))
    assert done.returncode == 2
    assert "stage-0" in done.stderr and "tensor mm.2.weight is missing" in done.stderr
    done = skippy("check", "--config", str(write(tmp_path, {**head, "projector_path": str(good)})))
    assert done.returncode == 0, done.stderr
