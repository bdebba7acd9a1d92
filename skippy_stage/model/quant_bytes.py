"""What a stage's weights take at a ``checkpoint_quantization``, before anything is quantized.

The bytes come from the same plan the stage quantizes with (:func:`requantize.whole_model_plan`, a
dry run of llama.cpp's quantizer that reads only the header): each tensor's planned type times its
shape (gguf-py's ``GGML_QUANT_SIZES``: elements / block size x bytes per block). A stage's tensors
are those its stage file carries (``slicing``): its blocks, every non-layer tensor, ``output.*`` on
the final stage only; ``token_embd.weight`` keeps the source's type on a stage that does not compute
with it (:func:`requantize.uses_token_embd`). ``preserve`` is the source's own bytes.

:func:`quantizations` is what this llama.cpp build can produce, for ``info``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp

from skippy_stage.config import CHECKPOINT_QUANTIZATIONS, IMATRIX_QUANTIZATIONS
from skippy_stage.model.requantize import uses_token_embd, whole_model_plan
from skippy_stage.model.slicing import layer_index


def tensor_bytes(shape: tuple[int, ...] | list[int], type_name: str) -> int:
    """Bytes of a tensor of ``shape`` elements stored as ggml type ``type_name`` (``Q8_0``, ``F16``)."""
    block, per_block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name.upper()]]
    return math.prod(int(n) for n in shape) // block * per_block


@dataclass(frozen=True)
class TensorSizes:
    """Every tensor of a whole GGUF: its bytes as the file holds it and at a quantization's planned type."""

    quantization: str
    source_bytes: dict[str, int]
    bytes: dict[str, int]
    types: dict[str, str]  # the planned (or, for preserve, the held) ggml type of each tensor

    source_types: dict[str, str]

    def stage_tensors(self, layer_start: int, layer_end: int, final: bool) -> dict[str, tuple[str, int]]:
        """Each tensor a stage file for ``layer_start:layer_end`` holds (whole-model names) -> its type and
        bytes at this quantization."""
        out = {}
        keeps_source_embd = not uses_token_embd(layer_start == 0, final, self.bytes)
        for name, size in self.bytes.items():
            i = layer_index(name)
            if i is not None and not layer_start <= i < layer_end:
                continue
            if i is None and name.startswith("output.") and not final:
                continue
            if name == "token_embd.weight" and keeps_source_embd:
                out[name] = (self.source_types[name], self.source_bytes[name])
            else:
                out[name] = (self.types[name], size)
        return out

    def stage_bytes(self, layer_start: int, layer_end: int, final: bool) -> int:
        """The bytes of the tensors a stage file for ``layer_start:layer_end`` holds at this quantization."""
        return sum(size for _, size in self.stage_tensors(layer_start, layer_end, final).values())


def tensor_sizes(source: str | os.PathLike[str], quantization: str = "preserve",
                 reader: gguf.GGUFReader | None = None) -> TensorSizes:
    """Each tensor's bytes in ``source`` (a whole GGUF; ``reader`` if it is open already: gguf-py takes
    seconds over a large vocabulary) and at ``quantization``'s planned types."""
    reader = reader if reader is not None else gguf.GGUFReader(Path(source), "r")
    held = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for t in reader.tensors}
    source_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    source_types = {name: held_type for name, (_, held_type) in held.items()}
    if quantization == "preserve":
        return TensorSizes(quantization, source_bytes, dict(source_bytes), source_types, source_types)
    plan = whole_model_plan(source, quantization)
    types = {name: plan.types.get(name, held_type) for name, (_, held_type) in held.items()}
    sizes = {name: tensor_bytes(shape, types[name]) for name, (shape, _) in held.items()}
    return TensorSizes(quantization, source_bytes, sizes, types, source_types)


@dataclass(frozen=True)
class Quantization:
    """A ``checkpoint_quantization`` value this build can produce."""

    name: str
    needs_imatrix: bool

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "needs_imatrix": self.needs_imatrix}


def quantizations() -> list[Quantization]:
    """The ``checkpoint_quantization`` values this llama.cpp build knows (``preserve`` first), each
    with whether it is made only with an importance matrix (``checkpoint_imatrix``)."""
    return [Quantization(name, name in IMATRIX_QUANTIZATIONS) for name in CHECKPOINT_QUANTIZATIONS
            if name == "preserve" or hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")]


__all__ = ["Quantization", "TensorSizes", "quantizations", "tensor_bytes", "tensor_sizes"]
