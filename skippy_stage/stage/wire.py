"""Activation-frame wire codecs: how hidden-state rows become payload bytes and back.

Hidden states travel between stages as one ``bytes`` payload next to a small descriptor,
never as ``repeated float`` protobuf fields: a packed float field costs a per-element
encode/decode loop in Python, while a bytes field is a single copy in and
``np.frombuffer`` out. The rows are token-major (row ``i`` is the residual stream of the
frame's ``i``-th token, ``width == n_embd`` values), in the order of the batch entries'
positions.

``f32`` is the default because it is exact: the pipeline must produce the same tokens as
the unsplit model, and only an exact hop keeps that law testable bit for bit. The other
codecs trade exactness for bytes, for links where bandwidth rather than compute decides:

====== ============================================ ==================== =========
dtype  encoding                                     bytes / token        width 576
====== ============================================ ==================== =========
f32    IEEE float32, little-endian (lossless)       4 * width            2304
f16    IEEE float16 (refuses finite |x| > 65504)    2 * width            1152
bf16   upper 16 bits of float32, round-nearest-even 2 * width            1152
int8   symmetric per-row: width int8 values, then   width + 4            580
       one float32 scale per row (after all rows)
====== ============================================ ==================== =========

Everything here is pure numpy (no grpc, no llama.cpp) so the codecs and the descriptor
checks are unit-tested directly. The gRPC edge converts the protobuf ``FrameDescriptor``
(whose dtype and layout are enums) into :class:`FrameDescriptor` with the string names
below, and calls :func:`validate_descriptor` before :func:`decode`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

import numpy as np

from skippy_stage.errors import InvalidRequestError

WIRE_VERSION = 1
LAYOUT_TOKEN_MAJOR = "token-major"

_PREFIX = "frame.descriptor."
_INT8_QMAX = 127
# bfloat16's quiet-NaN bit, within the upper 16 bits of a float32.
_BF16_QUIET = np.uint32(0x0040)


class DType(str, Enum):
    """Wire dtypes; the values are the names used in StageConfig.wire_dtype."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


DTYPES: tuple[str, ...] = tuple(d.value for d in DType)
_BY_NAME = {d.value: d for d in DType}  # a dict lookup: ``DType(name)`` costs several times as much


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class FrameDescriptor:
    """What a receiver needs to check and decode an activation payload.

    Mirrors the protobuf ``FrameDescriptor``; ``dtype`` and ``layout`` are the string names
    (``"f32"``, ``"token-major"``). ``layer_start``/``layer_end`` are the producer's layer
    range: the frame holds the residual stream after layer ``layer_end - 1``.
    """

    version: int
    dtype: str
    layout: str
    producer_stage_index: int
    layer_start: int
    layer_end: int
    token_count: int
    sequence_count: int
    payload_bytes: int
    flags: int
    width: int


def _dtype(dtype: str) -> DType:
    kind = _BY_NAME.get(dtype) if isinstance(dtype, str) else None
    if kind is None:
        raise InvalidRequestError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return kind


def payload_size(dtype: str, tokens: int, width: int) -> int:
    """Exact payload length in bytes of ``tokens`` rows of ``width`` values in ``dtype``."""
    if tokens < 0 or width < 0:
        raise ValueError(f"tokens={tokens} and width={width} must be >= 0")
    kind = _dtype(dtype)
    if kind is DType.F32:
        return 4 * tokens * width
    if kind in (DType.F16, DType.BF16):
        return 2 * tokens * width
    return tokens * width + 4 * tokens  # int8 values, then one float32 scale per row


def make_descriptor(
    *,
    dtype: str,
    producer_stage_index: int,
    layer_start: int,
    layer_end: int,
    token_count: int,
    sequence_count: int,
    width: int,
    flags: int = 0,
) -> FrameDescriptor:
    """A token-major descriptor of the current version whose payload_bytes matches the shape."""
    return FrameDescriptor(
        version=WIRE_VERSION,
        dtype=_dtype(dtype).value,
        layout=LAYOUT_TOKEN_MAJOR,
        producer_stage_index=producer_stage_index,
        layer_start=layer_start,
        layer_end=layer_end,
        token_count=token_count,
        sequence_count=sequence_count,
        payload_bytes=payload_size(dtype, token_count, width),
        flags=flags,
        width=width,
    )


def encode(rows: np.ndarray, dtype: str) -> bytes:
    """Encode a (tokens, width) float32 array as payload bytes.

    Raises:
        ValueError: ``rows`` is not 2-D; ``dtype`` is f16 and a finite value lies beyond
            f16's range (it would decode as inf); or ``dtype`` is int8 and a row holds a
            non-finite value (int8 cannot carry inf/NaN). Lossy codecs may round, never
            corrupt silently.
        InvalidRequestError: ``dtype`` is not a wire dtype.
    """
    kind = _dtype(dtype)
    if rows.ndim != 2:
        raise ValueError(f"hidden-state rows must be 2-D (tokens, width), got shape {rows.shape}")
    # No copy when rows already are C-contiguous little-endian float32 (the usual case).
    x = np.ascontiguousarray(rows, dtype="<f4")
    if kind is DType.F32:
        return x.tobytes()
    if kind is DType.F16:
        return _f16_encode(x)
    if kind is DType.BF16:
        return _bf16_bits(x).tobytes()
    return _int8_encode(x)


def _f16_encode(x: np.ndarray) -> bytes:
    try:
        with np.errstate(over="raise"):
            return x.astype("<f2").tobytes()
    except FloatingPointError:
        # A finite value past f16's range would arrive as inf and poison every later layer.
        # 65520 is where round-to-nearest leaves 65504, f16's largest finite value.
        rows = np.flatnonzero((np.isfinite(x) & (np.abs(x) >= 65520.0)).any(axis=1))
        where = f"row {int(rows[0])}" if rows.size else "a row"
        raise ValueError(f"f16 cannot encode hidden states beyond +-65504 ({where}); use bf16 or f32") from None


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32)
    # Round to nearest, ties to even, on the upper 16 bits: add 0x7FFF plus the kept LSB.
    # Only NaN bit patterns can wrap around here, and they are replaced below.
    upper = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    nan = np.isnan(x)
    if nan.any():
        # Truncation could clear every mantissa bit that survives and turn NaN into inf.
        upper[nan] = (u[nan] >> 16) | _BF16_QUIET
    return upper.astype("<u2")


def _int8_encode(x: np.ndarray) -> bytes:
    absmax = np.max(np.abs(x), axis=1, initial=0.0)
    if not np.isfinite(absmax).all():
        bad = int(np.flatnonzero(~np.isfinite(absmax))[0])
        raise ValueError(f"int8 cannot encode non-finite hidden states (row {bad}); use f32")
    # The scale is absmax / 127 rounded toward zero, never up: 127 * scale then stays within the
    # row's own largest magnitude, so no row decodes beyond it (a row holding float32's largest value
    # would otherwise come back as inf). The float64 product of a float32 and 127 is exact.
    exact = absmax.astype(np.float64) / _INT8_QMAX
    scale = exact.astype(np.float32)
    over = scale.astype(np.float64) * _INT8_QMAX > absmax
    scale[over] = np.nextafter(scale[over], np.float32(0))
    # All-zero rows (and rows so small the scale underflows) get scale 1: they quantize to 0.
    scale[scale == 0] = 1.0
    q = np.rint(x / scale[:, None])
    np.clip(q, -_INT8_QMAX, _INT8_QMAX, out=q)
    return q.astype(np.int8).tobytes() + scale.astype("<f4").tobytes()


def decode(payload: bytes | memoryview, dtype: str, tokens: int, width: int) -> np.ndarray:
    """Decode payload bytes into a float32 array of shape (tokens, width).

    For f32 the result is a read-only view of ``payload`` (no copy); the other codecs
    return a fresh array.

    Raises:
        InvalidRequestError: ``dtype`` is unknown, or the payload length is not exactly
            ``payload_size(dtype, tokens, width)``.
    """
    expected = payload_size(dtype, tokens, width)
    got = memoryview(payload).nbytes
    if got != expected:
        raise InvalidRequestError(
            f"payload length {got} != payload_bytes {expected} expected for {dtype} x {tokens} tokens x width {width}"
        )
    kind = _dtype(dtype)
    if tokens == 0 or width == 0:
        return np.zeros((tokens, width), dtype=np.float32)
    if kind is DType.F32:
        return np.frombuffer(payload, dtype="<f4").astype(np.float32, copy=False).reshape(tokens, width)
    if kind is DType.F16:
        return np.frombuffer(payload, dtype="<f2").astype(np.float32).reshape(tokens, width)
    if kind is DType.BF16:
        upper = np.frombuffer(payload, dtype="<u2").astype(np.uint32)
        return (upper << 16).view(np.float32).reshape(tokens, width)
    q = np.frombuffer(payload, dtype=np.int8, count=tokens * width).reshape(tokens, width)
    scale = np.frombuffer(payload, dtype="<f4", count=tokens, offset=tokens * width).astype(np.float32)
    return q.astype(np.float32) * scale[:, None]


def validate_descriptor(
    desc: FrameDescriptor,
    *,
    payload_len: int,
    expected_layer_start: int,
    expected_width: int,
    accepted_dtypes: Collection[str],
    entry_rows: int,
    entry_count: int,
) -> None:
    """Refuse a frame this stage cannot consume, before anything reaches llama.cpp.

    Args:
        desc: the frame's descriptor as received.
        payload_len: length in bytes of the frame's payload.
        expected_layer_start: this stage's layer_start; the producer's layer_end must equal it.
        expected_width: this stage's n_embd.
        accepted_dtypes: wire dtypes this stage decodes.
        entry_rows: total positions over the request's batch entries (one row per position).
        entry_count: number of batch entries in the request.

    Raises:
        InvalidRequestError: naming the ``frame.descriptor.`` field and its value.
    """
    if desc.version != WIRE_VERSION:
        raise InvalidRequestError(
            f"{_PREFIX}version={desc.version} is not supported (this stage speaks {WIRE_VERSION})"
        )
    if desc.dtype not in DTYPES or desc.dtype not in accepted_dtypes:
        accepted = ", ".join(sorted(accepted_dtypes))
        raise InvalidRequestError(f"{_PREFIX}dtype={desc.dtype!r} is not accepted by this stage (accepts {accepted})")
    if desc.layout != LAYOUT_TOKEN_MAJOR:
        raise InvalidRequestError(f"{_PREFIX}layout={desc.layout!r} is not supported (only {LAYOUT_TOKEN_MAJOR!r})")
    if desc.layer_end != expected_layer_start:
        raise InvalidRequestError(
            f"{_PREFIX}layer_end={desc.layer_end} does not match this stage's layer_start={expected_layer_start}"
        )
    if desc.layer_start >= desc.layer_end:
        raise InvalidRequestError(
            f"{_PREFIX}layer_start={desc.layer_start} must be below {_PREFIX}layer_end={desc.layer_end}"
        )
    if desc.width != expected_width:
        raise InvalidRequestError(f"{_PREFIX}width={desc.width} does not match n_embd {expected_width}")
    if desc.token_count != entry_rows:
        raise InvalidRequestError(
            f"{_PREFIX}token_count={desc.token_count} does not match the {entry_rows} positions in the entries"
        )
    if desc.sequence_count != entry_count:
        raise InvalidRequestError(
            f"{_PREFIX}sequence_count={desc.sequence_count} does not match the {entry_count} entries"
        )
    expected_bytes = payload_size(desc.dtype, desc.token_count, desc.width)
    if desc.payload_bytes != expected_bytes:
        raise InvalidRequestError(
            f"{_PREFIX}payload_bytes={desc.payload_bytes} != {expected_bytes} for "
            f"{desc.dtype} x {desc.token_count} tokens x width {desc.width}"
        )
    if payload_len != desc.payload_bytes:
        raise InvalidRequestError(f"payload length {payload_len} != {_PREFIX}payload_bytes {desc.payload_bytes}")
