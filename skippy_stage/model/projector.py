"""The head's multimodal projector: images in a prompt become embedding rows for stage 0.

libmtmd (llama.cpp's multimodal library, shipped with llama-cpp-python) does what
llama-cpp-python's ``MTMDChatHandler`` does in one process: it splits a prompt at its media
markers, tokenizes the text between them and encodes each image into rows as wide as the
text model's embeddings. The head feeds those rows to its own layers as embedding rows, where
the prompt's token embeddings would be, and the hidden states go down the chain like any
prompt's: the stages below never see an image.

libmtmd trusts its files: a projector with an integer key of the wrong GGUF type aborts the
process, one without ``mm.2.weight`` or ``v.position_embd.weight`` segfaults. So a projector
is read with gguf-py first and refused, naming the key, before libmtmd opens it; and only
projector types proven split-against-unsplit are accepted (``PROVEN_TYPES``): each type brings
its own graph, positions and attention mask, and one not proven here is refused by name.

Two kinds of images are taken: one row per position (llava's ``mlp``: a fixed count of rows), and
Qwen2-VL's (``qwen2vl_merger``: as many rows as the image's size gives, on a 2-D grid that takes
fewer positions than rows, M-RoPE). The second kind's spans carry their grid, which travels with
the image's entries so every stage places the rows (``mrope``).
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog
from gguf import GGUFReader, GGUFValueType
from llama_cpp import _logger as llama_logger

from skippy_stage.errors import ConfigError, InvalidFieldError
from skippy_stage.model.mrope import MAX_GRID_ROWS

log = structlog.get_logger("skippy_stage.projector")

# Projector types whose images a split reproduces bit for bit (tests/head/test_images.py, test_images_mrope.py):
# llava's (one row per position) and Qwen2-VL's (a grid of rows on M-RoPE positions).
PROVEN_TYPES = ("mlp", "qwen2vl_merger")
# Of those, the ones whose images take M-RoPE positions (``mrope``).
MROPE_TYPES = ("qwen2vl_merger",)
# Kin of Qwen2-VL refused, and why.
_UNPROVEN = {
    "qwen2.5vl_merger": "its tower's window attention is not proven here (its rows' positions would be Qwen2-VL's)",
    "qwen3vl_merger": "its image rows carry deepstack features that the text model adds at later layers, which "
                      "a head's hidden states do not pass down the chain",
}
# What libmtmd reads with gguf_get_val_u32 for these types (a key of another type aborts).
_U32_KEYS = ("clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
             "clip.vision.feed_forward_length", "clip.vision.block_count", "clip.vision.projection_dim",
             "clip.vision.attention.head_count")
# Tensors libmtmd dereferences without looking (missing: a segfault), per type; per ViT block too.
_REQUIRED_TENSORS = {
    "mlp": ("v.patch_embd.weight", "v.position_embd.weight", "mm.0.weight", "mm.2.weight"),
    "qwen2vl_merger": ("v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight", "mm.2.weight"),
}
_REQUIRED_BLOCK_TENSORS = {
    "mlp": (),
    "qwen2vl_merger": ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
                       "attn_v.bias", "attn_out.weight", "ffn_up.weight", "ffn_down.weight"),
}
# Tensors a type's graph asserts absent (present: an abort).
_FORBIDDEN_TENSORS = {"mlp": (), "qwen2vl_merger": ("v.patch_embd.bias", "v.class_embd")}
# An encoded image larger than this is refused before it is decoded (a decompression bomb
# is caught by the pixel bound below, which the header gives before any pixel is decoded).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 8192 * 8192
# libmtmd's smallest Qwen2-VL image, in rows.
_MIN_GRID_ROWS = 8


@dataclass(frozen=True)
class MediaSpan:
    """One image's rows in a prompt: at positions ``start .. start + len(rows)``.

    ``key`` stands for the image in the head's own bookkeeping (the prompt's token list holds
    ``key[i]`` at position ``start + i``): negative, so never a token id, and a function of the
    image's bytes, so a resident prefix that holds this image matches only a prompt with the same
    image at the same place."""

    start: int
    rows: np.ndarray  # float32, (n, n_embd)
    digest: str  # sha256 of the image's bytes
    key: tuple[int, ...]
    encode_s: float = 0.0  # what encoding it took (libmtmd's tower and projection)
    # An M-RoPE image's grid of rows (width, height), raster order; None where rows are positions.
    grid: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + int(self.rows.shape[0])


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt with its images encoded: ``tokens`` holds each image's ``key`` values at its
    positions; the stages are sent ``placeholder`` there (``wire_tokens``)."""

    tokens: list[int]
    media: tuple[MediaSpan, ...]


# What the OpenAI API puts where a message has an image part (libmtmd's default marker); a head whose
# ``media_marker`` is another replaces it with its own.
MEDIA_PART = "<__media__>"
# What the stages below are sent at an image's positions: llama-cpp-python's multimodal path
# leaves its input_ids there as they were, which on a fresh model is 0.
PLACEHOLDER_TOKEN = 0


def media_keys(digest: str, n: int) -> tuple[int, ...]:
    """``n`` negative integers from an image digest, one per row (distinct rows, distinct keys)."""
    base = int(digest[:15], 16)  # 60 bits
    return tuple(-1 - ((base + i) % (1 << 62)) for i in range(n))


def check_projector_file(path: str | Path, n_embd: int) -> str:
    """Read ``path`` with gguf-py and refuse what libmtmd would crash on or this head has not
    proven, naming the key or tensor; returns the projector type."""
    where = f"projector_path={path}"
    try:
        reader = GGUFReader(str(path))
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, ValueError, IndexError) as exc:
        raise ConfigError(f"{where} is not a readable GGUF file: {exc}") from None
    fields = reader.fields

    def value(key: str) -> object:
        field = fields.get(key)
        if field is None:
            return None
        return field.contents()

    if value("general.architecture") != "clip":
        raise ConfigError(f"{where}: general.architecture={value('general.architecture')!r}, not 'clip': this is not "
                          f"a multimodal projector (an mmproj GGUF)")
    if value("clip.has_vision_encoder") is not True:
        raise ConfigError(f"{where}: clip.has_vision_encoder is not true: the head takes images only")
    kind = value("clip.projector_type")
    if kind in _UNPROVEN:
        raise ConfigError(f"{where}: clip.projector_type={kind!r} is not taken: {_UNPROVEN[kind]}; accepted: "
                          f"{', '.join(PROVEN_TYPES)}")
    if kind not in PROVEN_TYPES:
        raise ConfigError(f"{where}: clip.projector_type={kind!r} is not proven on a split head (accepted: "
                          f"{', '.join(PROVEN_TYPES)}); its image rows could differ from the unsplit model's")
    for key in _U32_KEYS:
        field = fields.get(key)
        if field is None:
            raise ConfigError(f"{where}: {key} is missing")
        if field.types != [GGUFValueType.UINT32]:
            got = "/".join(t.name for t in field.types)
            raise ConfigError(f"{where}: {key} is {got}, libmtmd reads it as UINT32 (it would abort the process)")
    for key in ("clip.vision.image_mean", "clip.vision.image_std"):
        got = value(key)
        if not isinstance(got, list) or len(got) < 3:
            raise ConfigError(f"{where}: {key} must be an array of 3 floats")
    names = {t.name: t for t in reader.tensors}
    blocks = int(value("clip.vision.block_count"))
    for name in (*_REQUIRED_TENSORS[kind],
                 *(f"v.blk.{i}.{t}" for i in range(blocks) for t in _REQUIRED_BLOCK_TENSORS[kind])):
        if name not in names:
            raise ConfigError(f"{where}: tensor {name} is missing (libmtmd would crash reading it)")
    for name in _FORBIDDEN_TENSORS[kind]:
        if name in names:
            raise ConfigError(f"{where}: tensor {name} is present, which libmtmd's {kind} graph asserts absent (it "
                              f"would abort the process)")
    if kind == "mlp" and blocks < 2:
        raise ConfigError(f"{where}: clip.vision.block_count must be at least 2 for an mlp projector "
                          f"(llava skips the last block)")
    if kind == "qwen2vl_merger":
        width = int(value("clip.vision.embedding_length"))
        merged = int(names["mm.0.weight"].shape[0]) if len(names["mm.0.weight"].shape) else 0
        if merged != 4 * width:
            raise ConfigError(f"{where}: tensor mm.0.weight takes rows {merged} wide, not 4 x "
                              f"clip.vision.embedding_length={width} (2x2 patches merged); libmtmd would abort")
    out_width = int(names["mm.2.weight"].shape[-1]) if len(names["mm.2.weight"].shape) else 0
    dim = int(value("clip.vision.projection_dim"))
    if n_embd not in (dim, out_width):
        raise ConfigError(f"{where}: its rows are {out_width} wide (clip.vision.projection_dim={dim}), the text "
                          f"model's embeddings n_embd={n_embd}: a projector for another model")
    return str(kind)


class Projector:
    """libmtmd loaded beside the head's model; ``prompt`` encodes a prompt's images.

    One encode at a time (a libmtmd context is not thread-safe); the lock is never held across
    anything but libmtmd calls."""

    def __init__(self, path: str | Path, model: llama_cpp.llama_model_p, *, n_embd: int, n_threads: int,
                 flash_attn: bool, marker: str | None, min_tokens: int | None, max_tokens: int | None,
                 stage_id: str) -> None:
        import llama_cpp.mtmd_cpp as mtmd  # a second shared library: loaded only where a projector is

        self._mtmd = mtmd
        # libmtmd logs every chunk to stderr by default; llama-cpp-python's handler keeps errors only.
        mtmd.mtmd_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))
        self.kind = check_projector_file(path, n_embd)
        self.n_embd = n_embd
        self.marker = marker or mtmd.mtmd_default_marker().decode()
        self.log = log.bind(stage_id=stage_id)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.warmup = False
        params.n_threads = n_threads
        # As llama-cpp-python's MTMDChatHandler sets it: the same tower as the one-process reference.
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._marker_bytes = self.marker.encode()
        params.media_marker = self._marker_bytes
        params.image_min_tokens = -1 if min_tokens is None else min_tokens
        params.image_max_tokens = -1 if max_tokens is None else max_tokens
        # Qwen2-VL's images: as many rows as the image's size (within the budget) on a grid of M-RoPE positions.
        self.mrope = self.kind in MROPE_TYPES
        if self.mrope and max_tokens is not None and max_tokens < _MIN_GRID_ROWS:
            raise ConfigError(f"image_max_tokens={max_tokens}: a {self.kind} projector makes an image at least "
                              f"{_MIN_GRID_ROWS} rows")
        for name, value in (("image_min_tokens", min_tokens), ("image_max_tokens", max_tokens)):
            if self.mrope and value is not None and value > MAX_GRID_ROWS:
                raise ConfigError(f"{name}={value}: an image's grid on the wire holds at most {MAX_GRID_ROWS} rows")
        self._ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not self._ctx:
            raise ConfigError(f"projector_path={path}: libmtmd could not load it beside this model")
        self._lock = threading.Lock()
        # Rows every image becomes (``mlp``), from a probe; 0 where the image's size decides (``mrope``).
        self.tokens_per_image = 0
        try:
            if not mtmd.mtmd_support_vision(self._ctx):
                raise ConfigError(f"projector_path={path} has no vision encoder")
            if bool(mtmd.mtmd_decode_use_mrope(self._ctx)) != self.mrope:
                raise ConfigError(f"projector_path={path}: a {self.kind} projector is for a text model "
                                  f"{'with' if self.mrope else 'without'} M-RoPE positions; this model's are "
                                  f"{'plain' if self.mrope else 'M-RoPE'}")
            probe = self._probe()
            if not self.mrope:
                self.tokens_per_image = probe
            if not self.mrope and ((min_tokens is not None and probe < min_tokens) or
                                   (max_tokens is not None and probe > max_tokens)):
                raise ConfigError(f"image_min_tokens={min_tokens}, image_max_tokens={max_tokens}: this {self.kind} "
                                  f"projector makes every image {probe} rows whatever its size")
        except BaseException:
            self.close()
            raise

    def _probe(self) -> int:
        """Rows a small blank image becomes (every image's, for a fixed-size projector): its encode proves
        the projector runs beside this model."""
        encoded = self.prompt(self.marker, [_blank_ppm(8, 8)])
        return int(encoded.media[0].rows.shape[0])

    def prompt(self, text: str, images: list[bytes], *, add_special: bool = True,
               max_positions: int | None = None) -> MediaPrompt:
        """``text`` with one marker per image, tokenized and the images encoded. Refuses (naming
        ``media[i]``) an image that does not decode, a count of markers unlike the images', and (before
        encoding any) more images than ``max_positions`` hold."""
        mtmd = self._mtmd
        markers = text.count(self.marker)
        if markers != len(images):  # before any image is decoded
            raise InvalidFieldError("media", f"the prompt has {markers} media markers ({self.marker!r}) for "
                                             f"{len(images)} images: one marker per image")
        if max_positions is not None and self.tokens_per_image and \
                len(images) * self.tokens_per_image >= max_positions:
            raise InvalidFieldError("media", f"{len(images)} images take {len(images) * self.tokens_per_image} "
                                             f"positions ({self.tokens_per_image} each); a session holds at most "
                                             f"{max_positions}")
        bitmaps = []
        try:
            with self._lock:
                for i, data in enumerate(images):
                    check_image(data, f"media[{i}]")
                    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
                    if not bitmap:
                        raise InvalidFieldError(f"media[{i}]", f"media[{i}] ({len(data)} bytes) is not an image "
                                                               f"this head decodes (PNG, JPEG, BMP, GIF, PPM)")
                    bitmaps.append(bitmap)
                    mtmd.mtmd_bitmap_set_id(bitmap, hashlib.sha256(data).hexdigest().encode())
                return self._tokenize(text, bitmaps, add_special, max_positions)
        finally:
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _tokenize(self, text: str, bitmaps: list, add_special: bool, max_positions: int | None) -> MediaPrompt:
        mtmd = self._mtmd
        markers = len(bitmaps)
        data = text.encode("utf-8")
        given = mtmd.mtmd_input_text()
        given.text, given.text_len, given.add_special, given.parse_special = data, len(data), add_special, True
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(given), array, len(bitmaps))
            if rc != 0:
                raise InvalidFieldError("media", f"libmtmd could not split the prompt at its {markers} media "
                                                 f"markers for {len(bitmaps)} images (code {rc})")
            parts = [mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks))]
            rows_in = [self._rows_of(chunk) for chunk in parts]
            if max_positions is not None and sum(rows_in) >= max_positions:  # before any image is encoded
                raise InvalidFieldError("media", f"the prompt and its {markers} images take {sum(rows_in)} "
                                                 f"positions; a session holds at most {max_positions}")
            tokens: list[int] = []
            media: list[MediaSpan] = []
            for chunk, n_rows in zip(parts, rows_in):
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    tokens.extend(ptr[j] for j in range(n.value))
                    continue
                grid = self._grid(chunk, n_rows)
                started = time.perf_counter()
                if mtmd.mtmd_encode_chunk(self._ctx, chunk) != 0:
                    raise InvalidFieldError(f"media[{len(media)}]", f"media[{len(media)}] could not be encoded")
                encode_s = time.perf_counter() - started
                out = mtmd.mtmd_get_output_embd(self._ctx)
                rows = np.ctypeslib.as_array(out, shape=(n_rows * self.n_embd,)).copy().reshape(n_rows, self.n_embd)
                if not np.isfinite(rows).all():
                    raise InvalidFieldError(f"media[{len(media)}]", f"media[{len(media)}] encodes to non-finite values")
                digest = (mtmd.mtmd_input_chunk_get_id(chunk) or b"").decode()
                span = MediaSpan(len(tokens), rows, digest, media_keys(digest, n_rows), encode_s, grid)
                media.append(span)
                tokens.extend(span.key)
            return MediaPrompt(tokens, tuple(media))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)

    def _rows_of(self, chunk: object) -> int:
        """The rows (positions in the head's bookkeeping) a chunk takes; refuses audio."""
        mtmd = self._mtmd
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind not in (mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE):
            raise InvalidFieldError("media", "only images are taken (no audio)")
        return int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))

    def _grid(self, chunk: object, n_rows: int) -> tuple[int, int] | None:
        """An M-RoPE image's grid (width, height), None for one whose rows are its positions; refuses (as a
        projector this head does not carry) what neither is."""
        mtmd = self._mtmd
        n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
        if mtmd.mtmd_decode_use_non_causal(self._ctx, chunk):
            raise ConfigError(f"this {self.kind} projector's images take non-causal attention, which the stages "
                              f"below the head do not carry")
        if not self.mrope:
            if n_pos != n_rows:
                raise ConfigError(f"this {self.kind} projector's images take {n_pos} positions for {n_rows} rows")
            return None
        image = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
        nx, ny = int(mtmd.mtmd_image_tokens_get_nx(image)), int(mtmd.mtmd_image_tokens_get_ny(image))
        if nx * ny != n_rows or n_pos != max(nx, ny):
            raise ConfigError(f"this {self.kind} projector's image is {nx}x{ny} on {n_pos} positions for {n_rows} "
                              f"rows, not a grid of max(width, height) positions")
        return nx, ny

    def close(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._mtmd.mtmd_free(ctx)


def _blank_ppm(width: int, height: int) -> bytes:
    return b"P6 %d %d 255\n" % (width, height) + bytes(3 * width * height)


def image_size(data: bytes) -> tuple[int, int] | None:
    """An encoded image's width and height from its header (PNG, JPEG, GIF, BMP, PPM), before
    any pixel is decoded; None where the header does not say."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    if data[:2] == b"BM" and len(data) >= 26:
        return abs(int.from_bytes(data[18:22], "little", signed=True)), abs(int.from_bytes(data[22:26], "little",
                                                                                          signed=True))
    if data[:2] in (b"P6", b"P5", b"P3", b"P2"):
        parts = data[2:64].split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return int(parts[0]), int(parts[1])
        return None
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                i += 2
                continue
            length = int.from_bytes(data[i + 2 : i + 4], "big")
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
            i += 2 + length
    return None


def check_image(data: bytes, where: str) -> None:
    """Refuse, naming ``where``, an image too large to decode safely or in no format we read."""
    if not data:
        raise InvalidFieldError(where, f"{where} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidFieldError(where, f"{where} has {len(data)} bytes; at most {MAX_IMAGE_BYTES}")
    size = image_size(data)
    if size is None:
        raise InvalidFieldError(where, f"{where} ({len(data)} bytes) is not an image this head decodes "
                                       f"(PNG, JPEG, BMP, GIF, PPM)")
    width, height = size
    if width <= 0 or height <= 0 or width * height > MAX_IMAGE_PIXELS:
        raise InvalidFieldError(where, f"{where} is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels")
