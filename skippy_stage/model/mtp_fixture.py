"""Random-weight models with native multi-token-prediction (MTP) layers.

No model with MTP ("next-n") layers ships on PyPI: the ones that have them (DeepSeek-V3/V3.2,
GLM-4.5, Qwen3.5/3.6, MiMo-V2 and others) are gigabytes. The pinned llama.cpp drafts with such
layers through a second context of type ``LLAMA_CONTEXT_TYPE_MTP``, and the final stage of a
pipeline will do the same, so the tests need a model llama.cpp loads with MTP layers. This
module turns an architecture fixture of :mod:`skippy_stage.model.synthetic` into one:
``with_nextn(spec, k)`` appends ``k`` next-n blocks, and ``synthetic.write_model`` writes it
from a seed in a fraction of a second (16-36 MB; deepseek32's is 130 MB, most of it the DSA
indexer every block of its fixture carries, and takes about two seconds).

What the pinned llama.cpp needs of such a file (``llama-model.cpp`` and each architecture's
``load_arch_tensors`` and ``graph_mtp`` in ``models/<arch>.cpp``):

- ``<arch>.nextn_predict_layers = k`` and ``<arch>.block_count`` counting trunk + k: the
  trunk is ``n_layer() = block_count - k``, the next-n blocks are the last ``k``;
- every per-layer array (length ``block_count``) one entry longer per block, the entry of the
  trunk block the next-n block copies (``attention.recurrent_layers`` 0: qwen35's loader reads
  the array over all blocks; ``attention.sliding_window_pattern`` the next-n block's kind);
- each next-n block a decoder block of the kind its ``graph_mtp`` builds (:data:`NEXTN_BLOCKS`),
  plus ``blk.i.nextn.eh_proj`` (``[2 * n_embd -> n_embd]``), ``blk.i.nextn.enorm`` and
  ``blk.i.nextn.hnorm``; ``nextn.embed_tokens``, ``nextn.shared_head_head`` and
  ``nextn.shared_head_norm`` are optional (the graphs fall back to ``token_embd``, ``output``
  and ``output_norm``) and left out. Per architecture:

  - qwen35: a full-attention block (the shapes of the trunk's attention blocks);
  - deepseek2, deepseek32: an MLA block with the MoE FFN (``GGML_ASSERT(layer.ffn_gate_inp)``);
    deepseek32's loader wants the DSA indexer tensors in it too, though its MTP graph runs
    dense MLA over a plain KV cache of the next-n block alone;
  - hy_v3: a trunk block (q/k norms, the MoE FFN);
  - cohere2moe: a *full-attention* block with the MoE FFN (``load_block_mtp``: "looks like a
    full-attention Cohere2 MoE decoder block"), its ``sliding_window_pattern`` entry 0;
  - mimo2: a *sliding-window* block (the converter, ``conversion/mimo.py``, extends the
    pattern with 1 for every MTP block) with one fused ``attn_qkv`` weight
    (``GGML_ASSERT(layer.wqkv)``, no bias) and the dense FFN (``GGML_ASSERT(layer.ffn_gate &&
    ...)``), no router;
- the MTP graphs of qwen35, deepseek2, deepseek32 and cohere2moe take exactly one next-n block
  (``GGML_ASSERT n_layer_nextn == 1``): ``k > 1`` loads but aborts the process when the MTP
  context builds its graph. hy_v3 and mimo2 pick a block by ``nextn_layer_offset`` instead, but
  the stage drafts with one block (``mtp.SUPPORTED_NEXTN``), so :func:`with_nextn` takes
  ``k = 1`` for all of them.

The weights are random, so the draft head agrees with the trunk about as often as chance
does: enough to prove that speculative verification is exact, nothing about speed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from skippy_stage.model.synthetic import ModelSpec, TensorSpec


@dataclass(frozen=True)
class NextnBlock:
    """What one architecture's pinned MTP graph takes as a next-n block, beyond a copy of a trunk block."""

    max_blocks: int = 1  # next-n blocks its MTP graph runs (``GGML_ASSERT n_layer_nextn == 1`` where it says)
    swa: bool = False  # a sliding-window block: copied from one, its ``sliding_window_pattern`` entry set
    fused_qkv: bool = False  # one ``attn_qkv`` weight in place of ``attn_q`` / ``attn_k`` / ``attn_v`` and biases
    dense_ffn: bool = False  # the dense ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` only: no router, no experts


# Architectures whose pinned MTP graph (``graph_mtp``) runs from these fixtures.
NEXTN_BLOCKS: dict[str, NextnBlock] = {
    "qwen35": NextnBlock(),
    "deepseek2": NextnBlock(),
    "deepseek32": NextnBlock(),
    "hy_v3": NextnBlock(),
    "cohere2moe": NextnBlock(),
    "mimo2": NextnBlock(swa=True, fused_qkv=True, dense_ffn=True),
}
# The number of next-n blocks each of those graphs accepts.
MTP_ARCHITECTURES = {arch: block.max_blocks for arch, block in NEXTN_BLOCKS.items()}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Quantization scales the architecture fixtures carry for every block. In a next-n block the
# loader skips them with the rest when load_mtp is false, but they are not counted as skipped:
# the load fails with "done_getting_tensors: wrong number of tensors".
_NOT_COPIED = (".scale", ".input_scale")
_QKV = ("attn_q", "attn_k", "attn_v")
_EXPERTS = ("ffn_gate_inp.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.", "ffn_gate_up_exps.", "exp_probs_b.",
            "ffn_gate_shexp.", "ffn_up_shexp.", "ffn_down_shexp.")


def with_nextn(spec: ModelSpec, k: int = 1) -> ModelSpec:
    """``spec`` with ``k`` next-n (MTP) blocks appended after its trunk.

    Raises:
        ValueError: the architecture has no MTP graph in the pinned llama.cpp that these
            fixtures are known to run, ``k`` is more than that graph takes, or ``spec``
            already has next-n blocks.
    """
    arch = spec.architecture
    if arch not in NEXTN_BLOCKS:
        raise ValueError(f"{spec.stem}: no MTP fixture for architecture {arch!r} "
                         f"(known: {', '.join(sorted(NEXTN_BLOCKS))})")
    kind = NEXTN_BLOCKS[arch]
    if not 1 <= k <= kind.max_blocks:
        raise ValueError(f"{spec.stem}: the pinned {arch} MTP graph takes 1..{kind.max_blocks} next-n blocks, not {k}")
    meta = {key: value for key, _, _, value in spec.metadata}
    if int(meta.get(f"{arch}.nextn_predict_layers", 0)):
        raise ValueError(f"{spec.stem}: already has next-n layers")
    n_trunk = spec.block_count
    source = _source_block(spec, meta, kind)

    metadata = []
    for key, vtype, sub, value in spec.metadata:
        if key == f"{arch}.block_count":
            value = n_trunk + k
        elif key == f"{arch}.nextn_predict_layers":
            value = k
        elif vtype == "ARRAY" and len(value) == n_trunk:
            # The source block is of the next-n block's kind: its entry (not recurrent, sliding
            # window or not) is the next-n block's.
            value = tuple(value) + (value[source],) * k
        metadata.append((key, vtype, sub, value))
    if f"{arch}.nextn_predict_layers" not in meta:
        metadata.append((f"{arch}.nextn_predict_layers", "UINT32", None, k))

    n_embd = int(meta[f"{arch}.embedding_length"])
    block = _block_tensors(spec, source, kind)
    tensors = list(spec.tensors)
    for i in range(n_trunk, n_trunk + k):
        tensors += [TensorSpec(f"blk.{i}.{suffix}", shape, dtype) for suffix, shape, dtype in block]
        tensors += [
            TensorSpec(f"blk.{i}.nextn.eh_proj.weight", (n_embd, 2 * n_embd), "F32"),
            TensorSpec(f"blk.{i}.nextn.enorm.weight", (n_embd,), "F32"),
            TensorSpec(f"blk.{i}.nextn.hnorm.weight", (n_embd,), "F32"),
        ]
    return replace(spec, stem=f"{spec.stem}-mtp{k}", metadata=tuple(metadata), tensors=tuple(tensors))


def _source_block(spec: ModelSpec, meta: dict[str, object], kind: NextnBlock) -> int:
    """The last trunk block whose shapes the next-n blocks take: attention (not recurrent), of the
    next-n block's window kind, with the feed-forward the MTP graph runs."""
    arch = spec.architecture
    names = {t.name for t in spec.tensors}

    def per_layer(key: str) -> tuple | None:
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, tuple) else None  # a scalar 0 in fixtures without the pattern

    recurrent = per_layer("attention.recurrent_layers")
    swa = per_layer("attention.sliding_window_pattern")
    ffn = "ffn_gate.weight" if kind.dense_ffn else "ffn_gate_inp.weight"
    candidates = [i for i in range(spec.block_count)
                  if (recurrent is None or not recurrent[i])
                  and (swa is None or bool(swa[i]) == kind.swa)
                  and (f"blk.{i}.{ffn}" in names or not any(n.endswith(ffn) for n in names))]
    if not candidates:
        raise ValueError(f"{spec.stem}: no trunk block of the kind an {arch} next-n block is")
    return candidates[-1]


def _block_tensors(spec: ModelSpec, source: int, kind: NextnBlock) -> list[tuple[str, tuple[int, ...], str]]:
    """The source block's tensors as ``(suffix, shape, type)``, reshaped into the next-n block's kind."""
    out = []
    qkv: dict[str, tuple[int, ...]] = {}
    for t in spec.tensors:
        m = _BLOCK.match(t.name)
        if not m or int(m.group(1)) != source or m.group(2).endswith(_NOT_COPIED):
            continue
        suffix = m.group(2)
        if kind.fused_qkv and suffix.split(".")[0] in _QKV:
            if suffix.endswith(".weight"):
                qkv[suffix.split(".")[0]] = t.shape
            continue  # biases: the fused MTP attention adds none
        if kind.dense_ffn and suffix.startswith(_EXPERTS):
            continue
        out.append((suffix, t.shape, t.type))
    if kind.fused_qkv:
        shapes = [qkv[name] for name in _QKV]  # numpy order: [out, n_embd]
        out.append(("attn_qkv.weight", (sum(s[0] for s in shapes), shapes[0][1]), "F32"))
    return out
