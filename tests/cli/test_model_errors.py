"""A model problem is one line, never a traceback: ``slice``, ``verify``, ``check`` and ``serve``.

Each broken file below is a small llama model with one fault a real file can have (not GGUF
at all, cut short, a key of the wrong type or length, a key missing). The commands run as an
operator runs them; each must exit 2 with a single line on stderr that names the file, the key
(where one is at fault) and what is wrong with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from skippy_stage.cli.local import free_ports
from skippy_stage.model import gguf_file

T = GGUFValueType


def model(path: Path, **changes: bytes | None) -> Path:
    """A 4-block llama whose metadata ``changes`` replace (None drops the key)."""
    metadata = {
        "general.architecture": gguf_file.pack_value(T.STRING, "llama"),
        "llama.block_count": gguf_file.pack_value(T.UINT32, 4),
        "llama.embedding_length": gguf_file.pack_value(T.UINT32, 8),
        "llama.attention.head_count": gguf_file.pack_value(T.UINT32, 2),
        "tokenizer.ggml.merges": gguf_file.pack_value(T.ARRAY, [], T.STRING),
    }
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    f32 = GGMLQuantizationType.F32
    tensors = [gguf_file.tensor_from_array("token_embd.weight", np.zeros((4, 8), np.float32), f32)]
    tensors += [gguf_file.tensor_from_array(f"blk.{i}.attn_norm.weight", np.ones(8, np.float32), f32) for i in range(4)]
    gguf_file.write_gguf(path, list(metadata.items()), tensors)
    return path


def truncated(path: Path) -> Path:
    data = model(path).read_bytes()
    path.write_bytes(data[:100])  # inside the key/values
    return path


# name -> (how to make the file, what the line must name besides the file)
BROKEN = {
    "not-gguf": (lambda p: (p.write_text("not a model"), p)[1], ["is not a readable GGUF"]),
    "cut-short": (truncated, ["is not a readable GGUF"]),
    "block-count-a-string": (lambda p: model(p, llama__block_count=gguf_file.pack_value(T.STRING, "four")),
                             ["llama.block_count", "'four'", "not a positive integer"]),
    "no-embedding-length": (lambda p: model(p, llama__embedding_length=None),
                            ["llama.embedding_length", "missing"]),
    "heads-per-layer-too-short": (lambda p: model(p, llama__attention__head_count=gguf_file.pack_value(
        T.ARRAY, [2, 2, 2], T.UINT32)), ["llama.attention.head_count", "3 values for 4 blocks"]),
    "no-architecture": (lambda p: model(p, general__architecture=None), ["general.architecture", "missing"]),
}


def skippy(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", *args],
                          capture_output=True, text=True, timeout=timeout)


def stage_config(tmp_path: Path, model_path: Path) -> Path:
    port = free_ports("127.0.0.1", 1)[0]
    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"model_path": str(model_path), "stage_id": "stage-0", "stage_index": 0,
                                "layer_start": 0, "layer_end": 2, "bind_addr": f"127.0.0.1:{port}",
                                "downstream": {"stage_id": "stage-1", "stage_index": 1,
                                               "endpoint": f"127.0.0.1:{port + 1}"},
                                "cache_dir": str(tmp_path / "cache"), "n_threads": 1, "ctx_size": 64}))
    return path


def command(name: str, path: Path, tmp_path: Path) -> list[str]:
    if name == "slice":
        return ["slice", str(path), "--layers", "0:2"]
    if name == "verify":
        return ["verify", str(path), "--layers", "0:2,2:4", "--tokens", "4"]
    return [name, "--config", str(stage_config(tmp_path, path))]


@pytest.mark.parametrize("command_name", ["slice", "verify", "check", "serve"])
@pytest.mark.parametrize("fault", sorted(BROKEN))
def test_a_broken_model_is_one_line_naming_file_and_key(tmp_path: Path, fault: str, command_name: str) -> None:
    make, named = BROKEN[fault]
    path = make(tmp_path / f"{fault}.gguf")

    done = skippy(*command(command_name, path, tmp_path))

    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"skippy-stage {command_name}: error:")
    assert str(path) in lines[0]
    for words in named:
        assert words in lines[0]


@pytest.mark.parametrize("command_name", ["slice", "verify"])
def test_a_model_whose_tensor_data_is_cut_short_is_one_line_naming_the_file(tmp_path: Path, command_name: str) -> None:
    path = model(tmp_path / "short.gguf")
    path.write_bytes(path.read_bytes()[:-40])  # the header is whole, the last tensor is not

    done = skippy(*command(command_name, path, tmp_path))

    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert str(path) in done.stderr
