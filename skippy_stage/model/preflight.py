"""``skippy-stage check`` and ``skippy-stage info``: what a stage would do here, without serving.

``check`` runs every check ``serve`` makes before it loads weights (the config itself, its
exposure and credential files, the GGUF's header against the layer range, the loader policy
against this host) and prints the effective config with every default filled in, the context
size included, and what the stage's weights and KV cache will take: its weights at the effective
``checkpoint_quantization`` (the bytes from the dry-run plan of llama.cpp's quantizer when it
requantizes, ``quant_bytes``; the source's own otherwise). ``info`` prints what a bug report needs:
versions, llama.cpp's view of the CPU, devices, the loader policy that applies on this host and the
quantization types this build can produce.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from skippy_stage.config import StageConfig, load_config
from skippy_stage.errors import ConfigError
from skippy_stage.model import host as host_facts
from skippy_stage.model import loader
from skippy_stage.model.capture import native_library_path
from skippy_stage.security import Credentials, check_exposure

# CPU flags worth a line in a bug report: they decide which kernels llama.cpp runs.
NOTABLE_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                 "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "sve", "neon", "asimd")


def effective_config(path: str | Path) -> tuple[StageConfig, str]:
    """The config at ``path`` with ctx_size resolved, and why it has that size.

    Raises ConfigError / UnsupportedModelError naming the field and value, as ``serve`` would.
    """
    from skippy_stage.model.stage_file import check_against_model, resolve_context_size

    cfg = load_config(path)
    check_exposure(cfg)  # protected mode: reachable with neither token nor TLS
    Credentials.from_config(cfg)  # the token and TLS files are there, readable and not empty
    info = check_against_model(cfg)
    loader.model_params(cfg)  # the host policy: repack on AMX, selected_device
    if cfg.projector_path is not None:  # what libmtmd would crash on, or this head has not proven
        from skippy_stage.model.projector import check_projector_file

        try:
            check_projector_file(cfg.projector_path, info.n_embd)
        except ConfigError as exc:
            raise ConfigError(f"stage {cfg.stage_id}: {exc}") from None
    sliced = cfg.load_mode == "artifact-slice" and cfg.package_ref is None  # info is the stage file's own
    layers = range(info.block_count) if sliced else range(cfg.layer_start, cfg.layer_end)
    size = resolve_context_size(cfg, info, layers)
    return cfg.replace(ctx_size=size.n_ctx), size.reason


@dataclass(frozen=True)
class StageMemory:
    """What a stage will hold: its weights at its effective quantization, and its KV cache."""

    quantization: str  # checkpoint_quantization: preserve, or the type asked
    types: dict[str, int]  # ggml type -> how many of the stage's tensors have it
    weight_bytes: int
    source_weight_bytes: int  # the same tensors as the source GGUF holds them
    kv_bytes: int
    available_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        mib = 1 << 20
        held = ", ".join(f"{t} x{n}" for t, n in sorted(self.types.items(), key=lambda kv: -kv[1]))
        what = "the GGUF's own types" if self.quantization == "preserve" else "requantized at start"
        line = (f"quantization {self.quantization} ({what}: {held}); weights {self.weight_bytes} bytes "
                f"({self.weight_bytes / mib:.1f} MiB")
        if self.quantization != "preserve":
            line += f"; {self.source_weight_bytes / mib:.1f} MiB as the GGUF holds them"
        return (line + f"), KV cache {self.kv_bytes / mib:.1f} MiB: {self.total_bytes / mib:.1f} MiB "
                f"of {self.available_bytes / mib:.0f} MiB available")


def stage_memory(cfg: StageConfig) -> StageMemory | None:
    """The memory ``cfg`` (with ctx_size resolved) will take, or None for a stage loaded from a layer
    package (its parts are not here to read)."""
    import gguf

    from skippy_stage.model.quant_bytes import tensor_sizes
    from skippy_stage.model.slicing import read_model_info

    if cfg.package_ref is not None:
        return None
    info = read_model_info(cfg.model_path)
    reader = gguf.GGUFReader(info.path, "r")  # once: gguf-py takes seconds over a large vocabulary
    sliced = cfg.load_mode == "artifact-slice"  # the file is the stage file itself, served as is
    start, end = (0, info.block_count) if sliced else (cfg.layer_start, cfg.layer_end)
    final = True if sliced else bool(cfg.include_output)
    tensors = tensor_sizes(info.path, cfg.checkpoint_quantization, reader).stage_tensors(start, end, final)
    source = tensor_sizes(info.path, "preserve", reader).stage_tensors(start, end, final)
    per_token = loader.kv_bytes_per_token(info, range(start, end), cfg.cache_type_k, cfg.cache_type_v)
    return StageMemory(
        quantization=cfg.checkpoint_quantization,
        types=dict(Counter(t for t, _ in tensors.values())),
        weight_bytes=sum(b for _, b in tensors.values()),
        source_weight_bytes=sum(b for _, b in source.values()),
        kv_bytes=per_token * int(cfg.ctx_size or 0),
        available_bytes=host_facts.memory_available(),
    )


def loader_policy(info: host_facts.HostInfo) -> dict[str, Any]:
    defaults = StageConfig.__dataclass_fields__
    return {
        "repack": {
            "default": defaults["repack"].default,
            "true_allowed": not info.amx,
            "why": (f"refused: this CPU has AMX_INT8 and the AMX repack crashes ({host_facts.AMX_REPACK_CRASH})"
                    if info.amx else "allowed (no AMX on this host); off unless set"),
        },
        "mmap": "unset: llama.cpp maps the file where every device supports it (LLAMA_LOAD_MODE_AUTO)",
        "supports_mmap": bool(llama_cpp.llama_supports_mmap()),
        "supports_mlock": bool(llama_cpp.llama_supports_mlock()),
        "supports_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "flash_attn_type": f"{defaults['flash_attn_type'].default} (as llama-cpp-python's Llama(), for exact equivalence)",
        "kv_unified": defaults["kv_unified"].default,
        "ctx_size": "unset: the model's training context for each lane (for the one pool with kv_unified), capped to "
                    f"{loader.AUTO_CTX_MEMORY_SHARE:.0%} of available memory for the KV cache",
    }


def info_report() -> dict[str, Any]:
    info = host_facts.host_info()
    report = info.to_dict()
    report["cpu_flags"] = [f for f in NOTABLE_FLAGS if f in info.cpu_flags]
    report["loader_policy"] = loader_policy(info)
    library = native_library_path()
    from skippy_stage.model.quant_bytes import quantizations
    from skippy_stage.model.slicing import accepted_architectures

    report["architectures"] = sorted(accepted_architectures())
    report["quantizations"] = [q.to_dict() for q in quantizations()]
    report["hidden_state_capture"] = (f"native ({library.name})" if library is not None
                                      else "python: the compiled capture is missing (reinstall with a C compiler)")
    return report


def format_info(report: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"skippy-stage      {report['skippy_stage_version']}",
        f"llama-cpp-python  {report['llama_cpp_python_version']}",
        f"ggml libraries    {', '.join(report['ggml_libraries'])}",
        f"CPU               {report['cpu_model']}",
        f"CPU flags         {' '.join(report['cpu_flags']) or '(none of note)'}",
        f"llama.cpp system  {report['system_info']}",
        f"AMX_INT8          {'yes (its repacked kernels are not used: repack stays off)' if report['amx'] else 'no'}",
        f"capture           {report['hidden_state_capture']}",
        f"architectures     {len(report['architectures'])} proven split == unsplit: {', '.join(report['architectures'])}",
        f"quantizations     {', '.join(q['name'] + ('*' if q['needs_imatrix'] else '') for q in report['quantizations'])}"
        " (* only with checkpoint_imatrix)",
        f"memory            {report['memory_available'] // mib} MiB available of {report['memory_total'] // mib} MiB",
        "devices",
    ]
    for d in report["devices"]:
        lines.append(f"  {d['name']:<10} {d['type']:<6} {d['description']} ({d['memory_free'] // mib} MiB free)")
    lines.append("loader policy")
    for key, value in report["loader_policy"].items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        lines.append(f"  {key:<20} {value}")
    return "\n".join(lines)
