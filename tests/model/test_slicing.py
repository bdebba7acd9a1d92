"""Slicing: the GGUF file that holds one stage's layer range, and its cache.

Uses the real SmolLM2 (llama, 30 blocks) and Gemma-3-270M files. Building a SmolLM2 slice
takes a few seconds and a Gemma-3 one more, so slices that several tests only read come
from the session ``slice_cache``; a test that damages or counts builds gets a fresh dir.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from skippy_stage.errors import ConfigError, UnsupportedModelError
from skippy_stage.model import gguf_file
from skippy_stage.model.slicing import (
    MANIFEST_SUFFIX,
    StageFile,
    read_model_info,
    slice_metadata,
    stage_file,
    write_slice,
)

INNER = (0, 10)  # SmolLM2 head slice shared by the read-only tests


@pytest.fixture(scope="module")
def inner_slice(smollm2: Path, slice_cache: Path) -> Path:
    """SmolLM2 layers 0:10, not final, from the session cache."""
    return stage_file(smollm2, *INNER, final=False, cache_dir=slice_cache).path


@pytest.fixture(scope="module")
def source_reader(smollm2: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2)


@pytest.fixture(scope="module")
def inner_reader(inner_slice: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(inner_slice)


def copy_cached(stage: Path, cache_dir: Path) -> Path:
    """Copy a cached stage file and its manifest into another cache dir, under the same name."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest = stage.with_name(stage.name + MANIFEST_SUFFIX)
    shutil.copyfile(manifest, cache_dir / manifest.name)
    return Path(shutil.copyfile(stage, cache_dir / stage.name))


def tiny_gguf(path: Path, arch: str, *, n_blocks: int = 4, output: bool = True) -> Path:
    """A few-hundred-byte GGUF: per-layer ``feed_forward_length`` and block tensors filled with their index."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(n_blocks)
    writer.add_embedding_length(8)
    writer.add_array(f"{arch}.feed_forward_length", [100 + i for i in range(n_blocks)])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    for i in range(n_blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.full(8, i, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    if output:
        writer.add_tensor("output.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_bool_array(path: Path, key: str) -> list[bool]:
    """One BOOL-array metadata value, found by its length-prefixed key.

    GGUFReader would materialise Gemma-3's 262k vocabulary strings (over ten seconds);
    a GGUF key is stored as <u64 length><bytes>, followed by <u32 type=ARRAY>
    <u32 item type=BOOL><u64 count> and one byte per item.
    """
    needle = struct.pack("<Q", len(key)) + key.encode()
    with path.open("rb") as f:
        data = f.read(32 << 20)
    at = data.index(needle) + len(needle)
    vtype, sub, count = struct.unpack_from("<IIQ", data, at)
    assert (vtype, sub) == (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    start = at + 16
    return [bool(b) for b in data[start : start + count]]


# -- model info --------------------------------------------------------------------------


def test_read_model_info_of_smollm2(smollm2: Path) -> None:
    info = read_model_info(smollm2)

    assert info.architecture == "llama"
    assert info.block_count == 30
    assert info.n_embd == 576
    assert info.n_vocab == 49152
    assert info.path == smollm2


def test_read_model_info_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_model_info(tmp_path / "absent.gguf")


def test_read_model_info_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("definitely not a model")

    with pytest.raises(ConfigError, match="notes.gguf is not a readable GGUF"):
        read_model_info(path)


# -- the stage file cache -------------------------------------------------------------------


def test_stage_file_builds_once_then_reuses(smollm2: Path, tmp_path: Path) -> None:
    first = stage_file(smollm2, 10, 20, final=False, cache_dir=tmp_path)
    second = stage_file(smollm2, 10, 20, final=False, cache_dir=tmp_path)

    assert first.built is True
    assert second.built is False
    assert second.path == first.path
    assert first.path.parent == tmp_path
    assert first.path.with_name(first.path.name + MANIFEST_SUFFIX).is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_cached_file_is_found_by_name_in_any_cache_dir(inner_slice: Path, smollm2: Path, tmp_path: Path) -> None:
    copy = copy_cached(inner_slice, tmp_path)

    result = stage_file(smollm2, *INNER, final=False, cache_dir=tmp_path)

    assert result == StageFile(path=copy, built=False, seconds=result.seconds)


def test_truncated_cached_file_is_rebuilt_intact(inner_slice: Path, smollm2: Path, tmp_path: Path) -> None:
    copy = copy_cached(inner_slice, tmp_path)
    size = copy.stat().st_size
    with copy.open("r+b") as f:
        f.truncate(size // 2)

    result = stage_file(smollm2, *INNER, final=False, cache_dir=tmp_path)

    assert result.built is True
    assert result.path == copy
    assert result.path.stat().st_size == size
    assert filecmp.cmp(result.path, inner_slice, shallow=False)


def test_corrupted_cached_file_of_the_same_size_is_rebuilt(inner_slice: Path, smollm2: Path, tmp_path: Path) -> None:
    copy = copy_cached(inner_slice, tmp_path)
    size = copy.stat().st_size
    with copy.open("r+b") as f:
        f.seek(size // 2)
        original = f.read(64)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in original))
    assert copy.stat().st_size == size

    result = stage_file(smollm2, *INNER, final=False, cache_dir=tmp_path)

    assert result.built is True
    assert filecmp.cmp(result.path, inner_slice, shallow=False)


def test_manifest_records_size_and_range(inner_slice: Path) -> None:
    manifest = json.loads(inner_slice.with_name(inner_slice.name + MANIFEST_SUFFIX).read_text())

    assert manifest["size"] == inner_slice.stat().st_size
    assert (manifest["layer_start"], manifest["layer_end"], manifest["final"]) == (*INNER, False)
    assert len(manifest["sha256"]) == 64


def test_whole_model_final_range_is_the_source_itself(smollm2: Path, tmp_path: Path) -> None:
    result = stage_file(smollm2, 0, 30, final=True, cache_dir=tmp_path / "cache")

    assert result.path == smollm2
    assert result.built is False
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("start", "end"), [(0, 31), (25, 40), (10, 10), (12, 5), (-1, 3)])
def test_range_outside_the_model_is_refused(smollm2: Path, tmp_path: Path, start: int, end: int) -> None:
    with pytest.raises(ConfigError) as info:
        stage_file(smollm2, start, end, final=False, cache_dir=tmp_path)

    assert f"{start}:{end}" in str(info.value)
    assert "30 blocks" in str(info.value)
    assert list(tmp_path.iterdir()) == []


# -- what a slice contains ---------------------------------------------------------------------


def test_slice_header_has_the_ranges_block_count(inner_reader: gguf.GGUFReader, inner_slice: Path) -> None:
    assert inner_reader.get_field("llama.block_count").contents() == 10
    assert read_model_info(inner_slice).block_count == 10
    assert read_model_info(inner_slice).n_embd == 576


def test_slice_holds_its_blocks_renumbered_and_the_shared_tensors(inner_reader: gguf.GGUFReader) -> None:
    names = {t.name for t in inner_reader.tensors}
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blk.")}

    assert blocks == set(range(10))
    assert "token_embd.weight" in names
    assert "output_norm.weight" in names
    assert "output.weight" not in names


def test_smollm2_has_no_output_head_of_its_own(source_reader: gguf.GGUFReader) -> None:
    # SmolLM2 ties its output head to the embeddings, so no slice of it can carry one.
    names = {t.name for t in source_reader.tensors}

    assert "output.weight" not in names
    assert "token_embd.weight" in names


def test_slice_tensor_bytes_are_copied_verbatim(source_reader: gguf.GGUFReader, inner_reader: gguf.GGUFReader) -> None:
    source = {t.name: t for t in source_reader.tensors}
    for tensor in inner_reader.tensors:
        original = source[tensor.name]  # 0:10 keeps every block's number
        assert tensor.tensor_type == original.tensor_type
        assert np.array_equal(tensor.data, original.data), tensor.name


def test_slice_records_where_it_came_from(inner_slice: Path, smollm2: Path) -> None:
    assert slice_metadata(inner_slice) == {"layer_start": 0, "layer_end": 10, "source_block_count": 30, "final": False}
    assert slice_metadata(smollm2) is None


def test_inner_slice_renumbers_blocks_and_slices_per_layer_arrays(tmp_path: Path) -> None:
    source = tiny_gguf(tmp_path / "tiny.gguf", "llama", n_blocks=4)

    path = stage_file(source, 1, 3, final=False, cache_dir=tmp_path / "cache").path
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    assert reader.get_field("llama.block_count").contents() == 2
    assert reader.get_field("llama.feed_forward_length").contents() == [101, 102]
    assert sorted(tensors) == [
        "blk.0.attn_norm.weight",
        "blk.1.attn_norm.weight",
        "output_norm.weight",
        "token_embd.weight",
    ]
    assert tensors["blk.0.attn_norm.weight"].data.tolist() == [1.0] * 8  # was blk.1
    assert tensors["blk.1.attn_norm.weight"].data.tolist() == [2.0] * 8  # was blk.2


def test_only_the_final_slice_keeps_the_output_head(tmp_path: Path) -> None:
    source = tiny_gguf(tmp_path / "tiny.gguf", "llama", n_blocks=4)

    inner = stage_file(source, 2, 4, final=False, cache_dir=tmp_path / "cache").path
    final = stage_file(source, 2, 4, final=True, cache_dir=tmp_path / "cache").path

    assert inner != final
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(inner).tensors}
    assert "output.weight" in {t.name for t in gguf.GGUFReader(final).tensors}
    assert slice_metadata(final)["final"] is True


def test_gemma3_slice_carries_the_original_sliding_window_layers(gemma3: Path, slice_cache: Path) -> None:
    path = stage_file(gemma3, 5, 11, final=False, cache_dir=slice_cache).path

    pattern = read_bool_array(path, "gemma3.attention.sliding_window_pattern")

    assert pattern == [il % 6 < 5 for il in range(5, 11)]
    assert pattern == [False, True, True, True, True, True]  # layer 5 is global, 6..10 sliding
    assert read_model_info(path).block_count == 6


# -- refused models ------------------------------------------------------------------------------


def test_unproven_architecture_is_refused_by_name(tmp_path: Path) -> None:
    source = tiny_gguf(tmp_path / "unheard.gguf", "unheard-of", n_blocks=2)
    cache = tmp_path / "cache"

    with pytest.raises(UnsupportedModelError) as info:
        stage_file(source, 0, 1, final=False, cache_dir=cache)

    assert "'unheard-of' is refused: no skippy-stage verify run proves" in str(info.value)
    assert not cache.exists()
    with pytest.raises(UnsupportedModelError, match="'unheard-of'"):
        write_slice(source, tmp_path / "out.gguf", 0, 1, final=False)


# -- every GGUF value type, as llama.cpp reads them ----------------------------------------------

T = gguf.GGUFValueType
SCALARS = {
    T.UINT8: 200, T.INT8: -100, T.UINT16: 60000, T.INT16: -30000, T.UINT32: 4_000_000_000, T.INT32: -2_000_000_000,
    T.FLOAT32: 0.1, T.BOOL: True, T.STRING: "żółw \U0001f422", T.UINT64: 2**63 + 5, T.INT64: -(2**62), T.FLOAT64: 1e-300,
}
ARRAYS = {
    T.UINT8: [0, 255], T.INT8: [-128, 127], T.UINT16: [1, 65535], T.INT16: [-32768, 7], T.UINT32: [1, 2**32 - 1],
    T.INT32: [-(2**31), 5], T.FLOAT32: [0.1, -2.5], T.BOOL: [True, False], T.STRING: ["a", "", "ü"],
    T.UINT64: [2**64 - 1], T.INT64: [-(2**63)], T.FLOAT64: [0.1, float("inf")],
}
# key -> (value type, item type, value): a scalar of each of the 12 types and the string, an array
# of each, and an empty array of each (llama.cpp's own saver writes ``tokenizer.ggml.merges = []``).
TYPED_KEYS = {
    **{f"test.scalar.{t.name.lower()}": (t, None, v) for t, v in SCALARS.items()},
    **{f"test.array.{t.name.lower()}": (T.ARRAY, t, v) for t, v in ARRAYS.items()},
    **{f"test.empty.{t.name.lower()}": (T.ARRAY, t, []) for t in ARRAYS},
}


# ``{arch}.*`` arrays of one value per block, of each item type: a slice keeps its blocks' values.
PER_LAYER = {f"llama.test_per_layer.{t.name.lower()}": (t, (v * 4)[:4]) for t, v in ARRAYS.items()}


def read_typed(field: gguf.ReaderField) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None, object]:
    """(type, item type, value) as gguf-py's reader sees them; the item type from the file's own
    bytes, since the reader's ``types`` has none for an empty array."""
    vtype = T(field.types[0])
    if vtype != T.ARRAY:
        return vtype, None, field.contents()
    return vtype, T(int(field.parts[3][0])), field.contents()


@pytest.fixture(scope="module")
def typed_slice(tmp_path_factory: pytest.TempPathFactory) -> tuple[gguf.GGUFReader, gguf.GGUFReader]:
    """A 4-block model carrying every typed key, and its slice 1:3 (through ``stage_file``)."""
    directory = tmp_path_factory.mktemp("typed")
    source = directory / "typed.gguf"
    order = "<"
    metadata = [("general.architecture", gguf_file.pack_value(T.STRING, "llama")),
                ("llama.block_count", gguf_file.pack_value(T.UINT32, 4)),
                ("llama.embedding_length", gguf_file.pack_value(T.UINT32, 8))]
    metadata += [(key, gguf_file.pack_value(vtype, value, sub, order=order)) for key, (vtype, sub, value) in TYPED_KEYS.items()]
    metadata += [(key, gguf_file.pack_value(T.ARRAY, value, sub, order=order)) for key, (sub, value) in PER_LAYER.items()]
    tensors = [gguf_file.tensor_from_array("token_embd.weight", np.zeros((4, 8), np.float32), gguf.GGMLQuantizationType.F32)]
    tensors += [gguf_file.tensor_from_array(f"blk.{i}.attn_norm.weight", np.full(8, i, np.float32),
                                            gguf.GGMLQuantizationType.F32) for i in range(4)]
    tensors.append(gguf_file.tensor_from_array("output_norm.weight", np.ones(8, np.float32), gguf.GGMLQuantizationType.F32))
    gguf_file.write_gguf(source, metadata, tensors)
    sliced = stage_file(source, 1, 3, final=False, cache_dir=directory / "cache").path
    return gguf.GGUFReader(source), gguf.GGUFReader(sliced)


@pytest.mark.parametrize("key", sorted(TYPED_KEYS))
def test_every_gguf_value_type_round_trips_through_a_slice(typed_slice, key: str) -> None:
    source, sliced = typed_slice
    vtype, sub, value = TYPED_KEYS[key]
    written = read_typed(source.get_field(key))
    assert written[:2] == (vtype, sub)
    if vtype == T.FLOAT32 or sub == T.FLOAT32:
        assert np.array_equal(np.float32(written[2]), np.float32(value))
    else:
        assert written[2] == value

    assert read_typed(sliced.get_field(key)) == written
    assert gguf_file.raw_value(sliced.get_field(key)) == gguf_file.raw_value(source.get_field(key))


def test_a_slice_keeps_every_key_of_its_source_and_rewrites_only_the_range_keys(typed_slice) -> None:
    source, sliced = typed_slice
    names = {n for n in source.fields if not n.startswith("GGUF.")}
    added = {n for n in sliced.fields if not n.startswith("GGUF.")} - names
    changed = {n for n in names if gguf_file.raw_value(source.fields[n]) != gguf_file.raw_value(sliced.fields[n])}

    assert added == {f"skippy.slice.{k}" for k in ("version", "layer_start", "layer_end", "source_block_count", "final")}
    assert changed == {"llama.block_count", *PER_LAYER}


@pytest.mark.parametrize("key", sorted(PER_LAYER))
def test_a_per_layer_array_of_every_item_type_is_sliced_to_the_range(typed_slice, key: str) -> None:
    source, sliced = typed_slice
    vtype, sub, values = read_typed(source.get_field(key))

    assert read_typed(sliced.get_field(key)) == (vtype, sub, values[1:3])
