"""Which file a stage loads, and how many KV cells it gets: decided from the GGUF header and
the config before any weights are loaded (``skippy-stage check`` asks the same questions)."""

from __future__ import annotations

from pathlib import Path

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import host, loader, package_stage, requantize
from skippy_stage.model.slicing import (
    ModelInfo,
    check_architecture,
    overrides_for,
    read_model_info,
    slice_metadata,
    stage_file,
)


def check_against_model(cfg: StageConfig) -> ModelInfo:
    """What the GGUF decides about the config, from its header alone (no weights loaded).

    With ``package_ref`` the header is the package's metadata part, fetched with the manifest and
    checked against it (``package_stage.plan``); the layer range is then checked as for a GGUF."""
    if cfg.package_ref is not None:
        info = package_stage.check(cfg)
        return _check_range_against(cfg, info)
    if cfg.load_mode == "artifact-slice":
        path = Path(cfg.model_path)
        meta = slice_metadata(path) if path.is_file() else None
        if meta is None:
            raise ConfigError(f"stage {cfg.stage_id}: model_path={cfg.model_path!r} is not a skippy stage file")
        want = {"layer_start": cfg.layer_start, "layer_end": cfg.layer_end, "final": cfg.include_output}
        got = {k: meta[k] for k in want}
        if got != want:
            raise ConfigError(f"stage {cfg.stage_id}: stage file {path} holds {got}, config needs {want}")
        info = read_model_info(path)
        check_architecture(info.architecture)
        return info
    try:
        info = read_model_info(cfg.model_path)
    except ConfigError as exc:
        raise ConfigError(f"stage {cfg.stage_id}: model_path={cfg.model_path!r}: {exc}") from None
    return _check_range_against(cfg, info)


def _check_range_against(cfg: StageConfig, info: ModelInfo) -> ModelInfo:
    """The layer range against the whole model's header: inside it, sliceable there, final exactly
    when it ends at the last layer."""
    check_architecture(info.architecture)
    cfg.check_block_count(info.block_count)
    if not (cfg.layer_start == 0 and cfg.layer_end == info.block_count):
        try:
            overrides_for(info, cfg.layer_start, cfg.layer_end, bool(cfg.include_output))
        except ConfigError as exc:
            raise ConfigError(f"stage {cfg.stage_id}: {exc}") from None
    if cfg.include_output is False and cfg.layer_end == info.block_count:
        raise ConfigError(
            f"stage {cfg.stage_id}: layer_end={cfg.layer_end} is the model's last layer, "
            f"so the stage is final and must have no downstream"
        )
    if cfg.include_output and cfg.layer_end != info.block_count:
        raise ConfigError(
            f"stage {cfg.stage_id}: no downstream is configured, but layer_end={cfg.layer_end} "
            f"stops before the model's last layer {info.block_count}"
        )
    return info


def resolve_context_size(cfg: StageConfig, info: ModelInfo, layers: range) -> loader.ContextSize:
    """The KV cells this stage's context gets: ctx_size, or sized from the model and host.

    ``info`` describes the file being loaded and ``layers`` this stage's blocks in it.
    """
    if cfg.ctx_size is not None:
        return loader.ContextSize(cfg.ctx_size, f"ctx_size={cfg.ctx_size} in the config")
    per_token = loader.kv_bytes_per_token(info, layers, cfg.cache_type_k, cfg.cache_type_v)
    n_ctx_train = int(info.metadata.get(f"{info.architecture}.context_length") or 0)
    try:
        return loader.auto_context_size(n_ctx_train, per_token, host.memory_available(),
                                        lanes=1 if cfg.kv_unified else cfg.lane_count)
    except ConfigError as exc:
        raise ConfigError(f"stage {cfg.stage_id}: ctx_size unset: {exc}") from None


def resolve_stage_file(cfg: StageConfig, progress: bool | None = None) -> tuple[Path, bool, float]:
    """The file to load (a stage file given as is, the slice of the model, or the stage file assembled
    from a package's parts; built or reused from the cache), whether it was built now, and how long
    that took."""
    check_against_model(cfg)
    if cfg.package_ref is not None:
        made = package_stage.stage_file(cfg, progress)
        return made.path, made.built, made.seconds
    if cfg.load_mode == "artifact-slice":
        return Path(cfg.model_path), False, 0.0
    made = stage_file(cfg.model_path, cfg.layer_start, cfg.layer_end, final=cfg.include_output,
                      cache_dir=cfg.cache_dir, progress=progress)
    if cfg.checkpoint_quantization != "preserve":
        # The slice, quantized with the whole model's per-tensor types (cached beside it).
        quantized = requantize.requantized_stage_file(cfg, Path(cfg.model_path), made.path)
        return quantized.path, made.built or quantized.built, made.seconds + quantized.seconds
    return made.path, made.built, made.seconds
