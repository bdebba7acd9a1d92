"""``make-projector`` writes a vision projector libmtmd loads beside SmolLM2, the same bytes for a seed.

No vision GGUF ships on PyPI, so the multimodal tests stand on this fixture; these tests hold it
to what libmtmd needs. libmtmd runs in a child process: a projector it dislikes can abort or
segfault the process rather than return an error.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType

from skippy_stage.model.projector_fixture import ProjectorShape, write_projector

# Loads MODEL and PROJECTOR, tokenizes a prompt with one image (raw RGB bytes, not the
# projector's size, so the preprocessor resizes it) at the default marker, encodes the image
# chunk twice and prints what came out as JSON.
ENCODE_ONE_IMAGE = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
import llama_cpp.mtmd_cpp as mtmd

@llama_cpp.llama_log_callback
def silent(level, text, user_data):
    pass

llama_cpp.llama_log_set(silent, ctypes.c_void_p(0))
mtmd.mtmd_helper_log_set(silent, ctypes.c_void_p(0))
model_path, projector_path = sys.argv[1], sys.argv[2]
model_params = llama_cpp.llama_model_default_params()
model_params.n_gpu_layers = 0
model = llama_cpp.llama_model_load_from_file(model_path.encode(), model_params)
assert model, "model load failed"
n_embd = llama_cpp.llama_model_n_embd_inp(model)
params = mtmd.mtmd_context_params_default()
params.use_gpu = False
params.n_threads = 1
params.print_timings = False
params.warmup = False
ctx = mtmd.mtmd_init_from_file(projector_path.encode(), model, params)
out = {"loaded": bool(ctx), "n_embd": n_embd}
if ctx:
    out["vision"] = bool(mtmd.mtmd_support_vision(ctx))
    width, height = 80, 48
    rgb = np.random.default_rng(123).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes()))
    prompt = f"<|im_start|>user\nWhat is this? {mtmd.mtmd_default_marker().decode()}<|im_end|>\n".encode()
    text = mtmd.mtmd_input_text()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
    chunks = mtmd.mtmd_input_chunks_init()
    out["tokenize_rc"] = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
    images = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
    images = [c for c in images if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
    out["n_images"] = len(images)
    encodings = []
    for _ in range(2):
        assert mtmd.mtmd_encode_chunk(ctx, images[0]) == 0, "mtmd_encode_chunk failed"
        n = mtmd.mtmd_input_chunk_get_n_tokens(images[0])
        rows = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * n_embd,)).copy().reshape(n, n_embd)
        encodings.append(rows)
    out["shape"] = list(encodings[0].shape)
    out["finite"] = bool(np.isfinite(encodings[0]).all())
    out["nonzero"] = bool(np.abs(encodings[0]).max() > 0)
    out["same_twice"] = bool(np.array_equal(encodings[0], encodings[1]))
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
llama_cpp.llama_model_free(model)
print(json.dumps(out))
"""


def skippy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", *args],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def projector(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("projector") / "proj.gguf"
    result = skippy("make-projector", str(smollm2), "--out", str(out), "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{out}: {out.stat().st_size} bytes, a random-weight mlp projector (seed 1); "
        f"16 image tokens per image, 576 floats each (the text model's n_embd)"]
    return out


def test_libmtmd_loads_it_beside_smollm2_and_encodes_one_image_into_16_rows_of_576(
        smollm2: Path, projector: Path) -> None:
    child = subprocess.run([sys.executable, "-c", ENCODE_ONE_IMAGE, str(smollm2), str(projector)],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout)
    assert report["loaded"], "mtmd_init_from_file returned NULL"
    assert report["vision"]
    assert report["tokenize_rc"] == 0
    assert report["n_images"] == 1
    assert report["shape"] == [16, 576]
    assert report["finite"] and report["nonzero"]
    assert report["same_twice"]


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_bytes(
        smollm2: Path, projector: Path, tmp_path: Path) -> None:
    again = write_projector(smollm2, tmp_path / "again.gguf", seed=1)
    other = write_projector(smollm2, tmp_path / "other.gguf", seed=2)
    assert digest(again.path) == digest(projector)
    assert digest(other.path) != digest(projector)
    assert other.n_bytes == again.n_bytes == projector.stat().st_size


def test_every_integer_key_is_uint32_and_the_width_is_the_models(projector: Path) -> None:
    fields = GGUFReader(projector).fields
    integer_types = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                     GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
    clip_integers = {name: field.types for name, field in fields.items()
                     if name.startswith("clip.") and field.types[0] in integer_types}
    assert clip_integers == {name: [GGUFValueType.UINT32] for name in (
        "clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
        "clip.vision.feed_forward_length", "clip.vision.block_count", "clip.vision.projection_dim",
        "clip.vision.attention.head_count")}
    assert fields["clip.vision.projection_dim"].contents() == 576
    assert fields["clip.vision.block_count"].contents() >= 2
    assert fields["clip.vision.feed_forward_length"].contents() != fields["clip.vision.embedding_length"].contents()
    assert fields["clip.vision.image_mean"].contents() == fields["clip.vision.image_std"].contents() == [0.5] * 3
    reader = GGUFReader(projector)
    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert tensors["mm.2.weight"] == [128, 576]  # ggml ne: hidden in, the model's n_embd out
    assert "v.position_embd.weight" in tensors


def test_a_shape_libmtmd_would_misread_is_refused() -> None:
    with pytest.raises(ValueError, match="swap"):
        ProjectorShape(width=64, feed_forward=64)
    with pytest.raises(ValueError, match="at least 2"):
        ProjectorShape(block_count=1)


@pytest.mark.parametrize(("model", "message"), [
    ("missing.gguf", "model file not found: {model}"),
    ("not-a-gguf.bin", "model file {model} is not a readable GGUF: missing GGUF magic"),
])
def test_a_bad_model_file_is_one_line_and_writes_nothing(tmp_path: Path, model: str, message: str) -> None:
    path = tmp_path / model
    if model.endswith(".bin"):
        path.write_bytes(b"not a gguf" * 100)
    out = tmp_path / "proj.gguf"
    result = skippy("make-projector", str(path), "--out", str(out))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"skippy-stage make-projector: error: {message.format(model=path)}"]
    assert list(tmp_path.iterdir()) == ([path] if path.exists() else [])


def test_an_unwritable_output_is_one_line(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "no-such-dir" / "proj.gguf"
    result = skippy("make-projector", str(smollm2), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"skippy-stage make-projector: error: cannot write {out}: No such file or directory"]
