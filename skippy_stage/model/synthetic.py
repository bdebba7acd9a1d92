"""Random-weight GGUF models from a compact description: the architecture fixtures.

llama.cpp's ``tests/test-llama-archs.cpp`` builds a tiny random-weight model for every
architecture it knows. Its files are megabytes each, a hundred of them; the repository
keeps only what makes each one a model (every metadata key with its GGUF type, every
tensor's name, shape and type) and this module writes the weights again from a seed.
Random weights make a split that is not exact show at once, as trained ones would.

The values follow the C++ test's rule (normal, standard deviation 0.1; ``ssm_a`` negated,
since a Mamba state must decay) but not its generator: they are fresh values, the same
on every machine for a given seed, which is all a split-versus-unsplit proof needs.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from skippy_stage.model import gguf_file

DESCRIPTION_VERSION = 1
STDEV = 0.1
_NUMPY_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest dimension first)
    type: str  # GGMLQuantizationType name: F32 or F16


@dataclass(frozen=True)
class ModelSpec:
    """One fixture: its file stem (``<arch>-dense`` / ``<arch>-moe``), metadata, tensors."""

    stem: str
    architecture: str
    moe: bool
    metadata: tuple[tuple[str, str, str | None, Any], ...]  # key, value type, array item type, value
    tensors: tuple[TensorSpec, ...]

    @property
    def block_count(self) -> int:
        return int(next(v for k, _, _, v in self.metadata if k == f"{self.architecture}.block_count"))


def describe(path: str | Path) -> ModelSpec:
    """What a GGUF is, without its weights."""
    path = Path(path)
    reader = GGUFReader(path, "r")
    metadata = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = gguf_file.item_type(field).name if vtype == GGUFValueType.ARRAY else None
        if sub == GGUFValueType.ARRAY.name:
            raise ValueError(f"{path.name}: key {field.name} is a nested array; descriptions hold flat ones")
        value = _shortest(field.contents(), vtype, sub)
        metadata.append((field.name, vtype.name, sub, tuple(value) if isinstance(value, list) else value))
    tensors = []
    for t in reader.tensors:
        if t.tensor_type not in _NUMPY_TYPES:
            raise ValueError(f"{path.name}: tensor {t.name} has type {t.tensor_type.name}; fixtures hold F32/F16 only")
        tensors.append(TensorSpec(t.name, tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type.name))
    arch = str(reader.get_field("general.architecture").contents())
    return ModelSpec(path.stem, arch, path.stem.endswith("-moe"), tuple(metadata), tuple(tensors))


def _seed(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def write_model(spec: ModelSpec, dest: str | Path, *, seed: int = 42) -> Path:
    """Write ``spec`` as a GGUF with weights drawn from ``seed``; the same bytes every time."""
    dest = Path(dest)
    # general.architecture first, as llama.cpp's saver and gguf-py's writer put it.
    metadata = [(key, gguf_file.pack_value(GGUFValueType[vtype], value, None if sub is None else GGUFValueType[sub]))
                for key, vtype, sub, value in sorted(spec.metadata, key=lambda m: m[0] != "general.architecture")]
    tensors = []
    for t in spec.tensors:
        values = _seed(seed, t.name).normal(0.0, STDEV, size=t.shape).astype(np.float32)
        if "ssm_a" in t.name:
            values = -np.abs(values)
        ggml_type = GGMLQuantizationType[t.type]
        tensors.append(gguf_file.tensor_from_array(t.name, values.astype(_NUMPY_TYPES[ggml_type]), ggml_type))
    alignment = next((int(v) for k, _, _, v in spec.metadata if k == "general.alignment"), gguf_file.DEFAULT_ALIGNMENT)
    gguf_file.write_gguf(dest, metadata, tensors, alignment=alignment)
    return dest


def _shortest(value: Any, vtype: GGUFValueType, sub: str | None) -> Any:
    """float32 values as their shortest decimal form: the same float32 once read back."""
    is_f32 = vtype == GGUFValueType.FLOAT32 or sub == GGUFValueType.FLOAT32.name
    if not is_f32:
        return value
    if isinstance(value, (list, tuple)):
        return [float(str(np.float32(v))) for v in value]
    return float(str(np.float32(value)))


def dump_specs(specs: list[ModelSpec], path: str | Path) -> None:
    """The committed description: gzipped JSON lines, one fixture per line."""
    lines = [json.dumps({"version": DESCRIPTION_VERSION})]
    for s in specs:
        lines.append(json.dumps({
            "stem": s.stem, "architecture": s.architecture, "moe": s.moe,
            "metadata": [[k, t, sub, _jsonable(v)] for k, t, sub, v in s.metadata],
            "tensors": [[t.name, list(t.shape), t.type] for t in s.tensors],
        }, separators=(",", ":")))
    Path(path).write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))


def load_specs(path: str | Path) -> dict[str, ModelSpec]:
    """The fixtures of a description file, by stem."""
    lines = gzip.decompress(Path(path).read_bytes()).decode().splitlines()
    header = json.loads(lines[0])
    if header.get("version") != DESCRIPTION_VERSION:
        raise ValueError(f"{path}: description version {header.get('version')} != {DESCRIPTION_VERSION}")
    out = {}
    for line in lines[1:]:
        d = json.loads(line)
        out[d["stem"]] = ModelSpec(
            d["stem"], d["architecture"], d["moe"],
            tuple((k, t, sub, tuple(v) if isinstance(v, list) else v) for k, t, sub, v in d["metadata"]),
            tuple(TensorSpec(n, tuple(shape), ty) for n, shape, ty in d["tensors"]),
        )
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value)
    if isinstance(value, (np.integer, int)) and not isinstance(value, bool):
        return int(value)
    return value
