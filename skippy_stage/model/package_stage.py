"""A stage loaded from a layer package: the checks made before any weights load, the model's
header, and the stage file assembled from the parts the stage fetched.

- :func:`plan` fetches the manifest (checked against ``manifest_sha256``) and the metadata part
  (checked against the manifest), and refuses, naming the part or field, a manifest of an
  architecture no proof accepts, a metadata part that disagrees with the manifest, and a layer
  range or a role the stage needs that the package does not hold.
- :func:`prepare` (``serve``, before it listens) points ``model_path`` at the model's header: the
  metadata part, under the source model's file name in the cache. What reads the model's header,
  or names the model by its file, then sees what it would see of the source GGUF.
- :func:`stage_file` (the runtime, while the stage loads) fetches the other parts the range needs,
  writes them and the metadata into a partial source GGUF (blocks under their original names;
  a stage that takes hidden states in gets zeros of the right shape and type in place of the token
  embeddings, which llama.cpp requires and such a stage never reads) and has the slicer cut the
  stage file out of it exactly as out of the whole model. The result is cached by the manifest's
  sha256, the range and the role: a stage that restarts fetches nothing but the manifest, and that
  only when its cached copy is gone.
- With ``checkpoint_quantization``, :func:`stage_file` then quantizes that stage file with the whole
  model's per-tensor types (``requantize``). The plan comes from llama.cpp's dry run over a sparse
  copy of the whole model's header, written from what every stage holds: the metadata part's keys
  and the manifest's list of every tensor (name, shape, type), the weights a hole
  (:func:`write_skeleton`). The result is cached by the manifest's sha256, the range, the role, the
  type and the importance matrix's sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, ModelFileError, UnsupportedModelError
from skippy_stage.model import gguf_file, layer_rules, requantize
from skippy_stage.model.package import PACKAGE_VERSION, Manifest, Part
from skippy_stage.model.package_fetch import PackageSource, fetch_manifest, fetch_part, open_package, package_cache
from skippy_stage.model.slicing import (
    SLICE_FORMAT_VERSION,
    ModelInfo,
    StageFile,
    cached_file,
    check_architecture,
    layer_index,
    read_model_info,
    write_slice,
)


@dataclass(frozen=True)
class PackagePlan:
    """What a package stage loads, decided and checked before any weights load."""

    source: PackageSource
    manifest: Manifest
    manifest_sha256: str
    cache_dir: Path
    metadata_path: Path  # the metadata part in the cache, its sha256 checked
    info: ModelInfo  # the whole model's header, read from the metadata part
    parts: tuple[Part, ...]  # every part the stage needs, the metadata part first

    @property
    def directory(self) -> Path:
        """Where this package's stage files and header live in the cache."""
        return self.cache_dir / "packages" / self.manifest_sha256[:16]

    @property
    def file_name(self) -> str:
        """The source model's file name (what the header is called in the cache)."""
        name = Path(self.manifest.source_file).name
        return name if name not in ("", ".", "..") else "model.gguf"


@contextlib.contextmanager
def _named(cfg: StageConfig) -> Iterator[None]:
    """Errors of a package stage named by the stage and its package_ref."""
    try:
        yield
    except (ConfigError, UnsupportedModelError) as exc:
        raise type(exc)(f"stage {cfg.stage_id}: package_ref={cfg.package_ref!r}: {exc}") from None


def plan(cfg: StageConfig, *, progress: bool | None = None) -> PackagePlan:
    """Fetch and check the manifest and the metadata part; the parts the stage needs."""
    if cfg.package_ref is None or cfg.manifest_sha256 is None:
        raise ConfigError(f"stage {cfg.stage_id}: no package_ref and manifest_sha256 to load from")
    with _named(cfg):
        cache = package_cache(cfg.cache_dir)
        source = open_package(cfg.package_ref, who=cfg.stage_id)
        manifest = fetch_manifest(source, cfg.manifest_sha256, cache)
        check_architecture(manifest.architecture)
        if cfg.checkpoint_quantization != "preserve" and manifest.tensors is None:
            raise ConfigError(f"checkpoint_quantization={cfg.checkpoint_quantization} needs the whole model's "
                              f"tensor list, which a version {manifest.version} manifest lacks: cut the package "
                              f"again with `skippy-stage package` (version {PACKAGE_VERSION})")
        parts = manifest.parts_for(cfg.layer_start, cfg.layer_end, head=cfg.include_embeddings,
                                   final=bool(cfg.include_output),
                                   needs_output=layer_rules.rule_for(manifest.architecture).needs_output)
        metadata_path = fetch_part(source, parts[0], cache, progress=progress)
        info = read_model_info(metadata_path)
        if (info.architecture, info.block_count) != (manifest.architecture, manifest.block_count):
            raise ModelFileError(
                f"package part {parts[0].path} holds a {info.architecture} model of {info.block_count} layers, but the "
                f"manifest says {manifest.architecture} with {manifest.block_count}")
        return PackagePlan(source, manifest, cfg.manifest_sha256.lower(), cache, metadata_path, info, tuple(parts))


def check(cfg: StageConfig) -> ModelInfo:
    """The whole model's header, once the package has been found to hold what the stage needs."""
    return plan(cfg).info


def prepare(cfg: StageConfig) -> StageConfig:
    """``cfg`` with ``model_path`` at the model's header in the cache (unchanged without package_ref)."""
    if cfg.package_ref is None:
        return cfg
    found = plan(cfg)
    header = found.directory / found.file_name
    with _named(cfg):
        try:
            found.directory.mkdir(parents=True, exist_ok=True)
            tmp = header.with_name(f".{header.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(found.metadata_path, tmp)
            except OSError:
                shutil.copyfile(found.metadata_path, tmp)
            os.replace(tmp, header)
        except OSError as exc:
            raise ConfigError(f"cannot write the model's header {header}: {exc}") from None
    return cfg.replace(model_path=str(header))


def stage_file(cfg: StageConfig, progress: bool | None = None) -> StageFile:
    """The stage file of ``cfg``'s range, from the cache or assembled now from the package's parts;
    with ``checkpoint_quantization``, that file quantized with the whole model's types."""
    found = plan(cfg, progress=progress)
    start, end, final = cfg.layer_start, cfg.layer_end, bool(cfg.include_output)
    role = "final" if final else "inner"
    ident = f"{found.manifest_sha256}|{start}:{end}|{role}|slice-v{SLICE_FORMAT_VERSION}|package-v{PACKAGE_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    path = found.directory / f"{Path(found.file_name).stem}.{start}-{end}.{role}.{key}.gguf"

    def build(tmp: Path) -> None:
        fetched = fetch(found, progress=progress)
        if start == 0 and end == found.manifest.block_count and final:
            write_partial_source(tmp, found, fetched, start, end, progress)  # the whole model: its own stage file
            return
        partial = tmp.with_name(tmp.name + ".source")
        try:
            write_partial_source(partial, found, fetched, start, end, progress)
            write_slice(partial, tmp, start, end, final=final, progress=progress)
        finally:
            partial.unlink(missing_ok=True)

    with _named(cfg):
        made = cached_file(path, build, {"package_ref": cfg.package_ref, "manifest_sha256": found.manifest_sha256,
                                         "layer_start": start, "layer_end": end, "final": final})
    if cfg.checkpoint_quantization == "preserve":
        return made
    quantized = requantize.requantized_stage_file(
        cfg, found.directory / found.file_name, made.path, directory=found.directory,
        source_key=f"package|{found.manifest_sha256}|{start}:{end}|{role}",
        skeleton=lambda dest: write_skeleton(dest, found))
    return StageFile(path=quantized.path, built=made.built or quantized.built,
                     seconds=made.seconds + quantized.seconds)


def write_skeleton(dest: Path, found: PackagePlan) -> None:
    """The whole model's header at ``dest``, as a sparse file: the metadata part's keys (every key of
    the source, byte for byte) and the manifest's tensor infos (every tensor of the source, in its
    order), the weights a hole. llama.cpp's quantizer plans from it, in a dry run, as from the source."""
    tensors = found.manifest.tensors
    if tensors is None:  # plan() refuses quantizing from such a manifest
        raise ConfigError(f"package manifest version {found.manifest.version} lists no tensors")
    meta = _read_part(found.parts[0], found.metadata_path)
    try:
        gguf_file.write_skeleton(dest, meta.metadata,
                                 [(t.name, t.dims, int(GGMLQuantizationType[t.ggml_type])) for t in tensors],
                                 alignment=meta.alignment, order=meta.order)
    except ValueError as exc:
        raise ModelFileError(f"package manifest {found.source.location('manifest.json')}: {exc}") from None


def fetch(found: PackagePlan, *, progress: bool | None = None) -> dict[str, Path]:
    """Every part the stage needs, in the cache (fetched where missing, each checked), by its path
    in the package."""
    return {part.path: fetch_part(found.source, part, found.cache_dir, progress=progress) for part in found.parts}


def write_partial_source(dest: Path, found: PackagePlan, fetched: dict[str, Path], layer_start: int,
                         layer_end: int, progress: bool | None = None) -> None:
    """A GGUF of the whole model's metadata and the tensors of ``[layer_start, layer_end)`` under
    their original names: what the slicer needs of the source to cut this range's stage file."""
    manifest = found.manifest
    readers = {part.path: _read_part(part, fetched[part.path]) for part in found.parts}
    by_role: dict[str, list[Part]] = {}
    for part in found.parts:
        by_role.setdefault(part.role, []).append(part)
    (metadata,) = by_role["metadata"]
    meta = readers[metadata.path]

    tensors: list[gguf_file.Tensor] = []
    for part in by_role.get("embedding", []):
        tensors += _tensors_of(readers[part.path], part, lambda name: manifest.embedding is not None
                               and name == manifest.embedding.name)
    if "embedding" not in by_role and manifest.embedding is not None:
        tensors.append(_zeros_like(manifest, found.source.location("manifest.json")))
    embedding_name = manifest.embedding.name if manifest.embedding is not None else None
    tensors += _tensors_of(meta, metadata, lambda name: layer_index(name) is None and name != embedding_name
                           and not name.startswith("output."))
    for part in by_role.get("layers", []):
        first, last = part.layers or (0, 0)
        held = _tensors_of(readers[part.path], part, lambda name, a=first, b=last: _in_blocks(name, a, b))
        blocks = {layer_index(t.name) for t in held}
        for i in range(max(first, layer_start), min(last, layer_end)):
            if i not in blocks:
                raise ModelFileError(f"package part {part.path} holds no tensor of block {i}")
        tensors += [t for t in held if _in_blocks(t.name, layer_start, layer_end)]
    for part in by_role.get("output", []):
        tensors += _tensors_of(readers[part.path], part, lambda name: name.startswith("output."))

    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    with tqdm(total=sum(t.n_bytes for t in tensors), unit="B", unit_scale=True,
              desc=f"assemble {layer_start}:{layer_end}", disable=not show) as bar:
        gguf_file.write_gguf(dest, meta.metadata, tensors, order=meta.order, alignment=meta.alignment,
                             on_tensor=bar.update)


def _in_blocks(name: str, start: int, end: int) -> bool:
    index = layer_index(name)
    return index is not None and start <= index < end


def _read_part(part: Part, path: Path) -> gguf_file.RawGGUF:
    try:
        return gguf_file.read_raw(path)
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelFileError(f"package part {part.path} is not a GGUF this can read: {exc}") from None


def _tensors_of(raw: gguf_file.RawGGUF, part: Part, belongs: Callable[[str], bool]) -> list[gguf_file.Tensor]:
    """The part's tensors, each of which must be one its role holds."""
    for tensor in raw.tensors:
        if not belongs(tensor.name):
            what = f"layers {part.layers[0]}:{part.layers[1]}" if part.layers else f"a {part.role} part"
            raise ModelFileError(f"package part {part.path} holds tensor {tensor.name}, which is not one of {what}")
    return list(raw.tensors)


def _zeros_like(manifest: Manifest, origin: str) -> gguf_file.Tensor:
    """Zeros in the token embedding's shape and type (all-zero bytes are a valid block of every type)."""
    shape = manifest.embedding
    assert shape is not None
    ggml_type = GGMLQuantizationType[shape.ggml_type]
    block, size = GGML_QUANT_SIZES[ggml_type]
    n = math.prod(shape.dims)
    if n % block or n // block * size != shape.bytes or shape.dims[0] % block:
        raise ModelFileError(f"package manifest {origin}: embedding {shape.name} of dims {list(shape.dims)} and type "
                             f"{shape.ggml_type} cannot be {shape.bytes} bytes")
    return gguf_file.Tensor(shape.name, shape.dims, int(ggml_type), np.zeros(shape.bytes, dtype=np.uint8))


__all__ = ["PackagePlan", "check", "fetch", "plan", "prepare", "stage_file", "write_partial_source", "write_skeleton"]
