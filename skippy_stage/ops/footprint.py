"""What one stage of a split costs in bytes, read from the GGUF.

- its layers' tensors ``blk.{i}.*``, read from the GGUF tensor table;
- the non-layer tensors every stage file carries (``token_embd.weight``, which llama.cpp
  insists on even when the stage never embeds, ``output_norm.weight``, ...);
- ``output.*`` only on the final stage (tied-embedding models have none);
- at a ``checkpoint_quantization`` other than ``preserve``, every tensor at the type the whole
  model's quantization gives it (``model.quant_bytes``), except the ``token_embd.weight`` of a
  stage that does not compute with it, which keeps the source's bytes (``unused_embd_bytes``);
- the KV cache of its layers: 2 (K and V) x cells x n_embd_kv x bytes per element of the
  cache type, where n_embd_kv = head_count_kv x head size. Every layer is charged the full
  cache, an upper bound for sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from skippy_stage.config import CACHE_TYPE_BYTES, MAX_LANES
from skippy_stage.errors import PlanError

MIB = 1 << 20


GIB = 1 << 30


def format_bytes(n: float) -> str:
    """GiB with two decimals from 1 GiB up, MiB with one decimal below."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class ModelFootprint:
    """A GGUF's tensor bytes split the way stage files are built, and its KV shape."""

    path: Path
    name: str
    architecture: str
    block_count: int
    layer_weight_bytes: tuple[int, ...]
    shared_bytes: int  # non-layer tensors every stage file carries
    output_bytes: int  # output.* tensors, final stage only
    n_embd_k: tuple[int, ...]  # per layer: head_count_kv x key_length
    n_embd_v: tuple[int, ...]
    quantization: str = "preserve"
    # What a stage that does not compute with token_embd.weight pays beyond shared_bytes: it keeps the
    # source's type there (requantize.uses_token_embd). 0 at preserve.
    unused_embd_bytes: int = 0
    tied_embeddings: bool = False  # no output.weight: the final stage's head is token_embd.weight

    @property
    def tensor_bytes(self) -> int:
        return sum(self.layer_weight_bytes) + self.shared_bytes + self.output_bytes

    def fixed_bytes(self, head: bool, final: bool) -> int:
        """The non-layer tensors a stage file holds: shared ones, and ``output.*`` on the final stage."""
        uses_embd = head or (final and self.tied_embeddings)
        return self.shared_bytes + (self.output_bytes if final else 0) + (0 if uses_embd else self.unused_embd_bytes)


def _per_layer(value: object, block_count: int, key: str, path: Path) -> tuple[int, ...]:
    """A metadata value that may be one number or one number per layer."""
    if isinstance(value, (list, tuple)):
        if len(value) != block_count:
            raise PlanError(f"model file {path}: {key} has {len(value)} entries for {block_count} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * block_count


def read_footprint(model_path: str | Path, quantization: str = "preserve") -> ModelFootprint:
    """Read tensor sizes and the KV shape from a GGUF (refusing unsupported architectures), the
    tensors at ``quantization``'s planned types (a dry run of llama.cpp's quantizer, header only)."""
    return read_footprints(model_path, (quantization,))[0]


def read_footprints(model_path: str | Path, quantizations: tuple[str, ...]) -> list[ModelFootprint]:
    """:func:`read_footprint` at each of ``quantizations``, the GGUF read once."""
    from gguf import GGUFReader

    from skippy_stage.model.quant_bytes import tensor_sizes
    from skippy_stage.model.slicing import check_architecture, layer_index, read_model_info

    info = read_model_info(model_path)  # ConfigError for a missing or non-GGUF file
    check_architecture(info.architecture)
    reader = GGUFReader(info.path, "r")
    arch, n = info.architecture, info.block_count

    def meta(key: str) -> object | None:
        field = reader.get_field(f"{arch}.{key}")
        return None if field is None else field.contents()

    for tensor in reader.tensors:
        index = layer_index(tensor.name)
        if index is not None and not 0 <= index < n:
            raise PlanError(f"model file {info.path}: tensor {tensor.name} is beyond block_count {n}")

    head_count = meta("attention.head_count")
    if head_count is None:
        raise PlanError(f"model file {info.path} lacks {arch}.attention.head_count")
    heads = _per_layer(head_count, n, f"{arch}.attention.head_count", info.path)
    kv_raw = meta("attention.head_count_kv")
    heads_kv = heads if kv_raw is None else _per_layer(kv_raw, n, f"{arch}.attention.head_count_kv", info.path)
    key_length, value_length = meta("attention.key_length"), meta("attention.value_length")
    n_embd_k, n_embd_v = [], []
    for il in range(n):
        head_dim = info.n_embd // heads[il] if heads[il] else 0
        n_embd_k.append(heads_kv[il] * (int(key_length) if key_length is not None else head_dim))
        n_embd_v.append(heads_kv[il] * (int(value_length) if value_length is not None else head_dim))
    footprints = []
    for quantization in quantizations:
        sizes = tensor_sizes(info.path, quantization, reader)
        layers = [0] * n
        shared = output = 0
        for name, size in sizes.bytes.items():
            index = layer_index(name)
            if index is not None:
                layers[index] += size
            elif name.startswith("output."):  # as slicing._is_kept: the head only in the final stage
                output += size
            else:
                shared += size
        footprints.append(ModelFootprint(
            path=info.path,
            name=info.name,
            architecture=arch,
            block_count=n,
            layer_weight_bytes=tuple(layers),
            shared_bytes=shared,
            output_bytes=output,
            n_embd_k=tuple(n_embd_k),
            n_embd_v=tuple(n_embd_v),
            quantization=quantization,
            unused_embd_bytes=sizes.source_bytes.get("token_embd.weight", 0) - sizes.bytes.get("token_embd.weight", 0),
            tied_embeddings="output.weight" not in sizes.bytes,
        ))
    return footprints


def _bytes_for(cells: int, width: int, cache_type: str) -> int:
    per = CACHE_TYPE_BYTES[cache_type]
    return -(-cells * width * per.numerator // per.denominator)  # round up


def kv_bytes_per_layer(
    model: ModelFootprint, ctx_size: int, lanes: int, cache_type_k: str = "f16", cache_type_v: str | None = None
) -> tuple[int, ...]:
    """KV cache bytes of each layer for ``lanes`` sessions of ``ctx_size`` tokens each."""
    cache_type_v = cache_type_k if cache_type_v is None else cache_type_v
    for name, value in (("cache type", cache_type_k), ("cache type", cache_type_v)):
        if value not in CACHE_TYPE_BYTES:
            raise PlanError(f"{name} {value!r} is not one of {', '.join(CACHE_TYPE_BYTES)}")
    _check_kv_settings(ctx_size, lanes)
    cells = ctx_size * lanes
    return tuple(
        _bytes_for(cells, k, cache_type_k) + _bytes_for(cells, v, cache_type_v)
        for k, v in zip(model.n_embd_k, model.n_embd_v)
    )


def _check_kv_settings(ctx_size: int, lanes: int) -> None:
    if not isinstance(ctx_size, int) or ctx_size < 1:
        raise PlanError(f"ctx_size={ctx_size!r} must be a positive number of tokens per lane")
    if not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise PlanError(f"lanes={lanes!r} must be between 1 and {MAX_LANES} (llama.cpp's sequence limit)")
