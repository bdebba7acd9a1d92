"""A small random-weight vision projector that libmtmd loads beside a text model.

Images at the head need a multimodal projector (an "mmproj" GGUF) that matches the text
model, and no such file ships on PyPI for a model the tests have. This module writes one from
a seed: a llava-style projector (``clip.projector_type = "mlp"``) whose output rows are as
wide as the text model's embeddings, so libmtmd accepts it for that model and encodes an image
into rows the model can read. The weights are random, so what it "sees" means nothing, but
every byte is fixed by the seed and the model, which is what an equivalence proof (split
against unsplit, with an image) needs; an operator can use it to smoke-test a deployment's
image path without a real vision model.

The graph it feeds is llama.cpp's ``clip_graph_llava`` (``tools/mtmd/models/llava.cpp``)::

    conv2d(v.patch_embd) + v.position_embd -> v.pre_ln -> (block_count - 1) ViT blocks
    -> mm.0 (linear) -> GELU -> mm.2 (linear, out = the text model's n_embd)

llava takes the penultimate block's output: the last block is loaded but not run. One image
is ``(image_size / patch_size) ** 2`` rows.

What the pinned libmtmd needs of such a file, each found by a file without it:

- every integer key it reads with ``gguf_get_val_u32`` written as UINT32: an INT32 one fails
  a ``GGML_ASSERT`` and aborts the process;
- ``mm.2.weight``: ``clip_n_mmproj_embd`` reads its width without checking it exists (a
  segfault), as the graph reads ``v.position_embd.weight``;
- ``clip.vision.projection_dim`` equal to the text model's n_embd, and
  ``clip.vision.image_mean``/``image_std``: without them ``mtmd_init_from_file`` returns NULL;
- ``feed_forward_length`` unlike ``embedding_length``: when they are equal clip.cpp's legacy
  heuristic swaps the FFN's up and down weights;
- ``block_count`` of 2 or more, since the last block is skipped.

The text model's width is its ``<arch>.embedding_length``, which is what
``llama_model_n_embd_inp`` gives for a plain decoder (only models that concatenate extra input
features differ, and those are not the ones this projector is for).

``kind="qwen2vl"`` writes Qwen2-VL's projector instead (``clip.projector_type =
"qwen2vl_merger"``, ``PROJECTOR_TYPE_QWEN2VL``), for an M-RoPE text model (``qwen2vl``), beside
which libmtmd lays an image out in two dimensions. Its graph is ``clip_graph_qwen2vl``
(``tools/mtmd/models/qwen2vl.cpp``, see :func:`_merger_tensors`) and it differs from llava's in
what libmtmd does with an image:

- the size is the image's own (dynamic resolution): each side rounded to a multiple of
  ``2 * patch_size``, and an area outside 8 to 4096 rows (or the context's
  ``image_min_tokens``/``image_max_tokens``; a max below the min fails ``mtmd_init_from_file``)
  scaled into it before the sides are rounded, so the count can still land a little outside;
  each 2x2 block of patches becomes one row, so an ``nx`` by ``ny`` grid of rows;
- the rows take ``max(nx, ny)`` positions, not one each: every row of an image starting at
  position ``p`` has the M-RoPE position ``(t, y, x, z) = (p, p + row, p + column, 0)`` and the
  text after it starts at ``p + max(nx, ny)``.

What the pinned libmtmd needs of this type beyond the mlp's list, each found by a file without it:
``v.patch_embd.weight.1`` (the second temporal half of the patch conv) and the attention's q, k
and v biases, which the graph uses unchecked (without any of them building the graph segfaults:
at the first encode, or in ``mtmd_init_from_file`` with warmup on); no ``v.patch_embd.bias``
(the graph's ``GGML_ASSERT`` aborts); ``mm.0.weight`` taking ``4 * width`` inputs (a
``ggml_can_mul_mat`` abort otherwise); ``mm.2.bias``, whose width is the row width libmtmd
checks against the text model's (without it ``mtmd_init_from_file`` returns NULL). No
``v.position_embd.weight``: the tower's positions are a 2-D RoPE.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from skippy_stage.model import gguf_file
from skippy_stage.model.slicing import read_model_info

T = GGUFValueType
F32 = GGMLQuantizationType.F32


@dataclass(frozen=True)
class ProjectorShape:
    """The vision tower's size: small, so a fixture costs a megabyte and an image a few ms."""

    image_size: int = 64  # pixels per side the preprocessor resizes an image to
    patch_size: int = 16
    width: int = 64  # the vision tower's n_embd
    feed_forward: int = 128  # must differ from width (see the module docstring)
    block_count: int = 2  # the last block is not run
    head_count: int = 2
    hidden: int = 128  # mm.0's output, mm.2's input

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.width % self.head_count:
            raise ValueError(f"width {self.width} does not split into {self.head_count} heads")
        if self.feed_forward == self.width:
            raise ValueError("feed_forward equal to width trips clip.cpp's up/down swap heuristic")
        if self.block_count < 2:
            raise ValueError(f"block_count {self.block_count}: llava skips the last block, so at least 2")

    @property
    def n_image_tokens(self) -> int:
        """Rows one image becomes."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class MergerShape:
    """A Qwen2-VL vision tower's size (``clip.projector_type = "qwen2vl_merger"``).

    libmtmd sizes the image itself (see the module docstring): it keeps the aspect ratio and
    rounds each side to a multiple of ``patch_size * 2``; each 2x2 block of patches is one row.
    With a patch of 8 an 80x48 image is 5x3 = 15 rows, 64x64 is 4x4, 200x120 is 13x8."""

    image_size: int = 64  # read by libmtmd but unused for this type (it sizes images itself)
    patch_size: int = 8
    width: int = 64  # the vision tower's n_embd
    feed_forward: int = 128  # must differ from width (see the module docstring)
    block_count: int = 2  # every block is run
    head_count: int = 2
    hidden: int = 256  # mm.0's output, mm.2's input (Qwen2-VL: 4 * width)

    def __post_init__(self) -> None:
        if self.width % self.head_count or (self.width // self.head_count) % 4:
            raise ValueError(f"width {self.width} over {self.head_count} heads: the vision 2-D RoPE wants "
                             "a head size that is a multiple of 4")
        if self.feed_forward == self.width:
            raise ValueError("feed_forward equal to width trips clip.cpp's up/down swap heuristic")
        if self.block_count < 1:
            raise ValueError(f"block_count {self.block_count}: at least 1")


KINDS: dict[str, type[ProjectorShape] | type[MergerShape]] = {"mlp": ProjectorShape, "qwen2vl": MergerShape}


@dataclass(frozen=True)
class WrittenProjector:
    path: Path
    n_bytes: int
    n_image_tokens: int | None  # None: it depends on the image (qwen2vl's dynamic resolution)
    n_embd: int  # width of every row, the text model's n_embd
    seed: int
    kind: str = "mlp"


def write_projector(model: str | os.PathLike[str], out: str | os.PathLike[str], *, seed: int = 0,
                    shape: ProjectorShape | MergerShape | None = None, kind: str = "mlp") -> WrittenProjector:
    """Write a random-weight projector of ``kind`` (``"mlp"`` or ``"qwen2vl"``) for ``model`` to
    ``out``: the same bytes for the same kind, seed, shape and model. ``shape`` defaults to the
    kind's (:class:`ProjectorShape`, :class:`MergerShape`); one of the other kind is a
    ``ValueError``. A model that is missing or not a readable GGUF raises
    :class:`~skippy_stage.errors.ConfigError` (:class:`~skippy_stage.errors.ModelFileError`);
    ``OSError`` if ``out`` cannot be written, leaving no partial file."""
    if kind not in KINDS:
        raise ValueError(f"unknown projector kind {kind!r}: one of {', '.join(KINDS)}")
    shape = shape or KINDS[kind]()
    if not isinstance(shape, KINDS[kind]):
        raise ValueError(f"a {type(shape).__name__} is not the shape of a {kind} projector")
    n_embd = read_model_info(model).n_embd
    n_image_tokens: int | None
    if isinstance(shape, MergerShape):
        metadata, tensors = _merger_metadata(shape, n_embd, seed), list(_merger_tensors(shape, n_embd, seed))
        n_image_tokens = None
    else:
        metadata, tensors = _metadata(shape, n_embd, seed), list(_tensors(shape, n_embd, seed))
        n_image_tokens = shape.n_image_tokens
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    try:
        gguf_file.write_gguf(partial, metadata, tensors)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return WrittenProjector(out, out.stat().st_size, n_image_tokens, n_embd, seed, kind)


def _u32(value: int) -> bytes:
    return gguf_file.pack_value(T.UINT32, value)  # never INT32: libmtmd aborts on it


def _header(what: str, description: str, projector_type: str) -> list[tuple[str, bytes]]:
    """The keys every projector here starts with."""
    return [
        ("general.architecture", gguf_file.pack_value(T.STRING, "clip")),
        ("general.name", gguf_file.pack_value(T.STRING, f"skippy-stage random {what} projector")),
        ("general.description", gguf_file.pack_value(T.STRING, description)),
        ("clip.has_vision_encoder", gguf_file.pack_value(T.BOOL, True)),
        ("clip.has_audio_encoder", gguf_file.pack_value(T.BOOL, False)),
        ("clip.projector_type", gguf_file.pack_value(T.STRING, projector_type)),
    ]


def _tower(shape: ProjectorShape | MergerShape, n_embd: int) -> list[tuple[str, bytes]]:
    """The vision tower's keys, the same for both kinds."""
    floats = gguf_file.pack_value(T.ARRAY, [0.5, 0.5, 0.5], T.FLOAT32)
    return [
        ("clip.vision.image_size", _u32(shape.image_size)),
        ("clip.vision.patch_size", _u32(shape.patch_size)),
        ("clip.vision.embedding_length", _u32(shape.width)),
        ("clip.vision.feed_forward_length", _u32(shape.feed_forward)),
        ("clip.vision.block_count", _u32(shape.block_count)),
        ("clip.vision.projection_dim", _u32(n_embd)),
        ("clip.vision.attention.head_count", _u32(shape.head_count)),
        ("clip.vision.attention.layer_norm_epsilon", gguf_file.pack_value(T.FLOAT32, 1e-6)),
        ("clip.vision.image_mean", floats),
        ("clip.vision.image_std", floats),
    ]


def _metadata(shape: ProjectorShape, n_embd: int, seed: int) -> list[tuple[str, bytes]]:
    return [*_header("mlp", f"random weights, seed {seed}, for {n_embd}-wide text models; a test fixture", "mlp"),
            ("clip.use_gelu", gguf_file.pack_value(T.BOOL, True)), *_tower(shape, n_embd)]


class _Draw:
    """F32 tensors drawn in a fixed order from one generator (numpy's PCG64 gives the same values on
    every machine). Shapes are numpy's, the reverse of ggml's ``ne``."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def tensor(name: str, values: np.ndarray) -> gguf_file.Tensor:
        return gguf_file.tensor_from_array(name, values.astype(np.float32), F32)

    def normal(self, name: str, *dims: int, scale: float | None = None) -> gguf_file.Tensor:
        # 1/sqrt(fan_in) keeps activations near unit size through the layers.
        return self.tensor(name, self.rng.standard_normal(dims) * (scale if scale is not None else dims[-1] ** -0.5))

    def ones(self, name: str, n: int) -> gguf_file.Tensor:
        return self.tensor(name, np.ones(n))

    def zeros(self, name: str, n: int) -> gguf_file.Tensor:
        return self.tensor(name, np.zeros(n))

    def blocks(self, count: int, width: int, ff: int) -> Iterator[gguf_file.Tensor]:
        """ViT blocks as clip.cpp loads them (every bias present: qwen2vl adds q/k/v's unchecked)."""
        for il in range(count):
            p = f"v.blk.{il}"
            for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
                yield self.normal(f"{p}.{name}.weight", width, width)
                yield self.zeros(f"{p}.{name}.bias", width)
            yield self.ones(f"{p}.ln1.weight", width)
            yield self.zeros(f"{p}.ln1.bias", width)
            yield self.ones(f"{p}.ln2.weight", width)
            yield self.zeros(f"{p}.ln2.bias", width)
            yield self.normal(f"{p}.ffn_up.weight", ff, width)
            yield self.zeros(f"{p}.ffn_up.bias", ff)
            yield self.normal(f"{p}.ffn_down.weight", width, ff)
            yield self.zeros(f"{p}.ffn_down.bias", width)


def _tensors(shape: ProjectorShape, n_embd: int, seed: int) -> Iterator[gguf_file.Tensor]:
    """Every tensor of the mlp projector, drawn in a fixed order (``_Draw``)."""
    draw = _Draw(seed)
    width, hidden, patch = shape.width, shape.hidden, shape.patch_size
    yield draw.normal("v.patch_embd.weight", width, 3, patch, patch, scale=(3 * patch * patch) ** -0.5)
    yield draw.zeros("v.patch_embd.bias", width)
    yield draw.normal("v.position_embd.weight", shape.n_image_tokens, width, scale=0.02)
    yield draw.ones("v.pre_ln.weight", width)
    yield draw.zeros("v.pre_ln.bias", width)
    yield from draw.blocks(shape.block_count, width, shape.feed_forward)
    yield draw.normal("mm.0.weight", hidden, width)
    yield draw.zeros("mm.0.bias", hidden)
    yield draw.normal("mm.2.weight", n_embd, hidden)
    yield draw.zeros("mm.2.bias", n_embd)


def _merger_metadata(shape: MergerShape, n_embd: int, seed: int) -> list[tuple[str, bytes]]:
    # No clip.use_gelu/use_silu: the tower's FFN is then GELU-quick, which is Qwen2-VL's.
    return [*_header("qwen2vl", f"random weights, seed {seed}, for {n_embd}-wide M-RoPE text models; a test fixture",
                     "qwen2vl_merger"), *_tower(shape, n_embd)]


def _merger_tensors(shape: MergerShape, n_embd: int, seed: int) -> Iterator[gguf_file.Tensor]:
    """The tensors ``clip_graph_qwen2vl`` (``tools/mtmd/models/qwen2vl.cpp``) reads::

        conv2d(v.patch_embd.weight) + conv2d(v.patch_embd.weight.1)   (the temporal pair, one frame)
        -> blocks (ln1, attn q/k/v/out with 2-D M-RoPE, ln2, ffn up/down) -> v.post_ln
        -> every 2x2 patches concatenated (4 * width) -> mm.0 -> GELU -> mm.2 (out = n_embd)

    No ``v.patch_embd.bias`` and no class embedding: the graph asserts both absent. No position
    embedding: positions are the RoPE's."""
    draw = _Draw(seed)
    width, hidden, patch = shape.width, shape.hidden, shape.patch_size
    # Both temporal halves of Qwen2-VL's 3-D patch conv; a still image goes through both.
    conv_scale = (2 * 3 * patch * patch) ** -0.5
    yield draw.normal("v.patch_embd.weight", width, 3, patch, patch, scale=conv_scale)
    yield draw.normal("v.patch_embd.weight.1", width, 3, patch, patch, scale=conv_scale)
    yield from draw.blocks(shape.block_count, width, shape.feed_forward)
    yield draw.ones("v.post_ln.weight", width)
    yield draw.zeros("v.post_ln.bias", width)
    yield draw.normal("mm.0.weight", hidden, 4 * width)
    yield draw.zeros("mm.0.bias", hidden)
    yield draw.normal("mm.2.weight", n_embd, hidden)
    yield draw.zeros("mm.2.bias", n_embd)
