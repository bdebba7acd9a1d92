"""GGUF files written byte for byte as llama.cpp reads them: the slicer's and the fixtures' writer.

gguf-py's ``GGUFWriter`` re-encodes every metadata value from Python, and that loses things a
valid GGUF holds: it refuses an empty array whatever its element type (llama.cpp's own saver
writes ``tokenizer.ggml.merges = []`` and ``<arch>.classifier.output_labels = []``), a reader's
empty array no longer says its element type, nested arrays get their item type guessed, and a
string that is not UTF-8 does not decode. A slice must be its source minus what it drops, so
metadata travels here as typed bytes: copied from the source as they are (:func:`raw_value`),
or packed from a Python value only for the keys a slice rewrites (:func:`pack_value`). Tensor
data is copied as bytes too, whatever its type.

The layout is GGUF v3's: header, key/values, tensor infos, padding to the alignment, tensor
data each starting on an aligned offset. Numbers are in the byte order of the file's source.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


def byte_order(reader: GGUFReader) -> str:
    """The ``struct`` prefix of the file ``reader`` read: ``<`` or ``>``."""
    return ">" if reader.endianess == GGUFEndian.BIG else "<"


def pack_value(vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None = None, *, order: str = "<") -> bytes:
    """A value's GGUF type tag and bytes; an array needs its ``sub_type``, the one thing an empty
    array cannot be asked for."""
    return struct.pack(f"{order}I", vtype) + _pack_payload(vtype, value, sub_type, order)


def _pack_payload(vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None, order: str) -> bytes:
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is not None:
        return struct.pack(order + fmt, value)
    if vtype == GGUFValueType.STRING:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return struct.pack(f"{order}Q", len(data)) + data
    if vtype == GGUFValueType.ARRAY:
        if sub_type is None or sub_type == GGUFValueType.ARRAY:
            raise ValueError("an array is packed with its scalar or string item type")
        items = list(value)
        head = struct.pack(f"{order}IQ", sub_type, len(items))
        item_fmt = _SCALAR_FORMATS.get(sub_type)
        if item_fmt is not None:
            return head + struct.pack(f"{order}{len(items)}{item_fmt}", *items)
        return head + b"".join(_pack_payload(sub_type, item, None, order) for item in items)
    raise ValueError(f"no GGUF value type {vtype!r}")


def raw_value(field: ReaderField) -> bytes:
    """The field's type tag and value exactly as its file holds them (parts after the key)."""
    return b"".join(part.tobytes() for part in field.parts[2:])


def item_type(field: ReaderField) -> GGUFValueType:
    """An array field's element type, read from the file: the reader's ``types`` omits it for an
    empty array."""
    return GGUFValueType(int(field.parts[3][0]))


def array_items(field: ReaderField, start: int, end: int, *, order: str = "<") -> bytes:
    """Items ``[start, end)`` of a flat array field, as the file holds them, behind a new header."""
    sub = item_type(field)
    if sub == GGUFValueType.ARRAY:
        raise ValueError(f"{field.name}: a nested array has no per-item slice")
    indices = field.data[start:end]
    # A string item is two parts, its length before its bytes; data indexes the bytes.
    width = 2 if sub == GGUFValueType.STRING else 1
    body = b"".join(field.parts[i - k].tobytes() for i in indices for k in range(width - 1, -1, -1))
    return struct.pack(f"{order}IIQ", GGUFValueType.ARRAY, sub, len(indices)) + body


def array_length(field: ReaderField) -> int:
    """How many items an array field holds (0 for a scalar)."""
    return int(field.parts[4][0]) if field.types and field.types[0] == GGUFValueType.ARRAY else 0


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: ggml dimension order (fastest first), ggml type id, and its bytes."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    data: Any  # anything with the buffer protocol: a memmap view of the source, an ndarray

    @property
    def n_bytes(self) -> int:
        return memoryview(self.data).nbytes


def tensor_from_reader(reader: GGUFReader, tensor: ReaderTensor, name: str) -> Tensor:
    """``tensor``'s bytes in the source, uncopied, under ``name``."""
    dims = tuple(int(d) for d in tensor.field.parts[3])
    start = int(tensor.data_offset)
    return Tensor(name, dims, int(tensor.tensor_type), reader.data[start : start + int(tensor.n_bytes)])


def tensor_from_array(name: str, values: np.ndarray, ggml_type: int) -> Tensor:
    return Tensor(name, tuple(reversed(values.shape)), ggml_type, np.ascontiguousarray(values))


def _pad(n: int, alignment: int) -> int:
    return (alignment - n % alignment) % alignment


def write_gguf(dest: str | Path, metadata: Iterable[tuple[str, bytes]], tensors: Sequence[Tensor], *,
               alignment: int = DEFAULT_ALIGNMENT, order: str = "<",
               on_tensor: Callable[[int], None] | None = None) -> None:
    """Write a GGUF of ``metadata`` (key, :func:`pack_value`/:func:`raw_value` bytes) and ``tensors``.

    ``alignment`` must be what the metadata's ``general.alignment`` says (32 when it is absent).
    """
    with open(dest, "wb") as f:
        _write_header(f, metadata, [(t.name, t.dims, t.ggml_type, t.n_bytes) for t in tensors], alignment, order)
        for t in tensors:
            f.write(memoryview(t.data).cast("B"))
            f.write(b"\0" * _pad(t.n_bytes, alignment))
            if on_tensor is not None:
                on_tensor(t.n_bytes)


def tensor_bytes(dims: Sequence[int], ggml_type: int) -> int:
    """The bytes a tensor of ``dims`` (ggml order) and ``ggml_type`` takes."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    n = 1
    for d in dims:
        n *= int(d)
    if n % block:
        raise ValueError(f"{n} values are not a whole number of {GGMLQuantizationType(ggml_type).name} blocks")
    return n // block * size


def write_skeleton(dest: str | Path, metadata: Iterable[tuple[str, bytes]],
                   tensors: Sequence[tuple[str, tuple[int, ...], int]], *,
                   alignment: int = DEFAULT_ALIGNMENT, order: str = "<") -> None:
    """Write a GGUF of ``metadata`` and the infos of ``tensors`` (name, dims, ggml type) whose tensor
    data is a hole of the size it would take: a sparse file that reads as zeros, which costs a few
    blocks on disk whatever the model's size. Whatever reads only the header (llama.cpp's quantizer in
    a dry run) sees the model these describe."""
    infos = [(name, tuple(dims), ggml_type, tensor_bytes(dims, ggml_type)) for name, dims, ggml_type in tensors]
    with open(dest, "wb") as f:
        _write_header(f, metadata, infos, alignment, order)
        f.truncate(f.tell() + sum(n + _pad(n, alignment) for *_, n in infos))


def _write_header(f: Any, metadata: Iterable[tuple[str, bytes]],
                  infos: Sequence[tuple[str, tuple[int, ...], int, int]], alignment: int, order: str) -> None:
    """The header, key/values and tensor infos (name, dims, type, bytes), padded to the alignment."""
    kv = list(metadata)
    f.write(b"GGUF")
    f.write(struct.pack(f"{order}IQQ", GGUF_VERSION, len(infos), len(kv)))
    for key, value in kv:
        f.write(_pack_payload(GGUFValueType.STRING, key, None, order))
        f.write(value)
    offset = 0
    for name, dims, ggml_type, n_bytes in infos:
        f.write(_pack_payload(GGUFValueType.STRING, name, None, order))
        f.write(struct.pack(f"{order}I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset))
        offset += n_bytes + _pad(n_bytes, alignment)
    f.write(b"\0" * _pad(f.tell(), alignment))


_FIXED_SIZES = {vtype: struct.calcsize(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class RawGGUF:
    """A GGUF as :func:`write_gguf` takes one: metadata as typed bytes, tensors as uncopied views."""

    metadata: list[tuple[str, bytes]]
    tensors: list[Tensor]
    alignment: int
    order: str


def read_raw(path: str | Path) -> RawGGUF:
    """``path``'s metadata (each key's type tag and value bytes as the file holds them) and tensors
    (memory-mapped), without decoding a value: gguf-py's reader makes a numpy view of every item of
    every array, seconds for a vocabulary, where copying them needs none. ``ValueError`` for a file
    that is not a GGUF this can read."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if data[:4].tobytes() != b"GGUF":
        raise ValueError("missing GGUF magic")
    (version,) = struct.unpack_from("<I", data, 4)
    order = ">" if version & 0xFFFF == 0 else "<"
    (version,) = struct.unpack_from(f"{order}I", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    n_tensors, n_kv = struct.unpack_from(f"{order}QQ", data, 8)

    def string_end(at: int) -> int:
        (length,) = struct.unpack_from(f"{order}Q", data, at)
        return at + 8 + length

    def value_end(vtype: int, at: int) -> int:
        if vtype == GGUFValueType.STRING:
            return string_end(at)
        if vtype == GGUFValueType.ARRAY:
            sub, count = struct.unpack_from(f"{order}IQ", data, at)
            at += 12
            if sub in _FIXED_SIZES:
                return at + count * _FIXED_SIZES[GGUFValueType(sub)]
            for _ in range(count):
                at = value_end(sub, at)
            return at
        return at + _FIXED_SIZES[GGUFValueType(vtype)]

    offset = 24
    metadata: list[tuple[str, bytes]] = []
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        end = string_end(offset)
        key = data[offset + 8 : end].tobytes().decode("utf-8")
        (vtype,) = struct.unpack_from(f"{order}I", data, end)
        offset = value_end(vtype, end + 4)
        metadata.append((key, data[end:offset].tobytes()))
        if key == "general.alignment" and vtype == GGUFValueType.UINT32:
            (alignment,) = struct.unpack_from(f"{order}I", data, end + 4)
    infos = []
    for _ in range(n_tensors):
        end = string_end(offset)
        name = data[offset + 8 : end].tobytes().decode("utf-8")
        (n_dims,) = struct.unpack_from(f"{order}I", data, end)
        dims = struct.unpack_from(f"{order}{n_dims}Q", data, end + 4)
        ggml_type, at = struct.unpack_from(f"{order}IQ", data, end + 4 + 8 * n_dims)
        infos.append((name, dims, ggml_type, at))
        offset = end + 4 + 8 * n_dims + 12
    start = offset + _pad(offset, alignment)
    tensors = []
    for name, dims, ggml_type, at in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * size
        if start + at + n_bytes > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        tensors.append(Tensor(name, tuple(int(d) for d in dims), int(ggml_type), data[start + at : start + at + n_bytes]))
    return RawGGUF(metadata, tensors, alignment, order)
