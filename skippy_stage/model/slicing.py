"""Model slicing: write the GGUF file that holds one stage's layer range.

llama.cpp has no "run layers a..b" call, so each stage loads a file that *is* a smaller
model: blocks ``[layer_start, layer_end)`` renumbered from 0, per-layer metadata arrays
sliced to match, the token embeddings (llama.cpp insists on them) and the final norm
always, and the output head only for the final stage. Tensor bytes are copied verbatim,
whatever their quantisation, which is what keeps a split bit-exact.

Layer-index-dependent behaviour must survive renumbering (Gemma-3 derives which layers use
sliding-window attention from the layer index, DeepSeek counts its leading dense blocks):
``layer_rules`` says, per architecture, which metadata the slice rewrites, or why it cannot.
An architecture is accepted only when ``skippy-stage verify`` runs prove its splits exact
(the generated ``proofs`` table).

Stage files are cached (keyed by the source file's identity, the range and the role),
written atomically and verified against a digest manifest before reuse.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

from skippy_stage.errors import ConfigError, ModelFileError, SliceError, UnsupportedModelError
from skippy_stage.model import gguf_file, layer_rules, proofs

MANIFEST_SUFFIX = ".manifest.json"
SLICE_FORMAT_VERSION = 4


def accepted_architectures() -> dict[str, list[dict[str, object]]]:
    """Architectures every proof row of which is exact, with those rows."""
    return {arch: rows for arch, rows in proofs.PROOFS.items()
            if rows and all(r["exact"] for r in rows) and arch not in layer_rules.STRUCTURAL_REFUSALS}


@dataclass(frozen=True)
class ModelInfo:
    """The facts about a GGUF that the planner, the config check and the runtime need."""

    path: Path
    architecture: str
    block_count: int
    n_embd: int
    n_vocab: int
    name: str
    # Header metadata: scalars, and numeric arrays (per-layer values) up to a bound.
    metadata: dict[str, object] = dataclass_field(default_factory=dict, repr=False, compare=False)

    def per_layer(self, key: str) -> tuple[int, ...] | None:
        """``{arch}.{key}``, one value per block (a scalar is repeated); None if absent."""
        value = self.metadata.get(f"{self.architecture}.{key}")
        if value is None:
            return None
        if isinstance(value, tuple):
            return tuple(int(v) for v in value)
        return (int(value),) * self.block_count


def _field_value(reader: GGUFReader, key: str) -> object | None:
    field = reader.get_field(key)
    return None if field is None else field.contents()


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


_SMALL_ARRAY = 1 << 16


def _read_header_kv(path: Path) -> dict[str, object]:
    """Scalar metadata of a GGUF, without parsing tensors: numeric arrays of up to
    ``_SMALL_ARRAY`` values (per-layer hyper-parameters) as tuples, other arrays (the
    vocabulary) reduced to their length.

    GGUFReader materialises every vocabulary string as a numpy view (seconds for a small
    model); a stage only needs a handful of scalars at start-up, so walk the header here.
    """
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("missing GGUF magic")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        offset = 24
        out: dict[str, object] = {}

        def read_string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + length]).decode("utf-8", errors="replace"), at + 8 + length

        def skip_value(vtype: int, at: int) -> tuple[object, int]:
            if vtype == _STRING:
                return read_string(at)
            if vtype == _ARRAY:
                sub, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if sub in _SCALAR_FORMATS:
                    fmt = _SCALAR_FORMATS[sub]
                    end = at + count * struct.calcsize(fmt)
                    if count <= _SMALL_ARRAY:
                        return struct.unpack_from(f"<{count}{fmt[1:]}", buf, at), end
                    return count, end
                for _ in range(count):
                    _, at = skip_value(sub, at)
                return count, at
            fmt = _SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

        for _ in range(n_kv):
            key, offset = read_string(offset)
            (vtype,) = struct.unpack_from("<I", buf, offset)
            out[key], offset = skip_value(vtype, offset + 4)
        return out


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Read the header of a GGUF, refusing files that are missing, not GGUF, or whose keys the
    slicer, the planner or llama.cpp would trip on (:class:`ModelFileError` names the key)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model file not found: {path}")
    try:
        kv = _read_header_kv(path)
    except (ValueError, OSError, struct.error, KeyError) as exc:
        raise ModelFileError(f"model file {path} is not a readable GGUF: {exc}") from exc
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(f"model file {path}: key general.architecture is {_shown(arch)}, not an architecture name")
    block_count = _positive_int(path, kv, f"{arch}.block_count")
    n_embd = _positive_int(path, kv, f"{arch}.embedding_length")
    for key in _PER_LAYER_KEYS:
        _check_per_layer(path, kv, f"{arch}.{key}", block_count)
    context = kv.get(f"{arch}.context_length")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)):
        raise ModelFileError(f"model file {path}: key {arch}.context_length is {_shown(context)}, not an integer")
    return ModelInfo(
        path=path,
        architecture=arch,
        block_count=block_count,
        n_embd=n_embd,
        n_vocab=_length(kv.get("tokenizer.ggml.tokens", 0)),
        name=str(kv.get("general.name") or path.stem),
        metadata=kv,
    )


# Keys read as one number per layer (``ModelInfo.per_layer``, ``layer_rules``, llama.cpp's
# ``get_key_or_arr``, which refuses an array whose length is not the block count).
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "attention.key_length",
                   "attention.value_length", "feed_forward_length", "attention.sliding_window",
                   "attention.sliding_window_pattern", "attention.recurrent_layers")


def _shown(value: object) -> str:
    if value is None:
        return "missing"
    if isinstance(value, tuple):
        return f"an array of {len(value)} values"
    return f"{value!r}" if not isinstance(value, int) or isinstance(value, bool) else str(value)


def _positive_int(path: Path, kv: dict[str, object], key: str) -> int:
    value = kv.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFileError(f"model file {path}: key {key} is {_shown(value)}, not a positive integer")
    return value


def _check_per_layer(path: Path, kv: dict[str, object], key: str, block_count: int) -> None:
    value = kv.get(key)
    if value is None:
        return
    if isinstance(value, tuple):
        if len(value) != block_count:
            raise ModelFileError(f"model file {path}: key {key} holds {len(value)} values for {block_count} "
                                 f"blocks (one per block, or one for all)")
        value_ok = all(isinstance(v, (int, float)) for v in value)
    else:
        value_ok = isinstance(value, (int, float))
    if not value_ok:
        raise ModelFileError(f"model file {path}: key {key} is {_shown(value)}, not a number (or one per block)")


def open_reader(path: Path) -> GGUFReader:
    """gguf-py's reader over ``path``; a file it cannot parse is a :class:`ModelFileError`."""
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError, struct.error, KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"model file {path} is not a GGUF gguf-py can read: {type(exc).__name__}: {exc}") from exc


def overrides_for(info: ModelInfo, layer_start: int, layer_end: int, final: bool) -> dict[str, tuple[str, object]]:
    """``layer_rules.slice_overrides`` for the file, a value it cannot use refused naming the file."""
    try:
        return layer_rules.slice_overrides(info.metadata, info.architecture, layer_start, layer_end, final)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ModelFileError(f"model file {info.path}: its {info.architecture} metadata cannot be sliced at "
                             f"{layer_start}:{layer_end}: {type(exc).__name__}: {exc}") from exc


def _length(value: object) -> int:
    return len(value) if isinstance(value, tuple) else int(value)


_PROVING: contextvars.ContextVar[bool] = contextvars.ContextVar("skippy_proving", default=False)


@contextlib.contextmanager
def proving() -> Iterator[None]:
    """Let an architecture that no proof accepts yet be sliced, for ``skippy-stage verify`` only:
    the proof itself must be able to run the split it judges."""
    token = _PROVING.set(True)
    try:
        yield
    finally:
        _PROVING.reset(token)


def check_architecture(arch: str) -> None:
    """Refuse ``arch`` unless a proof accepts it, saying why."""
    layer_rules.refuse_structurally(arch)
    if _PROVING.get() or arch in accepted_architectures():
        return
    failed = [r for r in proofs.PROOFS.get(arch, []) if not r["exact"]]
    if failed:
        r = failed[0]
        why = r.get("reason") or f"split {r['split']} differs by up to {r['max_abs_diff']}"
        raise UnsupportedModelError(f"architecture {arch!r} is refused: its proof failed on fixture {r['fixture']}: {why}")
    raise UnsupportedModelError(
        f"architecture {arch!r} is refused: no skippy-stage verify run proves its layer splits match the unsplit "
        f"model yet (accepted: {', '.join(sorted(accepted_architectures()))}); run `skippy-stage verify` on it"
    )


def _check_range(info: ModelInfo, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= info.block_count:
        raise ConfigError(
            f"layer range {layer_start}:{layer_end} is not a non-empty range inside the "
            f"{info.block_count} blocks of {info.path.name}"
        )


# Arrays of a fixed length (not one value per layer), never sliced even when a tiny model's
# block count happens to equal their length.
_FIXED_LENGTH_ARRAYS = "{arch}.rope.dimension_sections {arch}.deepstack_mapping"


def layer_index(name: str) -> int | None:
    """The block a tensor belongs to (``blk.{i}.*``), or None for a tensor of the whole model."""
    if not name.startswith("blk."):
        return None
    index, _, _ = name[4:].partition(".")
    return int(index)


def _is_kept(name: str, layer_start: int, layer_end: int, final: bool, keep_output: bool = False) -> str | None:
    """The tensor's name in the slice, or None when the slice drops it."""
    index = layer_index(name)
    if index is not None:
        rest = name[4:].partition(".")[2]
        return f"blk.{index - layer_start}.{rest}" if layer_start <= index < layer_end else None
    if name.startswith("output.") and not (final or keep_output):
        return None
    return name


def write_slice(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    layer_start: int,
    layer_end: int,
    *,
    final: bool,
    progress: bool | None = None,
) -> None:
    """Write the stage file for ``[layer_start, layer_end)`` of ``source`` to ``dest``.

    Every metadata value the slice does not rewrite is copied as the source holds it (type
    tag and bytes, empty arrays included), and so is every kept tensor: the slice is its
    source minus the blocks it drops. Not atomic by itself; :func:`stage_file` wraps it with
    temp-file, fsync and rename.
    """
    source = Path(source)
    info = read_model_info(source)
    check_architecture(info.architecture)
    _check_range(info, layer_start, layer_end)
    arch = info.architecture
    n_total = info.block_count
    overrides = overrides_for(info, layer_start, layer_end, final)
    keep_output = layer_rules.rule_for(arch).needs_output
    reader = open_reader(source)
    order = gguf_file.byte_order(reader)
    fixed_length = _FIXED_LENGTH_ARRAYS.format(arch=arch).split()

    metadata: list[tuple[str, bytes]] = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in overrides:
            continue
        vtype = field.types[0]
        if field.name == f"{arch}.block_count":
            raw = gguf_file.pack_value(vtype, layer_end - layer_start, order=order)
        elif (vtype == GGUFValueType.ARRAY and field.name.startswith(f"{arch}.") and field.name not in fixed_length
              and gguf_file.array_length(field) == n_total and gguf_file.item_type(field) != GGUFValueType.ARRAY):
            raw = gguf_file.array_items(field, layer_start, layer_end, order=order)
        else:
            raw = gguf_file.raw_value(field)
        metadata.append((field.name, raw))
    for key, (kind, value) in sorted(overrides.items()):
        if kind == "bools":
            raw = gguf_file.pack_value(GGUFValueType.ARRAY, list(value), GGUFValueType.BOOL, order=order)
        else:
            raw = gguf_file.pack_value(GGUFValueType.UINT32 if kind == "uint32" else GGUFValueType.FLOAT32, value,
                                       order=order)
        metadata.append((key, raw))
    for key, value in (("version", SLICE_FORMAT_VERSION), ("layer_start", layer_start), ("layer_end", layer_end),
                       ("source_block_count", n_total)):
        metadata.append((f"skippy.slice.{key}", gguf_file.pack_value(GGUFValueType.UINT32, value, order=order)))
    metadata.append(("skippy.slice.final", gguf_file.pack_value(GGUFValueType.BOOL, final, order=order)))

    kept = []
    for tensor in reader.tensors:
        new_name = _is_kept(tensor.name, layer_start, layer_end, final, keep_output)
        if new_name is not None:
            kept.append(gguf_file.tensor_from_reader(reader, tensor, new_name))
    alignment = _field_value(reader, "general.alignment")
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    with tqdm(total=sum(t.n_bytes for t in kept), unit="B", unit_scale=True, desc=f"slice {layer_start}:{layer_end}",
              disable=not show) as bar:
        gguf_file.write_gguf(dest, metadata, kept, order=order, on_tensor=bar.update,
                             alignment=gguf_file.DEFAULT_ALIGNMENT if alignment is None else int(alignment))


def default_cache_dir() -> Path:
    """``$SKIPPY_STAGE_CACHE`` if set, else ``$XDG_CACHE_HOME/skippy-stage`` (``~/.cache``)."""
    override = os.environ.get("SKIPPY_STAGE_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skippy-stage"


def _source_identity(source: Path) -> str:
    st = source.stat()
    return f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def cache_key(source: Path, layer_start: int, layer_end: int, final: bool) -> str:
    ident = f"{_source_identity(source)}|{layer_start}:{layer_end}|{'final' if final else 'inner'}|v{SLICE_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def sha256_file(path: Path, on_chunk: Callable[[int], None] | None = None) -> str:
    """The sha256 of a file's bytes, as 64 lowercase hex digits (``on_chunk``: each chunk's length read)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return h.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cached_file_is_intact(path: Path, manifest_path: Path) -> bool:
    """True only when the file matches the size and digest recorded when it was written."""
    try:
        manifest = json.loads(manifest_path.read_text())
        if path.stat().st_size != manifest["size"]:
            return False
        return sha256_file(path) == manifest["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class StageFile:
    """A stage file ready to load, and whether this call had to build it."""

    path: Path
    built: bool
    seconds: float


def stage_file(
    source: str | os.PathLike[str],
    layer_start: int,
    layer_end: int,
    *,
    final: bool,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> StageFile:
    """Return a verified stage file for the range, building it only when missing or damaged.

    A whole-model final range needs no slicing: the source itself is the stage file.
    """
    started = time.perf_counter()
    source = Path(source)
    info = read_model_info(source)
    check_architecture(info.architecture)
    _check_range(info, layer_start, layer_end)
    if layer_start == 0 and layer_end == info.block_count and final:
        return StageFile(path=source, built=False, seconds=time.perf_counter() - started)

    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(source, layer_start, layer_end, final)
    role = "final" if final else "inner"
    path = directory / f"{source.stem}.{layer_start}-{layer_end}.{role}.{key}.gguf"
    return cached_file(
        path, lambda tmp: write_slice(source, tmp, layer_start, layer_end, final=final, progress=progress),
        {"source": str(source.resolve()), "layer_start": layer_start, "layer_end": layer_end, "final": final},
        started=started)


def cached_file(path: Path, build: Callable[[Path], None], record: dict[str, object], *,
                started: float | None = None) -> StageFile:
    """``path`` if it is intact (its size and sha256 what its digest manifest recorded when it was
    written), else built now by ``build(tmp)`` into a temporary file beside it, fsynced and renamed
    into place with a new digest manifest holding ``record`` too."""
    started = time.perf_counter() if started is None else started
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = path.with_name(path.name + MANIFEST_SUFFIX)
    if path.exists() and _cached_file_is_intact(path, manifest_path):
        return StageFile(path=path, built=False, seconds=time.perf_counter() - started)

    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        build(tmp)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        manifest = {"size": tmp.stat().st_size, "sha256": sha256_file(tmp), **record}
        manifest_path.unlink(missing_ok=True)
        tmp.chmod(0o644)
        os.replace(tmp, path)
        tmp_manifest = manifest_path.with_name(manifest_path.name + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=1))
        with tmp_manifest.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_manifest, manifest_path)
        _fsync_dir(directory)
    except OSError as exc:
        raise SliceError(f"cannot write stage file {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return StageFile(path=path, built=True, seconds=time.perf_counter() - started)


def slice_metadata(path: str | os.PathLike[str]) -> dict[str, int | bool] | None:
    """The ``skippy.slice.*`` keys of a stage file, or None for an unsliced GGUF."""
    try:
        kv = _read_header_kv(Path(path))
    except (ValueError, OSError, struct.error, KeyError) as exc:
        raise ModelFileError(f"model file {path} is not a readable GGUF: {exc}") from exc
    out: dict[str, int | bool] = {}
    for key in ("layer_start", "layer_end", "source_block_count", "final"):
        value = kv.get(f"skippy.slice.{key}")
        if value is None:
            return None
        out[key] = bool(value) if key == "final" else int(value)
    return out


__all__ = [
    "accepted_architectures",
    "ModelInfo",
    "StageFile",
    "check_architecture",
    "open_reader",
    "overrides_for",
    "read_model_info",
    "slice_metadata",
    "stage_file",
    "write_slice",
]
