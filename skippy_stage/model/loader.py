"""What a stage asks of llama.cpp when it loads: the parameter structs and the host policy.

Why a module of its own: llama-cpp-python binds llama.cpp's parameter structs as ctypes
Structures, and a ctypes Structure accepts *any* attribute name. ``params.use_mmap = False``
on a struct that no longer has the field (it became ``load_mode``) sets a Python attribute
and changes nothing; that bug shipped once. Every field here is set through
:func:`set_fields`, which refuses a name the struct does not have.

The same policy builds the test suite's and the benchmark's unsplit reference
(:func:`reference_llama`), so the split and the reference run the same kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import llama_cpp
import structlog

from skippy_stage.config import CACHE_TYPE_BYTES, StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import host as host_facts
from skippy_stage.model import threadpool
from skippy_stage.model.slicing import ModelInfo

log = structlog.get_logger("skippy_stage.loader")

# ggml's type ids for config.CACHE_TYPES (a test checks the two agree).
CACHE_TYPE_IDS = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30,
}
FLASH_ATTN_IDS = {"auto": -1, "disabled": 0, "enabled": 1}
SPLIT_MODE_IDS = {
    "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
    "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
    "tensor": llama_cpp.LLAMA_SPLIT_MODE_TENSOR,
}

# Share of the host's available memory an automatically sized KV cache may take.
AUTO_CTX_MEMORY_SHARE = 0.5
# Automatic context sizes are multiples of this (llama.cpp pads the KV cache to 256 cells).
AUTO_CTX_STEP = 256
# A GGUF without a training context length gets this.
FALLBACK_CTX = 4096


def set_fields(struct: ctypes.Structure, **values: Any) -> ctypes.Structure:
    """Set ctypes fields by name, refusing any name the structure does not declare."""
    declared = {name for name, *_ in type(struct)._fields_}
    missing = sorted(set(values) - declared)
    if missing:
        raise ConfigError(
            f"{type(struct).__name__} of llama-cpp-python {getattr(llama_cpp, '__version__', '?')} has no field(s) "
            f"{', '.join(missing)}; this skippy-stage needs a llama-cpp-python whose structs have them"
        )
    for name, value in values.items():
        setattr(struct, name, value)
    return struct


def load_mode(cfg: StageConfig) -> int:
    """The seed's mmap / mlock / direct_io -> llama.cpp's ``load_mode``."""
    if cfg.direct_io:
        return llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO
    if cfg.mmap is None:
        # AUTO maps the file where every device supports it; mlock wants mmap.
        return llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK if cfg.mlock else llama_cpp.LLAMA_LOAD_MODE_AUTO
    if cfg.mmap:
        return llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK if cfg.mlock else llama_cpp.LLAMA_LOAD_MODE_MMAP
    return llama_cpp.LLAMA_LOAD_MODE_MLOCK if cfg.mlock else llama_cpp.LLAMA_LOAD_MODE_NONE


def check_repack(repack: bool, info: host_facts.HostInfo, *, who: str) -> None:
    """Refuse weight repacking where llama.cpp is known to crash with it, before it loads."""
    if repack and info.amx:
        raise ConfigError(
            f"{who}: repack=true is refused on this CPU (llama.cpp reports AMX_INT8 = 1): weights "
            f"repacked into the AMX buffer type crash the process ({host_facts.AMX_REPACK_CRASH}); "
            f"set repack=false"
        )


@dataclass
class ModelParams:
    """``llama_model_params`` plus the memory its pointers refer to (kept alive with it)."""

    params: llama_cpp.llama_model_params
    devices: Any = None  # the NULL-terminated device array ``params.devices`` points to


def model_params(cfg: StageConfig, info: host_facts.HostInfo | None = None) -> ModelParams:
    """The model parameters a stage loads with; raises ConfigError naming the setting."""
    info = info or host_facts.host_info()
    who = f"stage {cfg.stage_id}"
    check_repack(cfg.repack, info, who=who)
    params = llama_cpp.llama_model_default_params()
    set_fields(
        params,
        n_gpu_layers=cfg.n_gpu_layers if cfg.n_gpu_layers >= 0 else 2**31 - 1,
        load_mode=load_mode(cfg),
        use_extra_bufts=cfg.repack,
        check_tensors=cfg.check_tensors,
        no_host=cfg.no_host_buffer,
        main_gpu=cfg.main_gpu,
    )
    if cfg.native_mtp_enabled:
        # The next-n blocks load only when asked; an MTP context on a model loaded without them aborts
        # the process (``GGML_ASSERT(layer.nextn.eh_proj)``), so the runtime creates one only after this.
        set_fields(params, load_mtp=True)
    if cfg.split_mode != "auto":
        set_fields(params, split_mode=SPLIT_MODE_IDS[cfg.split_mode])
    out = ModelParams(params)
    if cfg.selected_device is not None:
        handle = host_facts.device_handle(cfg.selected_device)
        if handle is None:
            raise ConfigError(
                f"{who}: selected_device={cfg.selected_device!r} is not a device of this host "
                f"(devices: {', '.join(info.device_names()) or 'none'})"
            )
        # The list names the devices to offload to; the CPU is always used, so choosing it
        # means an empty list: no offload at all.
        chosen = [] if _is_cpu(cfg.selected_device, info) else [handle]
        out.devices = (ctypes.c_void_p * (len(chosen) + 1))(*chosen, None)
        set_fields(params, devices=ctypes.cast(out.devices, ctypes.c_void_p))
    return out


def _is_cpu(name: str, info: host_facts.HostInfo) -> bool:
    return any(d.name == name and d.type == "cpu" for d in info.devices)


def context_params(cfg: StageConfig, n_ctx: int, callback: object | None,
                   user_data: int | None = None) -> llama_cpp.llama_context_params:
    params = llama_cpp.llama_context_default_params()
    set_fields(
        params,
        n_ctx=n_ctx,
        n_batch=cfg.n_batch,
        n_ubatch=cfg.n_ubatch,
        n_seq_max=cfg.lane_count,
        n_threads=cfg.n_threads,
        n_threads_batch=cfg.threads_batch,
        flash_attn_type=FLASH_ATTN_IDS[cfg.flash_attn_type],
        type_k=CACHE_TYPE_IDS[cfg.cache_type_k],
        type_v=CACHE_TYPE_IDS[cfg.cache_type_v],
        offload_kqv=cfg.kv_offload,
        kv_unified=cfg.kv_unified,
        swa_full=cfg.swa_full,
        embeddings=False,
        no_perf=True,
    )
    if cfg.op_offload is not None:
        set_fields(params, op_offload=cfg.op_offload)
    if callback is not None:
        set_fields(params, cb_eval=callback, cb_eval_user_data=user_data)
    return params


@dataclass(frozen=True)
class ContextSize:
    n_ctx: int
    reason: str
    capped: bool = False  # smaller than the model's training context because of host memory


def kv_bytes_per_token(info: ModelInfo, layers: range, cache_type_k: str, cache_type_v: str) -> int:
    """KV cache bytes one token costs in ``layers`` of the model (sliding-window layers
    charged in full: an upper bound), from the GGUF's per-layer head counts."""
    n = info.block_count
    heads = info.per_layer("attention.head_count") or (1,) * n
    heads_kv = info.per_layer("attention.head_count_kv") or heads
    key_length = info.per_layer("attention.key_length")
    value_length = info.per_layer("attention.value_length")
    total = Fraction(0)
    for il in layers:
        head_dim = info.n_embd // heads[il] if heads[il] else 0
        width_k = heads_kv[il] * (key_length[il] if key_length else head_dim)
        width_v = heads_kv[il] * (value_length[il] if value_length else head_dim)
        total += width_k * CACHE_TYPE_BYTES[cache_type_k] + width_v * CACHE_TYPE_BYTES[cache_type_v]
    return max(1, int(total))


def auto_context_size(n_ctx_train: int, per_token: int, available: int, *, lanes: int = 1) -> ContextSize:
    """The KV cells of a context whose ``lanes`` each hold the model's training context, capped
    so the KV cache takes at most a share of memory (each lane then gets an equal, smaller share).

    ``lanes`` is 1 for a unified pool (every session may use the whole context); separate lanes
    (``kv_unified: false``) each get ``n_ctx / lanes`` cells, so the context is that many times
    the training context.
    """
    want = n_ctx_train if n_ctx_train > 0 else FALLBACK_CTX
    origin = "the model's training context" if n_ctx_train > 0 else "a fallback (the model states no training context)"
    budget = int(available * AUTO_CTX_MEMORY_SHARE)
    fits = budget // per_token // lanes // AUTO_CTX_STEP * AUTO_CTX_STEP  # per lane
    each = "" if lanes == 1 else f" per lane x {lanes} lanes"
    if fits >= want:
        return ContextSize(want * lanes, f"{origin} ({want} tokens){each}")
    if fits < AUTO_CTX_STEP:
        raise ConfigError(
            f"the host has {available >> 20} MiB available; {AUTO_CTX_STEP} tokens of KV cache{each} at "
            f"{per_token} bytes each do not fit in {AUTO_CTX_MEMORY_SHARE:.0%} of it: set ctx_size explicitly"
            + ("" if lanes == 1 else " or lower lane_count")
        )
    return ContextSize(
        fits * lanes,
        f"{origin} is {want} tokens, capped to {fits}{each} so the KV cache ({fits * lanes * per_token >> 20} MiB) "
        f"stays within {AUTO_CTX_MEMORY_SHARE:.0%} of the {available >> 20} MiB available; set ctx_size to choose",
        capped=True,
    )


# -- the unsplit reference -------------------------------------------------------------

_default_params_lock = threading.Lock()


@contextlib.contextmanager
def _model_defaults(context: dict[str, Any] | None = None, **fields: Any) -> Iterator[None]:
    """Make ``llama_model_default_params`` return ``fields`` set (and ``llama_context_default_params``
    ``context`` set), while Llama() builds its params.

    llama_cpp.Llama has no argument for use_extra_bufts, n_seq_max or kv_unified; it starts from the
    library's defaults, so those are what this adjusts (checked afterwards on ``llm.model_params``).
    """
    from llama_cpp import llama_cpp as bindings

    original = bindings.llama_model_default_params
    original_context = bindings.llama_context_default_params

    def patched() -> llama_cpp.llama_model_params:
        return set_fields(original(), **fields)

    def patched_context() -> llama_cpp.llama_context_params:
        return set_fields(original_context(), **(context or {}))

    with _default_params_lock:
        bindings.llama_model_default_params = patched
        bindings.llama_context_default_params = patched_context
        try:
            yield
        finally:
            bindings.llama_model_default_params = original
            bindings.llama_context_default_params = original_context


def reference_policy(repack: bool | None = None) -> dict[str, Any]:
    """The loader fields a stage uses (its defaults, or ``repack`` as given), for an in-process
    unsplit model."""
    return {"use_extra_bufts": StageConfig.__dataclass_fields__["repack"].default if repack is None else repack}


def reference_llama(model_path: str, *, repack: bool | None = None, context: dict[str, Any] | None = None,
                    **kwargs: Any) -> llama_cpp.Llama:
    """``llama_cpp.Llama(model_path, **kwargs)`` loaded the way stages load (repack off unless
    ``repack`` says otherwise: ``True`` is stock llama-cpp-python's loading on a CPU without AMX).

    The equivalence tests and the benchmark compare against this: on an AMX host the stock
    defaults crash (``repack=True`` is refused there as a stage refuses it), and elsewhere they
    would run other kernels than the stages do. Where llama.cpp lacks OpenMP it decodes on a
    thread pool of its own, as stages do (``threadpool``). ``context`` sets
    ``llama_context_params`` fields ``Llama`` has no argument for.
    """
    from llama_cpp import Llama

    policy = reference_policy(repack)
    check_repack(policy["use_extra_bufts"], host_facts.host_info(), who="the reference model")
    with _model_defaults(context, **policy):
        llm = Llama(model_path=str(model_path), **kwargs)
    for name, value in policy.items():
        if getattr(llm.model_params, name) != value:
            raise ConfigError(f"the reference model was loaded with {name}={getattr(llm.model_params, name)!r}")
    for name, value in (context or {}).items():
        if getattr(llm.context_params, name) != value:
            raise ConfigError(f"the reference context was made with {name}={getattr(llm.context_params, name)!r}")
    threadpool.for_llama(llm, os.environ)
    return llm


def reference_llama_like(cfg: StageConfig, model_path: str | None = None, **kwargs: Any) -> llama_cpp.Llama:
    """:func:`reference_llama` on the unsplit model with ``cfg``'s context and ``logits_all=True``:
    the independent reference of an exactness proof.

    Its context is the stage's: ``ctx_size`` cells, ``lane_count`` sequences (``n_seq_max``),
    ``kv_unified``, the batch sizes, threads, attention and cache types. ``Llama.eval`` decodes
    sequence 0 in ``n_batch`` chunks with every row an output; a stage held to it computes every row
    too (``all_rows``), since the rows asked for change the last layer's batch shape. Batches of
    several sequences go through ``llama_cpp.llama_decode`` on ``llm.ctx``.
    """
    if cfg.ctx_size is None:
        raise ConfigError("the reference model needs the stages' ctx_size")
    if cfg.flash_attn_type == "auto":
        raise ConfigError("the reference model cannot load with flash_attn_type=auto (llama_cpp.Llama takes on/off)")
    settings: dict[str, Any] = dict(
        n_ctx=cfg.ctx_size, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, n_threads=cfg.n_threads,
        n_threads_batch=cfg.threads_batch, n_gpu_layers=cfg.n_gpu_layers, flash_attn=cfg.flash_attn_type == "enabled",
        type_k=CACHE_TYPE_IDS[cfg.cache_type_k], type_v=CACHE_TYPE_IDS[cfg.cache_type_v],
        offload_kqv=cfg.kv_offload, swa_full=cfg.swa_full, op_offload=cfg.op_offload,
        logits_all=True, verbose=False,
    )
    settings.update(kwargs)
    return reference_llama(model_path or cfg.model_path, repack=cfg.repack,
                           context={"n_seq_max": cfg.lane_count, "kv_unified": cfg.kv_unified}, **settings)
