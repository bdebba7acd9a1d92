"""What llama.cpp derives from the absolute layer index, and how a slice keeps it.

A stage file renumbers its blocks from 0 and says ``block_count = layer_end - layer_start``.
Per-layer metadata arrays slice with it; but llama.cpp also derives per-layer behaviour
from the layer index or the block count through scalars and built-in defaults, and a
slice that copied those scalars would be a different model. Everything here was read from
the pinned llama.cpp source (``src/models/*.cpp``, ``llama-model.cpp``) and is proven or
disproven by ``skippy-stage verify`` on the architecture fixtures:

* **rewritten** — a scalar that counts layers from the start (``leading_dense_block_count``),
  or from the end (``nextn_predict_layers``, the multi-token-prediction blocks);
* **made explicit** — a pattern llama.cpp computes from ``il`` (sliding-window layers,
  recurrent layers of hybrids) is written as the per-layer bool array llama.cpp reads first;
* **neutralised** — an input scale applied to hidden states as well as token embeddings
  (``embedding_scale``) is 1.0 on stages that do not start at layer 0; a default computed
  from the block count (minicpm's ``residual_scale``) is written with the original's value;
* **constrained** — a period with no key (llama4's every-4th-layer no-RoPE) allows only
  boundaries on multiples of it;
* **refused** — what no metadata can express (the attention scale of Gemma-3 27B keyed on
  ``block_count == 62``, a residual stream that is not one ``n_embd`` row per token, graphs
  that abort on hidden-state input), with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from skippy_stage.errors import ConfigError, UnsupportedModelError


@dataclass(frozen=True)
class SwaRule:
    """llama.cpp's ``load_swa_pattern(ml, period, dense_first)`` for an architecture: the pattern
    it derives from the *renumbered* index unless the slice states the original one per layer."""

    period: int
    dense_first: bool = False
    # llama.cpp turns sliding windows on without the ``sliding_window`` key (gemma2: 4096).
    always_on: bool = False
    # A stage of sliding-window layers alone crashes llama.cpp (dots3note: its indexer sits on
    # the full-attention layers, and a stage without one divides by zero).
    needs_full: bool = False

    def layers(self, n: int, period: int | None = None, trunk: int | None = None) -> list[bool]:
        """Per layer, sliding-window or not, as ``set_swa_pattern`` computes it (MTP layers past
        ``trunk`` never are)."""
        p = self.period if period is None else period
        trunk = n if trunk is None else trunk
        if self.dense_first:
            return [il < trunk and (p == 0 or il % p != 0) for il in range(n)]
        return [il < trunk and (p == 0 or il % p < p - 1) for il in range(n)]


@dataclass(frozen=True)
class ArchRule:
    """Everything slicing must know about one architecture beyond its per-layer arrays."""

    swa: SwaRule | None = None
    # ``full_attention_interval`` default when the file has no ``attention.recurrent_layers``.
    recurrent_interval: int | None = None
    # A hard-coded period of the layer index with no key: boundaries must be multiples.
    boundary_period: int = 1
    # A scalar key whose value is such a period (e.g. ``interleave_moe_layer_step``).
    boundary_period_key: str | None = None
    # Applied to the stage's input whether tokens or hidden states: 1.0 after stage 0.
    input_scale_key: str | None = None
    # Defaults llama.cpp computes from the (trunk) block count: written with the original's value.
    pinned: dict[str, Callable[[int], float]] = field(default_factory=dict)
    # The graph loads ``output.weight`` even where it stops before it: keep it in every slice.
    needs_output: bool = False
    # A stage may not hold exactly this many layers (smallthinker applies RoPE to every layer when
    # its no-RoPE step equals the block count).
    forbidden_stage_layers: int | None = None
    # Block counts at which llama.cpp picks a different graph, and why a slice cannot keep it.
    refused_block_counts: dict[int, str] = field(default_factory=dict)
    # From this block count on, llama.cpp builds a different graph (command-r: q/k norms).
    refused_from_block_count: tuple[int, str] | None = None


_OUTPUT_REQUIRED = (
    "apertus arwkv7 baichuan bailingmoe bailingmoe2 codeshell dbrx dots1 exaone-moe gptneox internlm2 jais "
    "kimi-linear llada-moe maple mellum mimo2 minimax-m2 minimax-m3 muse-glimmer nemotron olmo2 olmoe gpt-oss "
    "orion phi2 phimoe plamo plm qwen qwen2moe rwkv6 rwkv6qwen2 rwkv7 stablelm step35 xverse"
).split()

_RULES: dict[str, ArchRule] = {
    "gemma2": ArchRule(swa=SwaRule(2, always_on=True), refused_block_counts={
        46: "Gemma-2 27B: llama.cpp picks its attention scale from block_count == 46, which a slice cannot keep"}),
    "gemma3": ArchRule(swa=SwaRule(6), refused_block_counts={
        62: "Gemma-3 27B: llama.cpp picks its attention scale from block_count == 62, which a slice cannot keep"}),
    "gemma-embedding": ArchRule(swa=SwaRule(6)),
    # These read only an explicit per-layer array (no default period); it slices, but a stage of
    # full-attention layers alone must still be refused.
    **{a: ArchRule(swa=SwaRule(0)) for a in ("maple", "mimo2", "step35", "spark2_5")},
    "dots3note": ArchRule(swa=SwaRule(0, needs_full=True)),
    "llama4": ArchRule(swa=SwaRule(4), boundary_period=4, boundary_period_key="interleave_moe_layer_step"),
    "plamo3": ArchRule(swa=SwaRule(8)),
    "cohere2": ArchRule(swa=SwaRule(4)),
    "cohere2moe": ArchRule(swa=SwaRule(4, dense_first=True)),
    "olmo2": ArchRule(swa=SwaRule(4)),
    "muse-glimmer": ArchRule(swa=SwaRule(4)),
    "exaone4": ArchRule(swa=SwaRule(4), refused_block_counts={
        64: "EXAONE-4 32B: llama.cpp turns sliding-window attention on only when block_count == 64"}),
    "exaone-moe": ArchRule(swa=SwaRule(4)),
    "afmoe": ArchRule(swa=SwaRule(4), boundary_period=4),
    "laguna": ArchRule(swa=SwaRule(4, dense_first=True)),
    "smallthinker": ArchRule(swa=SwaRule(4, dense_first=True), boundary_period=4, forbidden_stage_layers=4),
    "smollm3": ArchRule(boundary_period=4),
    "gpt-oss": ArchRule(swa=SwaRule(2)),
    "mellum": ArchRule(swa=SwaRule(4)),
    "modern-bert": ArchRule(swa=SwaRule(3, dense_first=True)),
    "qwen3next": ArchRule(recurrent_interval=4),
    "qwen35": ArchRule(recurrent_interval=4),
    "qwen35moe": ArchRule(recurrent_interval=4),
    "ernie4_5-moe": ArchRule(boundary_period_key="interleave_moe_layer_step"),
    "granite": ArchRule(input_scale_key="embedding_scale"),
    "granitemoe": ArchRule(input_scale_key="embedding_scale"),
    "granitehybrid": ArchRule(input_scale_key="embedding_scale"),
    "granite_swa": ArchRule(swa=SwaRule(0), input_scale_key="embedding_scale"),
    "grok": ArchRule(input_scale_key="embedding_scale"),
    "minicpm": ArchRule(input_scale_key="embedding_scale", pinned={"residual_scale": lambda n: 1.4 / math.sqrt(n)}),
    "command-r": ArchRule(refused_from_block_count=(
        64, "Command-R+: llama.cpp loads q/k norms only when block_count >= 64, which a slice cannot keep")),
}

# What no metadata can carry across a stage boundary on stock llama.cpp.
STRUCTURAL_REFUSALS: dict[str, str] = {
    "baichuan": "llama.cpp applies RoPE only when block_count == 32 and ALiBi only when it is 40; a slice has neither",
    "minicpm3": "its residual scale is 1.4/sqrt(block_count), computed in the graph with no key to keep it",
    "minimax-01": "its linear-attention slope depends on il / (block_count - 1), computed in the graph",
    "rwkv6": "every rescale_every_n_layers-th absolute layer halves the state; the graph also normalises its input",
    "rwkv7": "each layer mixes in the value of the graph's first layer (v_first): cross-layer state no stage boundary carries",
    "arwkv7": "each layer mixes in the value of the graph's first layer (v_first): cross-layer state no stage boundary carries",
    "talkie": "every layer re-adds the model's input embedding: the later stages do not have it",
    "kimi-k3": "its attention-residual bank mixes earlier layers' inputs: cross-layer state no stage boundary carries",
    "glm-dsa": "its shared-indexer layers reuse the previous layer's top-k: cross-layer state no stage boundary carries",
    "glm5-next": "hyper-connections: the residual stream is several n_embd streams, not the l_out rows a stage hands on",
    "hy_v4": "hyper-connections: the residual stream is several n_embd streams, not the l_out rows a stage hands on",
    "qwen4exp": "hyper-connections: the residual stream is several n_embd streams, not the l_out rows a stage hands on",
    "deepseek4": "hyper-connections: the residual stream is several n_embd streams, not the l_out rows a stage hands on",
    "gemma3n": "its altup residual is 3-D, KV is shared from layer 20 and per-layer inputs come from token ids",
    "gemma4": "per-layer embeddings come from token ids and the shared-KV start counts from the model's end",
    "glm4": "llama.cpp's graph aborts (GGML_ABORT) on hidden-state input unless M-RoPE is used",
    "glm4moe": "llama.cpp's graph aborts (GGML_ABORT) on hidden-state input unless M-RoPE is used",
    "graniteswitch": "llama.cpp's graph asserts token input (GGML_ASSERT ubatch.token)",
    "cogvlm": "the graph picks the vision-expert weights whenever the input is not token ids",
    **{a: "a non-causal diffusion model with no KV memory: a session cannot carry its context from step to step"
       for a in ("dream", "llada", "llada-moe", "rnd1")},
    "hrm_text": "its layer stacks are looped (the same blocks run several times per token)",
    "nanbeige": "its physical layers are looped several times per token",
    "t5": "encoder-decoder: the relative-position bias of block 0 serves every layer",
    "t5encoder": "encoder-decoder: the relative-position bias of block 0 serves every layer",
    "eagle3": "a draft model whose layers point at absolute layers of its target",
    "dflash": "a draft model whose layers point at absolute layers of its target",
    "gemma4-assistant": "a draft model that shares its target's KV cache",
    **{a: "its graph has no l_out node to hand on: llama.cpp cannot stop it at a stage boundary"
       for a in ("bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "eurobert", "neo-bert",
                 "modern-bert", "plamo2", "wavtokenizer-dec")},
}


# Hybrids whose recurrent layers are the ones with no KV heads (``head_count_kv[il] == 0``).
_RECURRENT_BY_HEAD_KV = frozenset(("jamba", "lfm2", "lfm2moe", "granitehybrid", "nemotron_h", "nemotron_h_moe",
                                   "plamo2", "kimi-linear", "bailingmoe3", "kimi-k3"))


# Input transforms llama.cpp applies to hidden states as well as token embeddings (not guarded by
# ``ubatch.token``): a later stage applies them again. No key turns them off, so a split of these
# differs from the unsplit model; their proofs fail, and this says why.
UNGUARDED_INPUT: dict[str, str] = {
    **{a: "llama.cpp scales every stage's input by sqrt(n_embd), hidden states included" for a in ("gemma", "gemma2", "afmoe")},
    "minicpm3": "llama.cpp scales every stage's input by 12, hidden states included",
    **{a: "llama.cpp adds the learned position embeddings to every stage's input, hidden states included"
       for a in ("gpt2", "starcoder", "mpt")},
    **{a: "llama.cpp normalises every stage's input (LayerNorm), hidden states included" for a in ("bloom",)},
    **{a: "llama.cpp normalises every stage's input (RMSNorm), hidden states included" for a in ("muse-glimmer",)},
}


def rule_for(arch: str) -> ArchRule:
    """The architecture's rule (the empty rule: nothing index-dependent found in its source)."""
    rule = _RULES.get(arch, ArchRule())
    if arch in _OUTPUT_REQUIRED and not rule.needs_output:
        rule = dataclasses.replace(rule, needs_output=True)
    return rule


def refuse_structurally(arch: str) -> None:
    """Raise UnsupportedModelError, with the reason, for an architecture no slice can run."""
    reason = STRUCTURAL_REFUSALS.get(arch)
    if reason is not None:
        raise UnsupportedModelError(f"architecture {arch!r} is refused: {reason}")


def _scalar(kv: dict[str, object], key: str) -> int | None:
    value = kv.get(key)
    return None if value is None or isinstance(value, tuple) else int(value)  # type: ignore[arg-type]


def slice_overrides(kv: dict[str, object], arch: str, start: int, end: int, final: bool) -> dict[str, tuple[str, Any]]:
    """Metadata the slice ``[start, end)`` must write instead of the source's, keyed by GGUF key,
    as ``(type, value)`` with type one of ``uint32``, ``float32``, ``bools``; or a refusal.

    ``kv`` is the source's header (``slicing.read_model_info(...).metadata``).
    """
    refuse_structurally(arch)
    rule = rule_for(arch)
    n = int(kv[f"{arch}.block_count"])  # type: ignore[arg-type]
    where = f"layers {start}:{end} of this {arch} model"
    if n in rule.refused_block_counts:
        raise UnsupportedModelError(f"architecture {arch!r} with {n} blocks is refused: {rule.refused_block_counts[n]}")
    if rule.refused_from_block_count is not None and n >= rule.refused_from_block_count[0]:
        raise UnsupportedModelError(f"architecture {arch!r} with {n} blocks is refused: {rule.refused_from_block_count[1]}")
    out: dict[str, tuple[str, Any]] = {}

    period = rule.boundary_period
    if rule.boundary_period_key is not None:
        step = _scalar(kv, f"{arch}.{rule.boundary_period_key}")
        if step:
            period = math.lcm(period, step)
    if period > 1:
        for b in (start, end):
            if b % period and b != n:
                raise ConfigError(f"{where}: a boundary at layer {b} is not a multiple of {period}, and llama.cpp "
                                  f"derives which layers skip RoPE or use experts from the layer index modulo {period}")

    if rule.forbidden_stage_layers == end - start:
        raise ConfigError(f"{where}: a stage of exactly {end - start} layers turns RoPE on in every layer "
                          f"(llama.cpp's no-RoPE step then equals the block count)")

    nextn = _scalar(kv, f"{arch}.nextn_predict_layers") or 0
    if nextn:
        trunk = n - nextn
        if end <= trunk:
            out[f"{arch}.nextn_predict_layers"] = ("uint32", 0)
        elif not (final and start < trunk):
            raise ConfigError(f"{where}: the last {nextn} blocks are multi-token-prediction blocks; they must all be "
                              f"in the final stage, with at least one trunk layer (start below {trunk})")

    heads = kv.get(f"{arch}.attention.head_count")
    if isinstance(heads, tuple) and heads[start] == 0 and any(heads[start:end]):
        # llama.cpp sizes every head from the slice's first layer (n_embd / head_count[0], and reads
        # key_length only when that count is not 0): a first layer without heads breaks the rest.
        raise ConfigError(f"{where}: layer {start} has no attention heads, and llama.cpp sizes the stage's "
                          f"attention heads from its first layer: start the stage on a layer with heads")
    if isinstance(heads, tuple) and heads[start] != heads[0] and heads[0]:
        # llama.cpp sizes a head from n_embd / head_count[0] unless key_length says: keep the original's.
        n_embd = int(kv[f"{arch}.embedding_length"])  # type: ignore[arg-type]
        for key in ("key_length", "value_length"):
            if f"{arch}.attention.{key}" not in kv:
                out[f"{arch}.attention.{key}"] = ("uint32", n_embd // int(heads[0]))

    dense = _scalar(kv, f"{arch}.leading_dense_block_count")
    if dense is not None:
        out[f"{arch}.leading_dense_block_count"] = ("uint32", max(0, dense - start))

    if rule.swa is not None and (rule.swa.always_on or _has_swa(kv, arch)):
        pattern = _swa_pattern(kv, arch, rule.swa, n, n - nextn)
        mine = pattern[start:end]
        if not any(mine):
            raise ConfigError(f"{where} are all full-attention layers; llama.cpp aborts on a sliding-window model "
                              f"with no sliding-window layer (GGML_ASSERT is_swa_any): move a boundary")
        if rule.swa.needs_full and all(mine):
            raise ConfigError(f"{where} are all sliding-window layers; llama.cpp stops with a floating-point "
                              f"error (SIGFPE) on a {arch} stage without a full-attention layer: move a boundary")
        out[f"{arch}.attention.sliding_window_pattern"] = ("bools", mine)

    kinds = _layer_kinds(kv, arch, rule, n, nextn)
    if kinds is not None:
        mine = set(kinds[start:end])
        for kind in ("attention", "recurrent"):
            if kind not in mine:
                raise ConfigError(f"{where} hold no {kind} layer; llama.cpp aborts on a hybrid model's stage whose "
                                  f"{'KV' if kind == 'attention' else 'recurrent'} cache is empty "
                                  f"(GGML_ASSERT buffer): every stage needs both kinds")
    if rule.recurrent_interval is not None:
        key = f"{arch}.attention.recurrent_layers"
        out[key] = ("bools", [k == "recurrent" for k in _recurrent_by_interval(kv, arch, rule, n, nextn)[start:end]])

    if start > 0 and _scalar(kv, f"{arch}.n_deepstack_layers"):
        # Deepstack layers add vision features to the first layers' input (zeros for text) and widen
        # the input rows llama.cpp expects; a later stage takes plain hidden states.
        out[f"{arch}.n_deepstack_layers"] = ("uint32", 0)
    if rule.input_scale_key is not None and start > 0:
        out[f"{arch}.{rule.input_scale_key}"] = ("float32", 1.0)
    for key, default in rule.pinned.items():
        full = f"{arch}.{key}"
        if full not in kv:
            out[full] = ("float32", default(n - nextn))
    return out


def _recurrent_by_interval(kv: dict[str, object], arch: str, rule: ArchRule, n: int, nextn: int) -> list[str]:
    value = kv.get(f"{arch}.attention.recurrent_layers")
    if value is not None and not isinstance(value, tuple):
        value = (bool(value),) * n  # get_key_or_arr: a scalar stands for every layer
    if not isinstance(value, tuple):
        interval = _scalar(kv, f"{arch}.full_attention_interval") or rule.recurrent_interval or 1
        value = tuple(i < n - nextn and (i + 1) % interval != 0 for i in range(n))
    return ["recurrent" if v else "attention" for v in value]


def _layer_kinds(kv: dict[str, object], arch: str, rule: ArchRule, n: int, nextn: int) -> list[str] | None:
    """Per layer ``attention``, ``recurrent`` or ``other``, for a hybrid model that has both; else None."""
    if rule.recurrent_interval is not None:
        kinds = _recurrent_by_interval(kv, arch, rule, n, nextn)
    elif arch in _RECURRENT_BY_HEAD_KV:
        heads = kv.get(f"{arch}.attention.head_count_kv")
        if not isinstance(heads, tuple):
            return None
        # nemotron_h: a layer with neither KV heads nor a feed-forward is the recurrent one
        ff = kv.get(f"{arch}.feed_forward_length") if arch.startswith("nemotron_h") else None
        ff = ff if isinstance(ff, tuple) else (0,) * n
        kinds = ["attention" if h else ("recurrent" if not f else "other") for h, f in zip(heads, ff)]
    else:
        return None
    kinds = kinds[: n - nextn]
    return kinds if {"attention", "recurrent"} <= set(kinds) else None


def check_split(kv: dict[str, object], arch: str, ranges: list[tuple[int, int]]) -> None:
    """Refuse a split any of whose ranges cannot be sliced (ConfigError / UnsupportedModelError): the
    fixture script and tests ask before llama.cpp sees a split it could abort on."""
    n = int(kv[f"{arch}.block_count"])  # type: ignore[arg-type]
    for start, end in ranges:
        if not (start == 0 and end == n):
            slice_overrides(kv, arch, start, end, end == n)


def _has_swa(kv: dict[str, object], arch: str) -> bool:
    """Whether the file turns sliding-window attention on (a window of some layer > 0)."""
    window = kv.get(f"{arch}.attention.sliding_window")
    if isinstance(window, tuple):
        return any(int(w) > 0 for w in window)
    return window is not None and int(window) > 0  # type: ignore[arg-type]


def _swa_pattern(kv: dict[str, object], arch: str, swa: SwaRule, n: int, trunk: int) -> list[bool]:
    value = kv.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(value, tuple):
        return [bool(v) for v in value]
    return swa.layers(n, None if value is None else int(value), trunk)  # type: ignore[arg-type]
