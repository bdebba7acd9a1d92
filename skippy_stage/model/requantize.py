"""A stage quantizes its own slice (``checkpoint_quantization``), each tensor to the type the whole
model's quantization gives it.

llama.cpp's ``llama_model_quantize`` picks some tensors' types from the layer index and the layer
count (``use_more_bits(i_layer, n_layer)`` and the ``attn_v``/``ffn_down`` counters of
``llama-quant.cpp`` give the ``_M``/``_S`` mixes more bits in some layers; a file without
``output.weight`` has its token embeddings quantized as the output head). A slice has neither the
whole model's indices nor its count, so quantized alone it would get other types. The stage therefore:

1. asks llama.cpp for the whole model's type plan: ``llama_model_quantize`` with ``dry_run`` on the
   whole GGUF (it reads the header and tensor infos, never the weights) logs one line per tensor with
   the type it would write, caught through ``llama_log_set``. This is the public C API: the C++
   helpers (``llama_quant_compute_types``) would give the same plan but only through mangled names
   and C++ types, which change without notice between llama.cpp versions;
2. quantizes the slice with one exact-name override per tensor (``tt_overrides``, renumbered to the
   slice's block indices), so every tensor gets the plan's type and llama.cpp's own choice is never
   consulted. Each tensor's bytes depend only on its own values, its type and its imatrix rows, so
   the slice's tensors are the whole quantized model's, bit for bit.

The dry run needs only the header: a stage loaded from a layer package plans on a sparse "skeleton"
(the whole model's header, the weights a hole) written from the package's metadata part and its
manifest's tensor list (``package_stage.write_skeleton``).
Importance matrices are read from llama.cpp's imatrix GGUF (``<tensor>.in_sum2`` and ``<tensor>.counts``, normalised as
``llama-quantize`` does) after their sha256 is checked. The result lives in the stage-file cache,
keyed by the slice's key (the source's identity, the range and the role), the type and the imatrix.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import structlog
from llama_cpp import _logger as llama_logger

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, SliceError
from skippy_stage.model import llama_ffi
from skippy_stage.model.slicing import StageFile, cache_key, cached_file, default_cache_dir, layer_index, sha256_file

log = structlog.get_logger("skippy_stage.requantize")

QUANT_FORMAT_VERSION = 1
# llama-quant.cpp's tensor_requires_imatrix: these target types need an importance matrix (Q2_K
# only in a Q2_K_S file); token embeddings and the output head never do.
IMATRIX_TYPES = frozenset({"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"})
# One line of the quantizer's per-tensor log: "[  12/ 184] blk.1.attn_v.weight - [ 256, 256, 1, 1],
# type = f32, size = 0.250 MiB -> 0.066 MiB (q6_K)" ("-> ... (type)" only when it converts).
_PLAN_LINE = re.compile(
    r"\[\s*\d+/\s*\d+\]\s+(?P<name>\S+)\s+-\s+\[[^\]]*\],\s+type\s*=\s*(?P<cur>\w+),\s+"
    r"size\s*=\s*[\d.]+\s*MiB(?:\s*->\s*[\d.]+\s*MiB\s*\((?P<new>\w+)\))?"
)
_log_lock = threading.Lock()  # llama_log_set is process-wide: one capture at a time


def ftype_of(quantization: str) -> int:
    """llama.cpp's ``llama_ftype`` for a ``checkpoint_quantization`` name (``Q4_K_M`` -> 15)."""
    value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quantization}", None)
    if value is None:
        raise ConfigError(f"checkpoint_quantization={quantization!r} is not a type this llama.cpp build makes")
    return int(value)


def ggml_type_of(name: str) -> int:
    """ggml's type enum for a type name as llama.cpp prints it (``q6_K`` -> 14)."""
    return int(gguf.GGMLQuantizationType[name.upper()])


@dataclass(frozen=True)
class TypePlan:
    """The type the whole model's quantization gives each tensor (ggml type names, upper case)."""

    quantization: str
    types: dict[str, str]

    def for_slice(self, layer_start: int, layer_end: int, tensor_names: list[str]) -> dict[str, str]:
        """Each of a slice's tensors (named as in the slice: blocks renumbered from 0) -> its type."""
        out = {}
        for name in tensor_names:
            i = layer_index(name)
            whole = name if i is None else re.sub(r"^blk\.\d+\.", f"blk.{i + layer_start}.", name)
            if whole not in self.types:
                raise SliceError(f"tensor {name} of the slice {layer_start}:{layer_end} is not in the whole model's plan")
            out[name] = self.types[whole]
        return out

    def needs_imatrix(self) -> list[str]:
        """The tensors whose planned type llama.cpp makes only with an importance matrix."""
        return [n for n, t in self.types.items()
                if (t in IMATRIX_TYPES or (t == "Q2_K" and self.quantization == "Q2_K_S"))
                and n not in ("token_embd.weight", "output.weight")]


class _Arrays:
    """ctypes arrays llama.cpp reads during one call, with everything they point into kept alive."""

    def __init__(self, overrides: dict[str, str] | None, imatrix: dict[str, np.ndarray] | None) -> None:
        self.keep: list[object] = []
        self.tt_overrides = None
        self.imatrix = None
        if overrides:
            arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
            for i, (name, type_name) in enumerate(sorted(overrides.items())):
                pattern = ("^" + re.escape(name) + "$").encode()
                self.keep.append(pattern)
                arr[i].pattern = pattern
                arr[i].type = ggml_type_of(type_name)
            arr[len(overrides)].pattern = None
            self.tt_overrides, self.keep = arr, [*self.keep, arr]
        if imatrix:
            arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
            for i, (name, values) in enumerate(sorted(imatrix.items())):
                values = np.ascontiguousarray(values, dtype=np.float32)
                encoded = name.encode()
                self.keep += [values, encoded]
                arr[i].name = encoded
                arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                arr[i].size = values.size
            arr[len(imatrix)].name = None
            self.imatrix, self.keep = arr, [*self.keep, arr]


def _params(quantization: str, nthread: int, arrays: _Arrays, *, dry_run: bool) -> llama_cpp.llama_model_quantize_params:
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = nthread
    params.ftype = ftype_of(quantization)
    params.allow_requantize = True  # the type was asked for; a quantized source is dequantized first
    params.dry_run = dry_run
    if arrays.tt_overrides is not None:
        params.tt_overrides = ctypes.cast(arrays.tt_overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if arrays.imatrix is not None:
        params.imatrix = ctypes.cast(arrays.imatrix, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    return params


def whole_model_plan(source: str | os.PathLike[str], quantization: str,
                     imatrix: dict[str, np.ndarray] | None = None, nthread: int = 1) -> TypePlan:
    """The whole model's per-tensor types for ``quantization``, from a dry run of llama.cpp's quantizer
    on ``source`` (the whole GGUF, or its skeleton): only the header is read."""
    arrays = _Arrays(None, imatrix)
    params = _params(quantization, nthread, arrays, dry_run=True)
    with tempfile.TemporaryDirectory(prefix="skippy-plan-") as scratch:  # a dry run writes nothing
        rc, text = _quantize_logged(Path(source), Path(scratch) / "none.gguf", params)
    if rc != 0:
        tail = " ".join(text.strip().splitlines()[-3:])
        raise SliceError(f"llama.cpp could not plan the {quantization} quantization of {source}: {tail}")
    types = {m["name"]: (m["new"] or m["cur"]).upper() for m in _PLAN_LINE.finditer(text)}
    if not types:
        raise SliceError(f"llama.cpp's dry run of {source} logged no tensor types (its log format changed?)")
    return TypePlan(quantization, types)


def quantize_file(source: str | os.PathLike[str], dest: str | os.PathLike[str], quantization: str, *,
                  types: dict[str, str] | None = None, imatrix: dict[str, np.ndarray] | None = None,
                  nthread: int = 1) -> None:
    """``llama_model_quantize`` of ``source`` into ``dest``; ``types`` pins each named tensor's type."""
    arrays = _Arrays(types, imatrix)
    params = _params(quantization, nthread, arrays, dry_run=False)
    rc, text = _quantize_logged(Path(source), Path(dest), params)
    if rc != 0:
        tail = " ".join(text.strip().splitlines()[-3:])
        raise SliceError(f"llama.cpp could not quantize {source} to {quantization}: {tail}")


def _quantize_logged(source: Path, dest: Path, params: llama_cpp.llama_model_quantize_params) -> tuple[int, str]:
    """``llama_model_quantize`` with llama.cpp's log caught (a line per tensor, and a fallback warning
    for every row length a type cannot take): the return code and the log's text."""
    llama_ffi.init_backend()
    pieces: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pieces.append(text.decode("utf-8", "replace"))

    with _log_lock:  # the callback is process-wide; llama.cpp holds it until it is replaced
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            rc = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(dest), ctypes.byref(params))
        finally:
            llama_cpp.llama_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))
    return rc, "".join(pieces)


def read_imatrix(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A llama.cpp imatrix GGUF as the quantizer takes it: each tensor's mean squared activations
    (``in_sum2 / counts`` per matrix; 1 where a matrix was never seen), as ``llama-quantize`` reads it."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint_imatrix={str(path)!r} is not a readable imatrix GGUF: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name[: -len(".in_sum2")]
        counts_t = tensors.get(base + ".counts")
        if counts_t is None:
            raise ConfigError(f"checkpoint_imatrix={str(path)!r}: {base} has sums but no counts")
        counts = np.rint(np.asarray(counts_t.data, dtype=np.float32).reshape(-1)).astype(np.float32)
        sums = np.asarray(t.data, dtype=np.float32).reshape(len(counts), -1)
        values = np.ones_like(sums)
        seen = counts > 0
        values[seen] = sums[seen] / counts[seen, None]
        out[base] = values.reshape(-1)
    if not out:
        raise ConfigError(f"checkpoint_imatrix={str(path)!r} holds no importance data (no .in_sum2 tensors)")
    return out


def checked_imatrix(cfg: StageConfig) -> dict[str, np.ndarray] | None:
    """The config's importance matrix, after its sha256 matched ``checkpoint_imatrix_sha256``."""
    if cfg.checkpoint_imatrix is None:
        return None
    path = Path(cfg.checkpoint_imatrix)
    try:
        digest = sha256_file(path)
    except OSError as exc:
        raise ConfigError(f"stage {cfg.stage_id}: checkpoint_imatrix={cfg.checkpoint_imatrix!r} "
                          f"cannot be read: {exc.strerror}") from None
    if digest != str(cfg.checkpoint_imatrix_sha256).lower():
        raise ConfigError(f"stage {cfg.stage_id}: checkpoint_imatrix_sha256={cfg.checkpoint_imatrix_sha256!r} "
                          f"does not match checkpoint_imatrix={cfg.checkpoint_imatrix!r} (its sha256 is {digest})")
    return read_imatrix(path)


def slice_imatrix(imatrix: dict[str, np.ndarray] | None, layer_start: int, layer_end: int) -> dict[str, np.ndarray] | None:
    """The entries of a slice's tensors, renamed to the slice's block indices."""
    if imatrix is None:
        return None
    out = {}
    for name, values in imatrix.items():
        i = layer_index(name)
        if i is None:
            out[name] = values
        elif layer_start <= i < layer_end:
            out[re.sub(r"^blk\.\d+\.", f"blk.{i - layer_start}.", name)] = values
    return out


def uses_token_embd(head: bool, final: bool, tensors: dict[str, str]) -> bool:
    """Whether a stage computes with its ``token_embd.weight``: the head embeds tokens with it, and a
    final stage without ``output.weight`` uses it as the output head (tied embeddings). Every other
    stage file carries it only because llama.cpp refuses a file without it, so it stays as it is."""
    return "token_embd.weight" in tensors and (head or (final and "output.weight" not in tensors))


def requantized_stage_file(cfg: StageConfig, whole_model: Path, stage_path: Path, *,
                           source_key: str | None = None, directory: Path | None = None,
                           skeleton: Callable[[Path], None] | None = None) -> StageFile:
    """The stage file ``stage_path`` (the slice of ``whole_model`` for this range, or the whole model
    itself) quantized to ``cfg.checkpoint_quantization`` with the whole model's types, built or reused
    from the cache.

    A stage without the whole GGUF (one loaded from a layer package) gives ``source_key`` (what names
    the model and the stage's range and role in the cache key, in place of the file's identity),
    ``directory`` (where the file is cached) and ``skeleton(dest)``, which writes the whole model's
    header at ``dest`` as a sparse file: the plan is made from that, only when the file is built."""
    started = time.perf_counter()
    quantization = cfg.checkpoint_quantization
    imatrix = checked_imatrix(cfg)
    role = "final" if cfg.include_output else "inner"
    if source_key is None:
        source_key = cache_key(whole_model, cfg.layer_start, cfg.layer_end, bool(cfg.include_output))
    ident = "|".join((source_key, quantization, str(cfg.checkpoint_imatrix_sha256 or "-").lower(),
                      f"q{QUANT_FORMAT_VERSION}"))
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    if directory is None:
        directory = Path(cfg.cache_dir) if cfg.cache_dir is not None else default_cache_dir()
    path = directory / f"{whole_model.stem}.{cfg.layer_start}-{cfg.layer_end}.{role}.{quantization}.{key}.gguf"

    def whole_plan() -> TypePlan:
        if skeleton is None:
            return whole_model_plan(whole_model, quantization, imatrix, cfg.n_threads)
        with tempfile.TemporaryDirectory(prefix=".skeleton-", dir=directory) as scratch:
            header = Path(scratch) / whole_model.name
            skeleton(header)
            return whole_model_plan(header, quantization, imatrix, cfg.n_threads)

    def build(tmp: Path) -> None:
        plan = whole_plan()
        missing = plan.needs_imatrix() if imatrix is None else []
        if missing:
            raise ConfigError(f"stage {cfg.stage_id}: checkpoint_imatrix is unset, but llama.cpp quantizes "
                              f"{missing[0]} to {plan.types[missing[0]]} for checkpoint_quantization={quantization} "
                              f"only with an importance matrix")
        held = {t.name: t.tensor_type.name for t in gguf.GGUFReader(stage_path).tensors}
        types = plan.for_slice(cfg.layer_start, cfg.layer_end, list(held))
        if not uses_token_embd(cfg.layer_start == 0, bool(cfg.include_output), held):
            types["token_embd.weight"] = held["token_embd.weight"]  # only there because llama.cpp wants it
        quantize_file(stage_path, tmp, quantization, types=types,
                      imatrix=slice_imatrix(imatrix, cfg.layer_start, cfg.layer_end), nthread=cfg.n_threads)

    origin = str(whole_model.resolve()) if skeleton is None else source_key
    made = cached_file(path, build, {"source": origin, "layer_start": cfg.layer_start,
                                     "layer_end": cfg.layer_end, "final": bool(cfg.include_output),
                                     "quantization": quantization,
                                     "imatrix_sha256": cfg.checkpoint_imatrix_sha256}, started=started)
    if made.built:
        log.info("requantized stage file", stage_id=cfg.stage_id, quantization=quantization, path=str(made.path),
                 bytes=made.path.stat().st_size, seconds=round(made.seconds, 3))
    return made


__all__ = [
    "TypePlan",
    "checked_imatrix",
    "ftype_of",
    "quantize_file",
    "read_imatrix",
    "requantized_stage_file",
    "slice_imatrix",
    "uses_token_embd",
    "whole_model_plan",
]
