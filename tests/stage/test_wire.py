"""Activation-frame codecs and descriptor checks: pure, no model, no server."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from skippy_stage.config import WIRE_DTYPES
from skippy_stage.errors import InvalidRequestError
from skippy_stage.stage.wire import (
    DTYPES,
    LAYOUT_TOKEN_MAJOR,
    WIRE_VERSION,
    DType,
    FrameDescriptor,
    decode,
    encode,
    make_descriptor,
    payload_size,
    validate_descriptor,
)

WIDTH = 576


def _rows(tokens: int = 7, width: int = WIDTH, sigma: float = 3.0, seed: int = 0) -> np.ndarray:
    """Real-looking hidden states: ~N(0, sigma), float32, C-contiguous."""
    return (np.random.default_rng(seed).standard_normal((tokens, width)) * sigma).astype(np.float32)


def _round_trip(rows: np.ndarray, dtype: str) -> np.ndarray:
    payload = encode(rows, dtype)
    assert len(payload) == payload_size(dtype, *rows.shape)
    out = decode(payload, dtype, *rows.shape)
    assert out.dtype == np.float32
    assert out.shape == rows.shape
    return out


def test_dtype_names_are_the_config_values():
    assert DTYPES == WIRE_DTYPES
    assert [str(d) for d in DType] == list(WIRE_DTYPES)


# --- sizes -----------------------------------------------------------------------------


def test_bytes_per_token_at_width_576():
    per_token = {dtype: payload_size(dtype, 1, WIDTH) for dtype in DTYPES}
    for dtype, size in per_token.items():
        print(f"width {WIDTH}: {dtype:>4} = {size} bytes/token")
    assert per_token == {"f32": 2304, "f16": 1152, "bf16": 1152, "int8": 580}


@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_size_scales_with_tokens(dtype):
    assert payload_size(dtype, 0, WIDTH) == 0
    assert payload_size(dtype, 5, WIDTH) == 5 * payload_size(dtype, 1, WIDTH)


def test_unknown_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="'f64'"):
        payload_size("f64", 1, WIDTH)
    with pytest.raises(InvalidRequestError, match="'f64'"):
        decode(b"", "f64", 0, WIDTH)


# --- f32: exact ------------------------------------------------------------------------


def test_f32_round_trip_is_bit_exact():
    rows = _rows()
    rows[0, :6] = [-0.0, 0.0, 3.0e38, -3.0e38, 1.0e-45, np.finfo(np.float32).tiny]
    rows[1, :3] = [np.inf, -np.inf, np.float32(1 / 3)]
    out = _round_trip(rows, "f32")
    assert np.array_equal(out, rows)
    assert np.array_equal(out.view(np.uint32), rows.view(np.uint32))  # -0.0 stays -0.0
    assert np.signbit(out[0, 0])


def test_f32_payload_is_the_raw_little_endian_bytes():
    rows = _rows(3)
    assert encode(rows, "f32") == rows.astype("<f4").tobytes()


def test_f32_decode_accepts_a_memoryview():
    rows = _rows(2)
    assert np.array_equal(decode(memoryview(encode(rows, "f32")), "f32", 2, WIDTH), rows)


# --- f16 / bf16: within their precision ---------------------------------------------------


@pytest.mark.parametrize(("dtype", "rel"), [("f16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_round_trip_within_precision(dtype, rel):
    rows = _rows()
    out = _round_trip(rows, dtype)
    # Round-to-nearest: relative error at most half an ulp (2**-(mantissa_bits + 1)).
    # f16 subnormals (|x| < 6.1e-5) lose relative precision; bound them absolutely.
    bound = np.maximum(np.abs(rows) * rel, 2.0**-25)
    assert np.all(np.abs(out - rows) <= bound)


def test_bf16_of_representable_values_is_exact():
    # Values with at most 8 significant bits survive bf16 unchanged.
    rows = np.array([[0.0, -0.0, 1.0, -2.5, 0.15625, 3.0e38, -1.5e-38, 255.0]], dtype=np.float32)
    rows = (rows.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    out = _round_trip(rows, "bf16")
    assert np.array_equal(out.view(np.uint32), rows.view(np.uint32))


def test_bf16_rounds_to_nearest_even():
    def f32(bits: int) -> np.float32:
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    # Lower 16 bits exactly 0x8000: a tie. Kept LSB even -> round down; odd -> round up.
    even_tie, odd_tie = 0x3F808000, 0x3F818000
    rows = np.array([[f32(even_tie), f32(odd_tie), f32(0x3F808001), f32(0x3F807FFF)]], dtype=np.float32)
    upper = np.frombuffer(encode(rows, "bf16"), dtype="<u2")
    assert upper.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F80]


def test_bf16_keeps_nan_and_inf():
    nan_low_mantissa = np.array([0x7F800001], dtype=np.uint32).view(np.float32)[0]  # NaN that truncates to inf
    rows = np.array([[np.nan, -np.nan, nan_low_mantissa, np.inf, -np.inf]], dtype=np.float32)
    out = _round_trip(rows, "bf16")
    assert np.isnan(out[0, :3]).all()
    assert out[0, 3] == np.inf and out[0, 4] == -np.inf


def test_f16_refuses_finite_values_beyond_its_range():
    rows = np.array([[1.0, 2.0], [np.inf, -1.0e5]], dtype=np.float32)
    with pytest.raises(ValueError, match="row 1"):
        encode(rows, "f16")


def test_f16_keeps_nan_and_inf():
    out = _round_trip(np.array([[np.nan, np.inf, -np.inf, 65504.0]], dtype=np.float32), "f16")
    assert np.isnan(out[0, 0])
    assert out[0, 1:].tolist() == [np.inf, -np.inf, 65504.0]
    assert _round_trip(np.array([[65519.0]], dtype=np.float32), "f16").tolist() == [[65504.0]]


# --- int8: symmetric per row ---------------------------------------------------------------


def test_int8_error_within_half_a_step_per_row():
    rows = _rows()
    rows[3] *= 100.0  # rows of very different magnitudes get their own scales
    out = _round_trip(rows, "int8")
    scale = np.abs(rows).max(axis=1) / 127
    tiny = 1e-6 * np.abs(rows).max(axis=1)
    assert np.all(np.abs(out - rows).max(axis=1) <= scale / 2 + tiny)


def test_int8_payload_layout_is_values_then_scales():
    rows = np.array([[127.0, -63.5, 0.0], [1.0, 0.5, -0.25]], dtype=np.float32)
    payload = encode(rows, "int8")
    q = np.frombuffer(payload, dtype=np.int8, count=6).reshape(2, 3)
    scales = np.frombuffer(payload, dtype="<f4", offset=6)
    assert scales.tolist() == pytest.approx([1.0, 1 / 127])
    assert q[0].tolist() == [127, -64, 0]  # -63.5 rounds to even
    assert q[1].tolist() == [127, 64, -32]


def test_int8_zero_rows_decode_to_zeros():
    rows = _rows(3)
    rows[1] = 0.0
    out = _round_trip(rows, "int8")
    assert np.array_equal(out[1], np.zeros(WIDTH, dtype=np.float32))
    scales = np.frombuffer(encode(rows, "int8"), dtype="<f4", offset=3 * WIDTH)
    assert scales[1] == 1.0


def test_int8_refuses_non_finite_rows():
    rows = _rows(2)
    rows[1, 5] = np.nan
    with pytest.raises(ValueError, match="row 1"):
        encode(rows, "int8")


# --- real-looking data, every codec ---------------------------------------------------------


@pytest.mark.parametrize(("dtype", "max_rel_rms"), [("f32", 0.0), ("f16", 3e-4), ("bf16", 3e-3), ("int8", 1.5e-2)])
def test_round_trip_of_hidden_state_like_rows(dtype, max_rel_rms):
    rows = _rows(7, WIDTH, sigma=3.0, seed=42)
    out = _round_trip(rows, dtype)
    rel_rms = float(np.sqrt(np.mean((out - rows) ** 2)) / np.sqrt(np.mean(rows**2)))
    assert rel_rms <= max_rel_rms


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_frame_round_trips(dtype):
    out = _round_trip(np.zeros((0, WIDTH), dtype=np.float32), dtype)
    assert out.shape == (0, WIDTH)


def test_encode_refuses_non_2d_rows():
    with pytest.raises(ValueError, match="2-D"):
        encode(np.zeros(WIDTH, dtype=np.float32), "f32")


# --- decode length check ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_refuses_wrong_payload_length(dtype):
    expected = payload_size(dtype, 4, WIDTH)
    payload = encode(_rows(4), dtype)
    for bad in (payload[:-1], payload + b"\0", b""):
        with pytest.raises(InvalidRequestError) as err:
            decode(bad, dtype, 4, WIDTH)
        message = str(err.value)
        assert "payload_bytes" in message
        assert f"payload length {len(bad)} " in message
        assert str(expected) in message


# --- descriptor ---------------------------------------------------------------------------------

STAGE_LAYER_START = 10
ENTRY_ROWS = 4
ENTRY_COUNT = 2


def _good(**changes) -> FrameDescriptor:
    desc = make_descriptor(
        dtype="f32",
        producer_stage_index=0,
        layer_start=0,
        layer_end=STAGE_LAYER_START,
        token_count=ENTRY_ROWS,
        sequence_count=ENTRY_COUNT,
        width=WIDTH,
    )
    return dataclasses.replace(desc, **changes)


def _validate(desc: FrameDescriptor, *, payload_len: int | None = None, accepted=("f32",)) -> None:
    validate_descriptor(
        desc,
        payload_len=desc.payload_bytes if payload_len is None else payload_len,
        expected_layer_start=STAGE_LAYER_START,
        expected_width=WIDTH,
        accepted_dtypes=accepted,
        entry_rows=ENTRY_ROWS,
        entry_count=ENTRY_COUNT,
    )


def test_make_descriptor_fills_payload_bytes():
    desc = _good()
    assert desc.version == WIRE_VERSION
    assert desc.layout == LAYOUT_TOKEN_MAJOR
    assert desc.payload_bytes == 4 * ENTRY_ROWS * WIDTH == 9216
    assert (
        make_descriptor(
            dtype="int8",
            producer_stage_index=1,
            layer_start=3,
            layer_end=7,
            token_count=4,
            sequence_count=1,
            width=WIDTH,
        ).payload_bytes
        == 4 * WIDTH + 16
    )


def test_a_correct_descriptor_passes():
    _validate(_good())
    payload = encode(_rows(ENTRY_ROWS), "bf16")
    desc = _good(dtype="bf16", payload_bytes=payload_size("bf16", ENTRY_ROWS, WIDTH))
    _validate(desc, payload_len=len(payload), accepted=DTYPES)


@pytest.mark.parametrize(
    ("changes", "payload_len", "fragments"),
    [
        ({"version": 2}, None, ["frame.descriptor.version=2"]),
        ({"dtype": "f16", "payload_bytes": 2 * ENTRY_ROWS * WIDTH}, None, ["frame.descriptor.dtype='f16'", "f32"]),
        ({"dtype": "f64"}, None, ["frame.descriptor.dtype='f64'"]),
        ({"layout": "sequence-major"}, None, ["frame.descriptor.layout='sequence-major'"]),
        (
            {"layer_start": 5, "layer_end": 20},
            None,
            ["frame.descriptor.layer_end=20 does not match this stage's layer_start=10"],
        ),
        ({"layer_start": 10}, None, ["frame.descriptor.layer_start=10", "frame.descriptor.layer_end=10"]),
        ({"layer_start": 12}, None, ["frame.descriptor.layer_start=12"]),
        (
            {"width": 512, "payload_bytes": 4 * ENTRY_ROWS * 512},
            None,
            ["frame.descriptor.width=512 does not match n_embd 576"],
        ),
        ({"token_count": 5, "payload_bytes": 4 * 5 * WIDTH}, None, ["frame.descriptor.token_count=5", "4"]),
        ({"sequence_count": 3}, None, ["frame.descriptor.sequence_count=3", "2"]),
        ({"payload_bytes": 2304}, None, ["frame.descriptor.payload_bytes=2304", "9216"]),
        ({}, 100, ["payload length 100 != frame.descriptor.payload_bytes 9216"]),
    ],
    ids=[
        "version",
        "dtype-not-accepted",
        "dtype-unknown",
        "layout",
        "layer_end",
        "empty-range",
        "inverted-range",
        "width",
        "token_count",
        "sequence_count",
        "payload_bytes",
        "payload-length",
    ],
)
def test_descriptor_refusals_name_field_and_value(changes, payload_len, fragments):
    with pytest.raises(InvalidRequestError) as err:
        _validate(_good(**changes), payload_len=payload_len)
    for fragment in fragments:
        assert fragment in str(err.value)
