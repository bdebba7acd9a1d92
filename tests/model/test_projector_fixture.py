"""``make-projector`` writes a vision projector libmtmd loads beside SmolLM2, the same bytes for a seed;
``write_projector(kind="qwen2vl")`` one it loads beside a random-weight Qwen2-VL (M-RoPE) model.

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

from skippy_stage.model import synthetic
from skippy_stage.model.projector_fixture import MergerShape, ProjectorShape, write_projector

ARCHS = Path(__file__).resolve().parent.parent / "fixtures" / "archs.jsonl.gz"

# What every child script starts with: llama.cpp and libmtmd silent, MODEL (argv[1]) loaded, its n_embd.
CHILD_PREAMBLE = r"""import ctypes, json, sys
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
"""

# Loads MODEL and PROJECTOR, tokenizes a prompt with one image (raw RGB bytes, not the
# projector's size, so the preprocessor resizes it) at the default marker, encodes the image
# chunk twice and prints what came out as JSON.
ENCODE_ONE_IMAGE = CHILD_PREAMBLE + r"""
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


def test_make_projector_writes_the_qwen2vl_kind_when_asked(smollm2: Path, tmp_path: Path) -> None:
    out = tmp_path / "merger.gguf"
    result = skippy("make-projector", str(smollm2), "--out", str(out), "--kind", "qwen2vl")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{out}: {out.stat().st_size} bytes, a random-weight qwen2vl projector (seed 0); "
        f"an image's tokens depend on its size, 576 floats each (the text model's n_embd)"]
    assert GGUFReader(str(out)).fields["clip.projector_type"].contents() == "qwen2vl_merger"


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


# Loads an M-RoPE MODEL and a qwen2vl PROJECTOR, tokenizes a prompt with one 80x48 image, encodes
# it twice, and evaluates the whole prompt twice on fresh contexts: with mtmd_helper_eval_chunks,
# and by hand the way a head would (text chunks as token batches; the image's rows as one
# llama_batch of embeddings whose positions are section-major, 4 * n_rows of them, as
# mtmd-helper-common.h's set_position_mrope_2d lays them out: t, then y, then x, then z).
QWEN2VL_PROMPT = CHILD_PREAMBLE + r"""
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
params = mtmd.mtmd_context_params_default()
params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
ctx = mtmd.mtmd_init_from_file(projector_path.encode(), model, params)
out = {"loaded": bool(ctx)}
if not ctx:
    print(json.dumps(out))
    sys.exit(0)
out["mrope"] = bool(mtmd.mtmd_decode_use_mrope(ctx))
width, height = 80, 48
rgb = np.random.default_rng(123).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
bitmap = mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes()))
prompt = f"tok_1 tok_2 {mtmd.mtmd_default_marker().decode()} tok_3 tok_4".encode()
text = mtmd.mtmd_input_text()
text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
chunks = mtmd.mtmd_input_chunks_init()
assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
chunk_list = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
out["chunk_types"] = ["image" if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE else "text"
                      for c in chunk_list]
image = chunk_list[out["chunk_types"].index("image")]
image_tokens = mtmd.mtmd_input_chunk_get_tokens_image(image)
n_rows = mtmd.mtmd_input_chunk_get_n_tokens(image)
out["n_rows"], out["n_pos"] = n_rows, mtmd.mtmd_input_chunk_get_n_pos(image)
out["nx"], out["ny"] = mtmd.mtmd_image_tokens_get_nx(image_tokens), mtmd.mtmd_image_tokens_get_ny(image_tokens)

def encode():
    assert mtmd.mtmd_encode_chunk(ctx, image) == 0, "mtmd_encode_chunk failed"
    return np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n_rows * n_embd,)).copy().reshape(n_rows, n_embd)

rows, again = encode(), encode()
out["shape"] = list(rows.shape)
out["finite"] = bool(np.isfinite(rows).all())
out["nonzero"] = bool(np.abs(rows).max() > 0)
out["same_twice"] = bool(np.array_equal(rows, again))

def fresh_context():
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 128
    cparams.n_threads = cparams.n_threads_batch = 1
    return llama_cpp.llama_init_from_model(model, cparams)

def last_logits(lctx):
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,)).copy()

lctx = fresh_context()
n_past = llama_cpp.llama_pos(0)
out["eval_chunks_rc"] = mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 128, True, ctypes.byref(n_past))
out["eval_chunks_n_past"] = n_past.value
reference = last_logits(lctx)
llama_cpp.llama_free(lctx)

lctx = fresh_context()
pos0, out["positions"] = 0, []
for i, chunk in enumerate(chunk_list):
    last = i == len(chunk_list) - 1
    if out["chunk_types"][i] == "text":
        n = ctypes.c_size_t()
        ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        batch = llama_cpp.llama_batch_init(n.value, 0, 1)
        batch.n_tokens = n.value
        for k in range(n.value):
            batch.token[k], batch.pos[k], batch.n_seq_id[k] = ids[k], pos0 + k, 1
            batch.seq_id[k][0] = 0
            batch.logits[k] = last and k == n.value - 1
        assert llama_cpp.llama_decode(lctx, batch) == 0
        llama_cpp.llama_batch_free(batch)
        out["positions"].append(list(range(pos0, pos0 + n.value)))
    else:
        decoder_pos = (mtmd.mtmd_decoder_pos * n_rows)()
        mtmd.mtmd_helper_image_get_decoder_pos(image_tokens, pos0, decoder_pos)
        pos = np.array([[p.t for p in decoder_pos], [p.y for p in decoder_pos],
                        [p.x for p in decoder_pos], [p.z for p in decoder_pos]], dtype=np.int32)
        seq0 = (ctypes.c_int32 * 1)(0)
        batch = llama_cpp.llama_batch()
        batch.n_tokens, batch.token = n_rows, None
        batch.embd = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        batch.pos = pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # section-major: pos[j * n_rows + i]
        batch.n_seq_id = (ctypes.c_int32 * n_rows)(*[1] * n_rows)
        batch.seq_id = (ctypes.POINTER(ctypes.c_int32) * n_rows)(*[ctypes.cast(seq0, ctypes.POINTER(ctypes.c_int32))] * n_rows)
        batch.logits = (ctypes.c_int8 * n_rows)()
        assert llama_cpp.llama_decode(lctx, batch) == 0
        out["positions"].append(pos.tolist())
    pos0 += mtmd.mtmd_input_chunk_get_n_pos(chunk)
by_hand = last_logits(lctx)
out["finite_logits"] = bool(np.isfinite(reference).all())
out["bit_for_bit"] = bool(np.array_equal(reference.view(np.uint32), by_hand.view(np.uint32)))
llama_cpp.llama_free(lctx)
mtmd.mtmd_input_chunks_free(chunks)
mtmd.mtmd_bitmap_free(bitmap)
mtmd.mtmd_free(ctx)
llama_cpp.llama_model_free(model)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen2-VL text model: an M-RoPE decoder 256 wide."""
    spec = synthetic.load_specs(ARCHS)["qwen2vl-dense"]
    return synthetic.write_model(spec, tmp_path_factory.mktemp("qwen2vl") / "qwen2vl.gguf", seed=42)


@pytest.fixture(scope="module")
def merger(qwen2vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    written = write_projector(qwen2vl, tmp_path_factory.mktemp("merger") / "mmproj.gguf", seed=1, kind="qwen2vl")
    assert (written.kind, written.n_embd, written.n_image_tokens) == ("qwen2vl", 256, None)
    return written.path


@pytest.fixture(scope="module")
def qwen2vl_prompt(qwen2vl: Path, merger: Path) -> dict:
    child = subprocess.run([sys.executable, "-c", QWEN2VL_PROMPT, str(qwen2vl), str(merger)],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout)
    assert report["loaded"], "mtmd_init_from_file returned NULL"
    return report


def test_libmtmd_loads_the_qwen2vl_projector_beside_qwen2vl_and_encodes_80x48_pixels_into_5x3_rows(
        qwen2vl_prompt: dict) -> None:
    assert qwen2vl_prompt["mrope"]
    assert qwen2vl_prompt["chunk_types"] == ["text", "image", "text"]
    # 80x48 pixels in 8-pixel patches, every 2x2 patches one row: 5 across, 3 down.
    assert (qwen2vl_prompt["nx"], qwen2vl_prompt["ny"], qwen2vl_prompt["n_rows"]) == (5, 3, 15)
    assert qwen2vl_prompt["shape"] == [15, 256]
    assert qwen2vl_prompt["finite"] and qwen2vl_prompt["nonzero"]
    assert qwen2vl_prompt["same_twice"]


def test_the_image_takes_max_nx_ny_positions_and_its_rows_sit_on_a_2d_grid(qwen2vl_prompt: dict) -> None:
    before, image, after = qwen2vl_prompt["positions"]
    p = len(before)
    assert qwen2vl_prompt["n_pos"] == 5  # max(nx, ny), not the 15 rows
    assert image == [[p] * 15,  # t: the image's first position, for every row
                     [p + row for row in range(3) for _ in range(5)],  # y
                     [p + column for _ in range(3) for column in range(5)],  # x
                     [0] * 15]
    assert after[0] == p + 5
    assert qwen2vl_prompt["eval_chunks_n_past"] == after[-1] + 1


def test_image_rows_fed_by_hand_give_mtmd_helper_eval_chunks_logits_bit_for_bit(qwen2vl_prompt: dict) -> None:
    assert qwen2vl_prompt["eval_chunks_rc"] == 0
    assert qwen2vl_prompt["finite_logits"]
    assert qwen2vl_prompt["bit_for_bit"]


def test_the_qwen2vl_projector_is_the_same_bytes_for_a_seed_and_uint32_throughout(
        qwen2vl: Path, merger: Path, tmp_path: Path) -> None:
    assert digest(write_projector(qwen2vl, tmp_path / "again.gguf", seed=1, kind="qwen2vl").path) == digest(merger)
    assert digest(write_projector(qwen2vl, tmp_path / "other.gguf", seed=2, kind="qwen2vl").path) != digest(merger)
    reader = GGUFReader(merger)
    assert reader.fields["clip.projector_type"].contents() == "qwen2vl_merger"
    integer_types = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                     GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
    assert {name: field.types for name, field in reader.fields.items()
            if name.startswith("clip.") and field.types[0] in integer_types} == {
        name: [GGUFValueType.UINT32] for name in (
            "clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
            "clip.vision.feed_forward_length", "clip.vision.block_count", "clip.vision.projection_dim",
            "clip.vision.attention.head_count")}
    tensors = {t.name: [int(d) for d in t.shape] for t in reader.tensors}  # ggml ne
    assert tensors["v.patch_embd.weight"] == tensors["v.patch_embd.weight.1"] == [8, 8, 3, 64]
    assert "v.patch_embd.bias" not in tensors and "v.position_embd.weight" not in tensors
    assert tensors["mm.0.weight"] == [4 * 64, 256]  # a 2x2 block of patches in
    assert tensors["mm.2.bias"] == [256]  # the row width libmtmd checks against the model's


def test_a_shape_of_the_other_kind_or_an_unknown_kind_is_refused(qwen2vl: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not the shape of a qwen2vl projector"):
        write_projector(qwen2vl, tmp_path / "p.gguf", kind="qwen2vl", shape=ProjectorShape())
    with pytest.raises(ValueError, match="unknown projector kind 'llava'"):
        write_projector(qwen2vl, tmp_path / "p.gguf", kind="llava")
    with pytest.raises(ValueError, match="multiple of 4"):
        MergerShape(width=36, head_count=2)  # heads of 18
    assert list(tmp_path.iterdir()) == []
