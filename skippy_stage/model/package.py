"""Layer packages: a model cut into parts that each stage fetches only as it needs them.

``skippy-stage package MODEL.gguf --out DIR`` writes ``DIR/manifest.json`` and the parts, each a
GGUF holding tensors under their names in the source and their bytes as the source holds them:

- ``metadata.gguf``, role ``metadata``: every metadata key of the source (hyper-parameters,
  tokenizer, chat template) and the model's small tensors that every stage file carries (the
  output norm, a RoPE frequency table, ...). Every stage fetches it: llama.cpp loads the vocabulary
  of any model, and the stage reads the model's header from it before anything else.
- ``embedding.gguf``, role ``embedding``: ``token_embd.weight``, for the head, and for the final
  stage of a model whose output head is its embeddings (``tied_embeddings``).
- ``output.gguf``, role ``output``: the output head (``output.*``) for the final stage; a model with
  tied embeddings has none.
- ``layers-AAA-BBB.gguf``, role ``layers``: the blocks ``[AAA, BBB)`` (``blk.{i}.*``), one block per
  part unless ``--layers-per-part`` says more.

The manifest names the source (file name, sha256, bytes), its architecture, block count and
quantization, and lists every part with its sha256, size, layer range (null for a part that holds
no layer) and role, and (from version 2) every tensor of the source with its dimensions and type, in
the source's order: with the metadata part, the whole model's header, from which a stage that
quantizes its range has llama.cpp plan the whole model's quantization. The manifest's own sha256 is what a stage's ``manifest_sha256`` pins: it
checks the manifest against it, and every part against the manifest, before using any byte.
Which parts a stage needs (:meth:`Manifest.parts_for`) is decided here; fetching them is
``package_fetch``'s job and assembling a stage file from them ``package_stage``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

from skippy_stage.errors import ConfigError, ModelFileError
from skippy_stage.model import gguf_file
from skippy_stage.model.slicing import check_architecture, layer_index, open_reader, read_model_info, sha256_file

PACKAGE_FORMAT = "skippy-stage layer package"
PACKAGE_VERSION = 2
# Version 1 lists no tensor infos: its packages still load, but no stage of one can quantize (the
# whole model's type plan needs every tensor's name, shape and type).
READ_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
EMBEDDING_TENSOR = "token_embd.weight"
ROLES = ("metadata", "embedding", "output", "layers")
# A manifest is a few KiB per hundred layers; anything this large is not one.
MAX_MANIFEST_BYTES = 16 << 20
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Part:
    """One file of a package, as the manifest lists it."""

    path: str  # relative to the package's directory or URL
    sha256: str
    bytes: int
    layers: tuple[int, int] | None  # the blocks [start, end) it holds; None for a part holding no layer
    role: str  # metadata, embedding, output or layers

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "bytes": self.bytes,
                "layers": list(self.layers) if self.layers is not None else None, "role": self.role}


@dataclass(frozen=True)
class EmbeddingShape:
    """The token embedding's name, dimensions (ggml order) and type: what a stage that does not
    fetch it writes in its place, zeros of that shape and type (llama.cpp requires the tensor in
    every model it loads; a stage that takes hidden states in never reads it)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: str  # a GGMLQuantizationType name
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dims": list(self.dims), "type": self.ggml_type, "bytes": self.bytes}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the source model as its header lists it: name, dimensions (ggml order) and type.
    The manifest lists every one, in the source's order, so that a stage holding only some layers can
    write the whole model's header (its metadata part's keys and these infos, the weights a hole) and
    have llama.cpp plan the whole model's quantization from it."""

    name: str
    dims: tuple[int, ...]
    ggml_type: str  # a GGMLQuantizationType name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dims": list(self.dims), "type": self.ggml_type}


@dataclass(frozen=True)
class Manifest:
    """A package's ``manifest.json``: the source model and the parts it was cut into."""

    source_file: str
    source_sha256: str
    source_bytes: int
    architecture: str
    block_count: int
    quantization: dict[str, Any]  # file_type, file_type_name, tensor_types (type name -> count)
    tied_embeddings: bool
    embedding: EmbeddingShape | None
    parts: tuple[Part, ...]
    tensors: tuple[TensorInfo, ...] | None = None  # every tensor of the source, in its order; None in version 1
    version: int = PACKAGE_VERSION

    def to_json(self) -> bytes:
        """The manifest's bytes, as ``package`` writes them (their sha256 is the manifest's)."""
        data = {
            "format": PACKAGE_FORMAT, "version": self.version,
            "source": {"file": self.source_file, "sha256": self.source_sha256, "bytes": self.source_bytes},
            "architecture": self.architecture, "block_count": self.block_count,
            "quantization": self.quantization, "tied_embeddings": self.tied_embeddings,
            "embedding": self.embedding.to_json() if self.embedding is not None else None,
            "parts": [p.to_json() for p in self.parts],
        }
        if self.tensors is not None:
            data["tensors"] = [t.to_json() for t in self.tensors]
        return (json.dumps(data, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, origin: str) -> Manifest:
        """Parse and check a manifest; anything malformed is a :class:`ModelFileError` naming
        ``origin`` and the field."""
        return _parse_manifest(raw, origin)

    def part(self, role: str) -> Part | None:
        """The part of a role that has one part (metadata, embedding, output), if the package has it."""
        return next((p for p in self.parts if p.role == role), None)

    def layer_parts(self) -> list[Part]:
        return sorted((p for p in self.parts if p.role == "layers"), key=lambda p: p.layers or (0, 0))

    def parts_for(self, layer_start: int, layer_end: int, *, head: bool, final: bool,
                  needs_output: bool = False) -> list[Part]:
        """Every part a stage of ``[layer_start, layer_end)`` needs, metadata first.

        The layer parts holding the range; the embedding for the head, and for the final stage
        when the output head is the embeddings; the output head for the final stage (and for every
        stage of an architecture whose graph loads it even where it stops before it). A range
        that no part holds, or a role the stage needs that the package lacks, is a
        :class:`ConfigError` naming it.
        """
        if not 0 <= layer_start < layer_end <= self.block_count:
            raise ConfigError(f"layer range {layer_start}:{layer_end} is not inside the package's "
                              f"{self.block_count} layers ({self.source_file})")
        needed = [self._required("metadata", "every stage")]
        covered = layer_start
        for part in self.layer_parts():
            start, end = part.layers or (0, 0)
            if end <= layer_start or start >= layer_end:
                continue
            if start > covered:
                break
            needed.append(part)
            covered = max(covered, end)
        if covered < layer_end:
            held = ", ".join(f"{a}:{b}" for a, b in _spans(self.layer_parts())) or "none"
            raise ConfigError(f"the package holds no part with layers {covered}:{_next_start(self, covered, layer_end)} "
                              f"of layer range {layer_start}:{layer_end} (its layer parts hold {held})")
        if head or (final and self.tied_embeddings):
            why = "the head" if head else "the final stage of a model with tied embeddings"
            needed.append(self._required("embedding", why))
        if not self.tied_embeddings and (final or needs_output):
            why = "the final stage" if final else f"every stage of {self.architecture} (its graph loads the head)"
            needed.append(self._required("output", why))
        return needed

    def _required(self, role: str, who: str) -> Part:
        part = self.part(role)
        if part is None:
            raise ConfigError(f"the package has no {role} part, which {who} needs")
        return part


def _spans(parts: list[Part]) -> list[tuple[int, int]]:
    """Layer parts' ranges merged where they touch."""
    spans: list[tuple[int, int]] = []
    for part in parts:
        start, end = part.layers or (0, 0)
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def _next_start(manifest: Manifest, at: int, limit: int) -> int:
    """Where the gap that starts at ``at`` ends: the next layer part's start (at most ``limit``)."""
    starts = [p.layers[0] for p in manifest.layer_parts() if p.layers is not None and p.layers[0] > at]
    return min([limit, *starts])


def _parse_manifest(raw: bytes, origin: str) -> Manifest:
    def bad(field: str, value: object, why: str) -> ModelFileError:
        shown = value if isinstance(value, (int, float, bool, type(None))) else repr(value)[:80]
        return ModelFileError(f"package manifest {origin}: {field} is {shown}, {why}")

    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"package manifest {origin} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad("the manifest", type(data).__name__, "not an object")
    if data.get("format") != PACKAGE_FORMAT:
        raise bad("format", data.get("format"), f"not {PACKAGE_FORMAT!r}")
    version = data.get("version")
    if not _is_int(version) or version not in READ_VERSIONS:
        raise bad("version", version, f"and this build reads versions {', '.join(map(str, READ_VERSIONS))}")
    source = data.get("source")
    if not isinstance(source, dict):
        raise bad("source", source, "not an object {file, sha256, bytes}")
    arch = data.get("architecture")
    if not isinstance(arch, str) or not arch:
        raise bad("architecture", arch, "not an architecture name")
    block_count = data.get("block_count")
    if not _is_int(block_count) or block_count < 1:
        raise bad("block_count", block_count, "not a positive integer")
    tied = data.get("tied_embeddings")
    if not isinstance(tied, bool):
        raise bad("tied_embeddings", tied, "not true or false")
    quantization = data.get("quantization")
    if not isinstance(quantization, dict):
        raise bad("quantization", quantization, "not an object")
    embedding = _parse_embedding(data.get("embedding"), bad)
    raw_parts = data.get("parts")
    if not isinstance(raw_parts, list):
        raise bad("parts", raw_parts, "not a list")
    parts = tuple(_parse_part(i, p, block_count, bad) for i, p in enumerate(raw_parts))
    tensors = _parse_tensors(data.get("tensors"), version, bad)
    for role in ("metadata", "embedding", "output"):
        count = sum(p.role == role for p in parts)
        if count > 1 or (role == "metadata" and count == 0):
            raise bad(f"the number of {role} parts", count, "where a package has exactly one" if role == "metadata"
                      else "where a package has at most one")
    if (embedding is None) != all(p.role != "embedding" for p in parts):
        raise bad("embedding", embedding.to_json() if embedding else None,
                  "which disagrees with the parts (an embedding part needs its shape here, and the shape its part)")
    has_output = any(p.role == "output" for p in parts)
    if tied == has_output:
        raise bad("tied_embeddings", tied, "which disagrees with the parts (a model has an output part exactly "
                  "when its head is not its embeddings)")
    paths = [p.path for p in parts]
    if len(set(paths)) != len(paths):
        raise bad("parts", sorted(p for p in paths if paths.count(p) > 1)[0], "listed twice")
    layered = sorted((p for p in parts if p.layers is not None), key=lambda p: p.layers or (0, 0))
    for before, after in zip(layered, layered[1:]):
        if after.layers[0] < before.layers[1]:  # type: ignore[index]
            raise bad(f"part {after.path}'s layers", list(after.layers or ()), f"overlapping part {before.path}'s")
    return Manifest(
        source_file=_str_field(source, "file", "source.file", bad),
        source_sha256=_sha_field(source.get("sha256"), "source.sha256", bad),
        source_bytes=_size_field(source.get("bytes"), "source.bytes", bad),
        architecture=arch, block_count=block_count, quantization=quantization, tied_embeddings=tied,
        embedding=embedding, parts=parts, tensors=tensors, version=version,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_field(obj: dict[str, Any], key: str, field: str, bad: Callable[..., ModelFileError]) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise bad(field, value, "not a non-empty string")
    return value


def _sha_field(value: object, field: str, bad: Callable[..., ModelFileError]) -> str:
    if not isinstance(value, str) or len(value) != 64 or not set(value) <= _HEX:
        raise bad(field, value, "not a sha256 (64 lowercase hex digits)")
    return value


def _size_field(value: object, field: str, bad: Callable[..., ModelFileError]) -> int:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise bad(field, value, "not a byte count")
    return value  # type: ignore[return-value]


def _parse_embedding(raw: object, bad: Callable[..., ModelFileError]) -> EmbeddingShape | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad("embedding", raw, "not an object {name, dims, type, bytes}")
    dims = raw.get("dims")
    if not isinstance(dims, list) or not dims or not all(_is_int(d) and d > 0 for d in dims):
        raise bad("embedding.dims", dims, "not a list of positive integers")
    type_name = raw.get("type")
    if not isinstance(type_name, str) or type_name not in GGMLQuantizationType.__members__:
        raise bad("embedding.type", type_name, "not a ggml type name")
    return EmbeddingShape(_str_field(raw, "name", "embedding.name", bad), tuple(dims), type_name,
                          _size_field(raw.get("bytes"), "embedding.bytes", bad))


def _parse_tensors(raw: object, version: int, bad: Callable[..., ModelFileError]) -> tuple[TensorInfo, ...] | None:
    if version == 1:
        if raw is not None:
            raise bad("tensors", "a list", "but a version 1 manifest has none")
        return None
    if not isinstance(raw, list) or not raw:
        raise bad("tensors", raw, "not a list of the source's tensors {name, dims, type}")
    out = []
    for i, t in enumerate(raw):
        where = f"tensors[{i}]"
        if not isinstance(t, dict):
            raise bad(where, t, "not an object {name, dims, type}")
        dims = t.get("dims")
        if not isinstance(dims, list) or not dims or not all(_is_int(d) and d > 0 for d in dims):
            raise bad(f"{where}.dims", dims, "not a list of positive integers")
        type_name = t.get("type")
        if not isinstance(type_name, str) or type_name not in GGMLQuantizationType.__members__:
            raise bad(f"{where}.type", type_name, "not a ggml type name")
        out.append(TensorInfo(_str_field(t, "name", f"{where}.name", bad), tuple(dims), type_name))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise bad("tensors", sorted(n for n in names if names.count(n) > 1)[0], "listed twice")
    return tuple(out)


def _parse_part(index: int, raw: object, block_count: int, bad: Callable[..., ModelFileError]) -> Part:
    where = f"parts[{index}]"
    if not isinstance(raw, dict):
        raise bad(where, raw, "not an object {path, sha256, bytes, layers, role}")
    path = _str_field(raw, "path", f"{where}.path", bad)
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts or "\\" in path or str(pure) != path or path == ".":
        raise bad(f"{where}.path", path, "not a plain path inside the package")
    where = f"part {path}"
    role = raw.get("role")
    if role not in ROLES:
        raise bad(f"{where}'s role", role, f"not one of {', '.join(ROLES)}")
    layers = raw.get("layers")
    if role == "layers":
        if (not isinstance(layers, list) or len(layers) != 2 or not all(_is_int(v) for v in layers)
                or not 0 <= layers[0] < layers[1] <= block_count):
            raise bad(f"{where}'s layers", layers, f"not [start, end] inside the model's {block_count} layers")
        span: tuple[int, int] | None = (layers[0], layers[1])
    elif layers is not None:
        raise bad(f"{where}'s layers", layers, f"but a {role} part holds no layer (null)")
    else:
        span = None
    return Part(path=path, sha256=_sha_field(raw.get("sha256"), f"{where}'s sha256", bad),
                bytes=_size_field(raw.get("bytes"), f"{where}'s bytes", bad), layers=span, role=role)


# -- writing a package ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackageWritten:
    """What ``package`` wrote: the manifest, its path and its sha256 (the stages' ``manifest_sha256``)."""

    manifest: Manifest
    manifest_path: Path
    manifest_sha256: str


def part_name(layer_start: int, layer_end: int, block_count: int) -> str:
    width = max(3, len(str(block_count)))
    return f"layers-{layer_start:0{width}d}-{layer_end:0{width}d}.gguf"


def write_package(source: str | os.PathLike[str], out: str | os.PathLike[str], *, layers_per_part: int = 1,
                  progress: bool | None = None) -> PackageWritten:
    """Cut ``source`` into a package in ``out`` (see the module docstring); the manifest is written
    last, so a package cut short has none."""
    source, out = Path(source), Path(out)
    if layers_per_part < 1:
        raise ConfigError(f"--layers-per-part {layers_per_part} must be at least 1")
    info = read_model_info(source)
    check_architecture(info.architecture)  # a package of a model no stage would load helps nobody
    reader = open_reader(source)
    order = gguf_file.byte_order(reader)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)

    shared: list[gguf_file.Tensor] = []
    embedding: list[gguf_file.Tensor] = []
    output: list[gguf_file.Tensor] = []
    blocks: dict[int, list[gguf_file.Tensor]] = {}
    for tensor in reader.tensors:
        t = gguf_file.tensor_from_reader(reader, tensor, tensor.name)
        index = layer_index(tensor.name)
        if index is not None:
            if not 0 <= index < info.block_count:
                raise ModelFileError(f"model file {source}: tensor {tensor.name} is beyond its {info.block_count} blocks")
            blocks.setdefault(index, []).append(t)
        elif tensor.name == EMBEDDING_TENSOR:
            embedding.append(t)
        elif tensor.name.startswith("output."):
            output.append(t)
        else:
            shared.append(t)

    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    alignment_field = reader.get_field("general.alignment")
    alignment = gguf_file.DEFAULT_ALIGNMENT if alignment_field is None else int(alignment_field.contents())
    # What a part other than the metadata says of itself: enough for gguf-py to read it and a person
    # to tell what it is. The manifest, not these keys, is what stages trust.
    own_keys = [(f.name, gguf_file.raw_value(f)) for f in fields if f.name in ("general.architecture", "general.alignment")]

    def own(role: str, layers: tuple[int, int] | None = None) -> list[tuple[str, bytes]]:
        kv = [*own_keys, ("skippy.package.role", gguf_file.pack_value(GGUFValueType.STRING, role, order=order))]
        for key, value in zip(("layer_start", "layer_end"), layers or ()):
            kv.append((f"skippy.package.{key}", gguf_file.pack_value(GGUFValueType.UINT32, value, order=order)))
        return kv

    plan: list[tuple[str, str, tuple[int, int] | None, list[tuple[str, bytes]], list[gguf_file.Tensor]]] = [
        ("metadata.gguf", "metadata", None, [(f.name, gguf_file.raw_value(f)) for f in fields], shared)]
    if embedding:
        plan.append(("embedding.gguf", "embedding", None, own("embedding"), embedding))
    if output:
        plan.append(("output.gguf", "output", None, own("output"), output))
    for start in range(0, info.block_count, layers_per_part):
        end = min(start + layers_per_part, info.block_count)
        span = (start, end)
        plan.append((part_name(start, end, info.block_count), "layers", span, own("layers", span),
                     [t for i in range(start, end) for t in blocks.get(i, [])]))

    total = sum(t.n_bytes for *_, tensors in plan for t in tensors) + source.stat().st_size
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    parts = []
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"package {source.name}", disable=not show) as bar:
        source_sha256 = sha256_file(source, bar.update)
        for name, role, layers, metadata, tensors in plan:
            path = out / name
            gguf_file.write_gguf(path, metadata, tensors, order=order, alignment=alignment, on_tensor=bar.update)
            parts.append(Part(path=name, sha256=sha256_file(path), bytes=path.stat().st_size, layers=layers, role=role))

    file_type = info.metadata.get("general.file_type")
    try:
        file_type_name = LlamaFileType(file_type).name if _is_int(file_type) else None
    except ValueError:
        file_type_name = None
    types = Counter(GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors)
    embd = embedding[0] if embedding else None
    manifest = Manifest(
        source_file=source.name, source_sha256=source_sha256, source_bytes=source.stat().st_size,
        architecture=info.architecture, block_count=info.block_count,
        quantization={"file_type": file_type, "file_type_name": file_type_name, "tensor_types": dict(sorted(types.items()))},
        tied_embeddings=not output,
        embedding=EmbeddingShape(embd.name, embd.dims, GGMLQuantizationType(embd.ggml_type).name, embd.n_bytes)
        if embd is not None else None,
        parts=tuple(parts),
        tensors=tuple(TensorInfo(t.name, tuple(int(d) for d in t.field.parts[3]),
                                 GGMLQuantizationType(int(t.tensor_type)).name) for t in reader.tensors),
    )
    data = manifest.to_json()
    tmp = out / (MANIFEST_NAME + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out / MANIFEST_NAME)
    return PackageWritten(manifest, out / MANIFEST_NAME, hashlib.sha256(data).hexdigest())


__all__ = [
    "MANIFEST_NAME",
    "EmbeddingShape",
    "Manifest",
    "PackageWritten",
    "Part",
    "TensorInfo",
    "sha256_file",
    "write_package",
]
