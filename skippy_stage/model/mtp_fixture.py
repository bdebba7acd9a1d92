"""Random-weight models with native multi-token-prediction (MTP) layers.

No model with MTP ("next-n") layers ships on PyPI: the ones that have them (DeepSeek-V3,
GLM-4.5, Qwen3.5/3.6, MiMo) are gigabytes. The pinned llama.cpp drafts with such layers
through a second context of type ``LLAMA_CONTEXT_TYPE_MTP``, and the final stage of a
pipeline will do the same, so the tests need a model llama.cpp loads with MTP layers. This
module turns an architecture fixture of :mod:`skippy_stage.model.synthetic` into one:
``with_nextn(spec, k)`` appends ``k`` next-n blocks, and ``synthetic.write_model`` writes it
from a seed in a fraction of a second (16-18 MB for qwen35 and deepseek2, 2-3 MB of it
the next-n block).

What the pinned llama.cpp needs of such a file (``llama-model.cpp``, ``models/qwen35.cpp``,
``models/deepseek2.cpp``):

- ``<arch>.nextn_predict_layers = k`` and ``<arch>.block_count`` counting trunk + k: the
  trunk is ``n_layer() = block_count - k``, the next-n blocks are the last ``k``;
- every per-layer array (length ``block_count``) one entry longer per block, with
  ``attention.recurrent_layers`` 0 for the new ones (a next-n block is full attention, and
  qwen35's loader reads the array over all blocks);
- each next-n block a full decoder block of the trunk's attention kind (for qwen35 the shapes
  of a full-attention block, for deepseek2 an MLA block with the MoE FFN) plus
  ``blk.i.nextn.eh_proj`` (``[2 * n_embd -> n_embd]``), ``blk.i.nextn.enorm`` and
  ``blk.i.nextn.hnorm``; ``nextn.embed_tokens``, ``nextn.shared_head_head`` and
  ``nextn.shared_head_norm`` are optional (the graph falls back to ``token_embd``,
  ``output`` and ``output_norm``) and left out;
- the qwen35 and deepseek2 MTP graphs take exactly one next-n block (``GGML_ASSERT
  n_layer_nextn == 1``): ``k > 1`` loads but aborts the process when the MTP context builds
  its graph, so :func:`with_nextn` refuses it for those.

The weights are random, so the draft head agrees with the trunk about as often as chance
does: enough to prove that speculative verification is exact, nothing about speed.
"""

from __future__ import annotations

import re
from dataclasses import replace

from skippy_stage.model.synthetic import ModelSpec, TensorSpec

# Architectures whose pinned MTP graph (``graph_mtp``) runs from these fixtures, with the
# number of next-n blocks that graph accepts.
MTP_ARCHITECTURES = {"qwen35": 1, "deepseek2": 1}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Quantization scales the architecture fixtures carry for every block. In a next-n block the
# loader skips them with the rest when load_mtp is false, but they are not counted as skipped:
# the load fails with "done_getting_tensors: wrong number of tensors".
_NOT_COPIED = (".scale", ".input_scale")


def with_nextn(spec: ModelSpec, k: int = 1) -> ModelSpec:
    """``spec`` with ``k`` next-n (MTP) blocks appended after its trunk.

    Raises:
        ValueError: the architecture has no MTP graph in the pinned llama.cpp that these
            fixtures are known to run, ``k`` is more than that graph takes, or ``spec``
            already has next-n blocks.
    """
    arch = spec.architecture
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(f"{spec.stem}: no MTP fixture for architecture {arch!r} "
                         f"(known: {', '.join(sorted(MTP_ARCHITECTURES))})")
    if not 1 <= k <= MTP_ARCHITECTURES[arch]:
        raise ValueError(f"{spec.stem}: the pinned {arch} MTP graph takes 1..{MTP_ARCHITECTURES[arch]} "
                         f"next-n blocks, not {k}")
    meta = {key: value for key, _, _, value in spec.metadata}
    if int(meta.get(f"{arch}.nextn_predict_layers", 0)):
        raise ValueError(f"{spec.stem}: already has next-n layers")
    n_trunk = spec.block_count
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if not isinstance(recurrent, tuple):  # a scalar 0 in fixtures without recurrent layers
        recurrent = None
    # The block whose shapes the next-n blocks take: the last full-attention one.
    source = max(i for i in range(n_trunk) if recurrent is None or not recurrent[i])

    metadata = []
    for key, vtype, sub, value in spec.metadata:
        if key == f"{arch}.block_count":
            value = n_trunk + k
        elif key == f"{arch}.nextn_predict_layers":
            value = k
        elif vtype == "ARRAY" and len(value) == n_trunk:
            extra = 0 if key == f"{arch}.attention.recurrent_layers" else value[source]
            value = tuple(value) + (extra,) * k
        metadata.append((key, vtype, sub, value))
    if f"{arch}.nextn_predict_layers" not in meta:
        metadata.append((f"{arch}.nextn_predict_layers", "UINT32", None, k))

    n_embd = int(meta[f"{arch}.embedding_length"])
    source_tensors = [(m.group(2), t) for t in spec.tensors
                      if (m := _BLOCK.match(t.name)) and int(m.group(1)) == source and not m.group(2).endswith(_NOT_COPIED)]
    tensors = list(spec.tensors)
    for i in range(n_trunk, n_trunk + k):
        tensors += [TensorSpec(f"blk.{i}.{suffix}", t.shape, t.type) for suffix, t in source_tensors]
        tensors += [
            TensorSpec(f"blk.{i}.nextn.eh_proj.weight", (n_embd, 2 * n_embd), "F32"),
            TensorSpec(f"blk.{i}.nextn.enorm.weight", (n_embd,), "F32"),
            TensorSpec(f"blk.{i}.nextn.hnorm.weight", (n_embd,), "F32"),
        ]
    return replace(spec, stem=f"{spec.stem}-mtp{k}", metadata=tuple(metadata), tensors=tuple(tensors))
