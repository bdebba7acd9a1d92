"""Hostile input: random, garbage and boundary values get an error, never a crash or a hang.

Property-based (hypothesis), in two halves:

* **Pure and fast** — frame decoding (``wire.decode``, ``wire.validate_descriptor``,
  ``codec.descriptor_from_pb``), config loading (``StageConfig.from_dict``,
  ``load_config``) and request parsing (``codec.step_from_pb`` then
  ``steps.runtime_entries``, ``service.generate_spec_from_pb``) raise only their documented
  domain error, and what decodes round-trips.
* **Against a real 3-stage SmolLM2 pipeline** (one ``serve`` process per stage, started
  once for the module): hostile IterationBatch, ActivationFrame, ActivationStream,
  Decode, DropSession and Generate requests, and undecodable bytes, to every stage. Each
  call must end within its deadline with one of the status codes a client is promised
  (:data:`ALLOWED`); the stage process must stay alive; and after every case — once the
  sessions the case opened *successfully* are dropped by the test — no stage may hold a
  session or a KV cell. A case is a short sequence of calls over a small pool of session
  ids, so requests also meet sessions that earlier calls of the same case opened.

Requests are generated from compact specs (a payload is a dtype, a fill pattern and a
seed, not megabytes of bytes), so a falsifying example prints small and shrinks well.

The default run is modest and reproducible (``derandomize=True``); the ``slow`` test
runs every property again with at least 10,000 cases in all. Gaps the properties found
are pinned, each by its minimal example, as tests of their own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.pipeline import StageHandle, handles

from skippy_stage.config import (
    CACHE_TYPES,
    FLASH_ATTN_TYPES,
    LOAD_MODES,
    SPLIT_MODES,
    WIRE_DTYPES,
    StageConfig,
    load_config,
)
from skippy_stage.errors import ConfigError, InvalidRequestError, SkippyError
from skippy_stage.head.generator import GenerateSpec
from skippy_stage.server.service import generate_spec_from_pb
from skippy_stage.stage import wire
from skippy_stage.stage.codec import DTYPE_TO_PB, descriptor_from_pb, step_from_pb
from skippy_stage.stage.steps import StageShape, runtime_entries
from skippy_stage.v1 import stage_pb2 as pb

RANGES = [(0, 10), (10, 20), (20, 30)]
N_BATCH = 64
LANE_COUNT = 4
MAX_MESSAGE_BYTES = 1 << 20
N_EMBD = 576
N_VOCAB = 49152
SERVICE = "skippy.stage.v1.StageService"
VALID_TOKENS = [1, 504, 3458, 282, 4649, 314, 253, 2114]
MAX_SESSION_ID_LEN = 256

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1

# Per-call deadlines. A call that runs into one is a hang, and fails the property.
CALL_TIMEOUT_S = 5.0
GENERATE_TIMEOUT_S = 10.0
# Sessions freed in the background (a failed forward's drop-below, a cancelled
# generation) must be gone within this long after the case.
SETTLE_S = 5.0

ALLOWED = frozenset({
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
})
# Without the stage's own request deserializers grpcio answers bytes it cannot parse (bad wire
# format, invalid UTF-8 in a string field) with INTERNAL and exactly this message, before any
# handler runs. Never allowed: such bytes are INVALID_ARGUMENT naming the message.
GRPC_DESERIALIZE_FAILURE = "Exception deserializing request!"
# A hop whose own timeout_s has already run out (negative, NaN, tiny) gets DEADLINE_EXCEEDED
# from the stage below; that is the honest answer, so it is allowed for such hops only.
HOP_EXPIRED_BELOW_S = 0.5


def rarely(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in ``one_in`` draws (``integers(0, k) == 0`` is far likelier: hypothesis favours 0)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Pick among strategies with weights (repeating a strategy in ``st.one_of`` does not weight it)."""
    index = [i for i, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(index).flatmap(lambda i: choices[i][1])


HEALTH_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                 HealthCheck.large_base_example]


def run_cases(strategy: st.SearchStrategy, check: Callable[[object], None], max_examples: int) -> int:
    """Run ``check`` on ``max_examples`` generated cases; returns how many ran."""
    count = 0

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=HEALTH_CHECKS, print_blob=False)
    @given(strategy)
    def run(case: object) -> None:
        nonlocal count
        count += 1
        check(case)

    run()
    return count


def report(name: str, count: int) -> None:
    print(f"\nhostile cases: {name}: {count}")


# =====================================================================================
# Value strategies shared by both halves
# =====================================================================================

NO_SURROGATES = st.characters(blacklist_categories=("Cs",))
CONTROL = st.characters(min_codepoint=0, max_codepoint=0x1F) | st.sampled_from(["\x7f", "\u200b", "\ufeff", "\u2028"])
HOSTILE_TEXT = st.one_of(
    st.just(""),
    st.text(NO_SURROGATES, max_size=24),
    st.text(CONTROL, min_size=1, max_size=12),
    st.sampled_from(["\x00", "<|im_end|>", "<|endoftext|>", "{{ raise }}", "🦙" * 3, "é\u0301", "\U0010ffff"]),
    st.builds(lambda s, k: s * k, st.sampled_from(["x", "é", "🦙", "ab\x00"]), st.sampled_from([257, 3000])),
)
INT32 = st.one_of(st.sampled_from([0, 1, -1, INT32_MIN, INT32_MAX, INT32_MAX - 1, N_VOCAB, N_VOCAB - 1]),
                  st.integers(INT32_MIN, INT32_MAX))
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 10, 20, 30, N_EMBD, INT32_MAX, UINT32_MAX]), st.integers(0, UINT32_MAX))
FLOAT32 = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, math.nan, math.inf, -math.inf]),
                    st.floats(width=32))


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    """Mostly valid values, with a hostile one mixed in now and then."""
    def value(plausible: list[object], hostile: st.SearchStrategy) -> object:
        return draw(weighted((6, st.sampled_from(plausible)), (1, hostile)))

    msg = pb.SamplingParams(temperature=value([0.0, 0.7, 1e30], FLOAT32), top_k=value([0, 40, INT32_MAX], INT32),
                            min_p=value([0.0, 0.05], FLOAT32))
    if draw(st.booleans()):
        msg.top_p = value([0.9, 1.0, 1e-45], FLOAT32)
    if draw(st.booleans()):
        msg.repeat_penalty = value([1.1, 1.0, 1e30], FLOAT32)
    if draw(st.booleans()):
        msg.repeat_last_n = value([64, 0, 4096], INT32)
    if draw(st.booleans()):
        msg.seed = draw(UINT32)
    return msg


# =====================================================================================
# Request specs: compact descriptions that build real protobuf requests
# =====================================================================================

NEXT = "next"  # an entry's positions start at the session's next position (tracked per case)
FILLS = ("zeros", "normal", "bits", "huge", "nan", "inf", "tiny")
DESCRIPTOR_FIELDS = ("version", "dtype", "layout", "producer_stage_index", "layer_start", "layer_end",
                     "token_count", "sequence_count", "payload_bytes", "flags", "width")


@dataclass(frozen=True)
class EntrySpec:
    session_id: str
    start: int | str = 0
    n: int = 1
    raw_positions: tuple[int, ...] | None = None  # instead of start/n
    token_ids: tuple[int, ...] | None = None  # None: n valid ids
    phase: int = 1
    sample_last: bool = True
    want_logits: bool = False
    sampling: pb.SamplingParams | None = None


@dataclass(frozen=True)
class FrameSpec:
    dtype: str = "f32"
    fill: str = "normal"
    seed: int = 0
    overrides: tuple[tuple[str, int], ...] = ()  # descriptor fields set to hostile values
    payload_delta: int = 0  # bytes appended (+) or cut (-) after building a matching payload
    oversize: bool = False  # append past max_message_bytes


@dataclass(frozen=True)
class BatchSpec:
    entries: tuple[EntrySpec, ...]
    frame: FrameSpec | None = None
    request_id: str = "hostile"


def entry_positions(spec: EntrySpec, next_pos: int) -> list[int]:
    if spec.raw_positions is not None:
        return list(spec.raw_positions)
    start = next_pos if spec.start == NEXT else int(spec.start)
    # Protobuf int32 fields refuse values past the range; wrap like a C client would.
    return [((p - INT32_MIN) % 2**32) + INT32_MIN for p in range(start, start + spec.n)]


def frame_payload(spec: FrameSpec, rows: int) -> bytes:
    rng = np.random.default_rng(spec.seed)
    size = wire.payload_size(spec.dtype, rows, N_EMBD)
    if spec.fill == "bits":
        payload = rng.bytes(size)
    else:
        if spec.fill == "normal":
            x = rng.standard_normal((rows, N_EMBD)).astype(np.float32) * np.float32(3.0)
        else:
            value = {"zeros": 0.0, "huge": 3.0e38, "nan": math.nan, "inf": math.inf, "tiny": 1e-42}[spec.fill]
            x = np.zeros((rows, N_EMBD), dtype=np.float32)
            if rows:
                x.flat[rng.integers(0, x.size, size=max(1, x.size // 7))] = value
        if spec.dtype == "f32":
            payload = x.tobytes()
        elif spec.dtype == "f16":
            with np.errstate(over="ignore", invalid="ignore"):
                payload = x.astype("<f2").tobytes()
        elif spec.dtype == "bf16":
            payload = (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:  # int8 values, then one (possibly non-finite) f32 scale per row
            q = rng.integers(-127, 128, size=(rows, N_EMBD)).astype(np.int8)
            scale = np.abs(x).max(axis=1, initial=0.0).astype("<f4") / np.float32(127)
            payload = q.tobytes() + scale.tobytes()
    if spec.payload_delta > 0:
        payload += rng.bytes(spec.payload_delta)
    elif spec.payload_delta < 0:
        payload = payload[: max(0, len(payload) + spec.payload_delta)]
    if spec.oversize:
        payload += bytes(MAX_MESSAGE_BYTES)
    return payload


def build_batch(spec: BatchSpec, stage: int,
                next_pos: Callable[[str], int] = lambda sid: 0) -> pb.IterationBatchRequest:
    """The request a spec describes, aimed at ``stage`` (its frame comes 'from' the stage above)."""
    entries = []
    for e in spec.entries:
        positions = entry_positions(e, next_pos(e.session_id))
        token_ids = list(e.token_ids) if e.token_ids is not None else [
            VALID_TOKENS[i % len(VALID_TOKENS)] for i in range(len(positions))]
        entry = pb.BatchEntry(session_id=e.session_id, phase=e.phase, positions=positions, token_ids=token_ids,
                              sample_last=e.sample_last, want_logits=e.want_logits)
        if e.sampling is not None:
            entry.sampling.CopyFrom(e.sampling)
        entries.append(entry)
    request = pb.IterationBatchRequest(request_id=spec.request_id, entries=entries)
    if spec.frame is not None:
        f = spec.frame
        rows = sum(len(e.positions) for e in entries)
        above = RANGES[max(stage - 1, 0)]
        desc = pb.FrameDescriptor(
            version=wire.WIRE_VERSION, dtype=DTYPE_TO_PB[f.dtype], layout=pb.LAYOUT_TOKEN_MAJOR,
            producer_stage_index=max(stage - 1, 0), layer_start=above[0], layer_end=RANGES[stage][0] or above[1],
            token_count=rows, sequence_count=len(entries), width=N_EMBD,
            payload_bytes=wire.payload_size(f.dtype, rows, N_EMBD),
        )
        for name, value in f.overrides:
            setattr(desc, name, value)
        request.frame.descriptor.CopyFrom(desc)
        request.frame.payload = frame_payload(f, rows)
    return request


SESSION_POOL = ("a", "b", "c")
SESSION_IDS = weighted(
    (4, st.sampled_from(SESSION_POOL)),  # meet the sessions earlier calls of the case opened
    (2, HOSTILE_TEXT),
    (1, st.sampled_from(["x" * 256, "x" * 257, " ", "a\x00b", "ä" * 256])),
)


@st.composite
def entry_specs(draw: st.DrawFn) -> EntrySpec:
    n = draw(weighted((6, st.integers(1, 6)), (1, st.sampled_from([0, N_BATCH, N_BATCH + 1])),
                      (1, st.integers(0, 70))))
    start = draw(weighted((6, st.sampled_from([0, NEXT])),
                          (1, st.sampled_from([1, 5, -1, INT32_MIN, INT32_MAX, INT32_MAX - 1, 500, 511, 512])),
                          (1, INT32)))
    raw_positions = draw(weighted((7, st.none()), (1, st.lists(INT32, max_size=8).map(tuple))))
    token_ids = draw(weighted((6, st.none()), (1, st.lists(INT32, max_size=8).map(tuple)),
                              (1, st.builds(lambda t, k: (t,) * k, INT32, st.just(n)))))
    sampling = draw(st.none() | sampling_params())
    return EntrySpec(
        session_id=draw(SESSION_IDS), start=start, n=n, raw_positions=raw_positions, token_ids=token_ids,
        phase=draw(st.sampled_from([0, 1, 2]) | st.integers(-3, 9)),
        sample_last=draw(st.booleans()), want_logits=draw(rarely(4)), sampling=sampling,
    )


@st.composite
def frame_specs(draw: st.DrawFn) -> FrameSpec:
    overrides = draw(st.lists(
        st.sampled_from(DESCRIPTOR_FIELDS).flatmap(
            lambda name: st.tuples(st.just(name), {
                "dtype": st.integers(0, 6) | INT32, "layout": st.integers(0, 3) | INT32,
                "payload_bytes": st.sampled_from([0, 1, UINT64_MAX]) | st.integers(0, UINT64_MAX),
            }.get(name, UINT32))),
        max_size=3,
    ).map(tuple))
    # Mostly no override, so frames also get past the descriptor checks into the runtime.
    if not draw(rarely(3)):
        overrides = ()
    return FrameSpec(
        dtype=draw(st.sampled_from(wire.DTYPES)), fill=draw(st.sampled_from(FILLS)), seed=draw(st.integers(0, 2**16)),
        overrides=overrides,
        payload_delta=draw(weighted((12, st.just(0)), (2, st.sampled_from([-1, 1, -4, 4, -(10**6)])),
                                    (1, st.integers(-5000, 5000)))),
        oversize=draw(rarely(40)),
    )


def batch_specs(*, frame: bool | None) -> st.SearchStrategy[BatchSpec]:
    """``frame``: True mostly with a frame, False mostly without, None either."""
    weight = {True: (1, 6), False: (6, 1), None: (1, 1)}[frame]
    # hypothesis favours the first choice: list the common one first.
    frames = weighted((weight[1], frame_specs()), (weight[0], st.none())) if frame is not False else \
        weighted((weight[0], st.none()), (weight[1], frame_specs()))
    return st.builds(
        BatchSpec,
        entries=weighted((12, st.lists(entry_specs(), min_size=1, max_size=4)), (1, st.just([])),
                         (1, st.lists(entry_specs(), min_size=5, max_size=6))).map(tuple),
        frame=frames,
        request_id=st.one_of(st.just("hostile"), HOSTILE_TEXT),
    )


def garbage_messages(message: type) -> st.SearchStrategy:
    """Whatever protobuf makes of random bytes (an empty message when they do not parse)."""
    def parse(data: bytes) -> object:
        try:
            return message.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError, or invalid UTF-8 in a string field
            return message()
    return st.binary(max_size=96).map(parse)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    prompt = draw(st.one_of(
        st.sampled_from(["The capital of France is", "Once upon a time", "1 2 3 4"]),
        HOSTILE_TEXT,
        # Long: past a lane's 512 KV cells once tokenised; "é" * 510 is the longest prompt that fits.
        st.builds(lambda w, k: w * k, st.sampled_from(["hello world ", "🦙 ", "\x00\x01", "zq"]),
                  st.sampled_from([40, 3000, 100_000])),
        st.sampled_from(["é" * 510, "é" * 511]),
    ))
    messages = draw(st.lists(st.builds(
        lambda role, content: pb.ChatMessage(role=role, content=content),
        weighted((3, st.sampled_from(["system", "user", "assistant", "tool"])), (1, HOSTILE_TEXT)), HOSTILE_TEXT),
        min_size=1, max_size=3))
    which = draw(st.sampled_from(["prompt"] * 4 + ["messages"] * 4 + ["both", "neither"]))
    request = pb.GenerateRequest(
        prompt=prompt if which in ("prompt", "both") else "",
        messages=messages if which in ("messages", "both") else [],
        max_tokens=draw(weighted((4, st.sampled_from([1, 2, 3, 0, 16])),
                                 (1, st.sampled_from([511, 512, 513, UINT32_MAX])), (1, st.integers(0, UINT32_MAX)))),
        stop=draw(weighted(
            (3, st.just([])),
            (2, st.lists(st.sampled_from([".", "\n", " the", "x" * 256, "\x00", "🦙"]), max_size=4)),
            (1, st.lists(HOSTILE_TEXT | st.sampled_from(["x" * 257, ""]), max_size=18)),
        )),
    )
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling_params()))
    if draw(rarely(4)):
        request.stream_interval_ms = draw(st.sampled_from([0, 20, 1000, 1001, UINT32_MAX]))
    if draw(rarely(6)):  # images, to a head with no projector (or none a marker asks for)
        request.media.extend(draw(st.lists(st.binary(max_size=64) | st.just(b"\x89PNG\r\n\x1a\n" + bytes(24)),
                                           min_size=1, max_size=3)))
    if draw(rarely(40)):  # past max_message_bytes
        request.prompt = "x" * (MAX_MESSAGE_BYTES + 1)
    return request


# =====================================================================================
# Pure properties
# =====================================================================================

SHAPES = [
    StageShape(stage_id=f"stage-{i}", stage_index=i, layer_start=a, layer_end=b, n_embd=N_EMBD,
               include_embeddings=a == 0, include_output=i == len(RANGES) - 1, wire_dtype="f32")
    for i, (a, b) in enumerate(RANGES)
]
SHAPE_NAMES = tuple(range(len(SHAPES)))

SIZES = st.one_of(st.integers(0, 8), st.sampled_from([N_EMBD, INT32_MAX, UINT32_MAX]), st.integers(0, UINT32_MAX))


@st.composite
def decode_inputs(draw: st.DrawFn) -> tuple[bytes, str, int, int]:
    dtype = draw(st.sampled_from(wire.DTYPES) | st.text(max_size=6))
    tokens, width = draw(SIZES), draw(SIZES)
    if dtype in wire.DTYPES and tokens * width <= 64 and draw(st.booleans()):
        size = max(0, wire.payload_size(dtype, tokens, width) + draw(st.sampled_from([0, 0, 0, -1, 1, 4])))
        payload = draw(st.binary(min_size=size, max_size=size))
    else:
        payload = draw(st.binary(max_size=64))
    return payload, dtype, tokens, width


def check_decode(case: tuple[bytes, str, int, int]) -> None:
    payload, dtype, tokens, width = case
    try:
        out = wire.decode(payload, dtype, tokens, width)
    except InvalidRequestError:
        return
    assert out.shape == (tokens, width) and out.dtype == np.float32
    assert len(payload) == wire.payload_size(dtype, tokens, width)


@st.composite
def round_trip_inputs(draw: st.DrawFn) -> tuple[str, int, int, bytes]:
    dtype = draw(st.sampled_from(wire.DTYPES))
    tokens, width = draw(st.integers(0, 6)), draw(st.integers(0, 12))
    size = wire.payload_size(dtype, tokens, width)
    return dtype, tokens, width, draw(st.binary(min_size=size, max_size=size))


def check_round_trip(case: tuple[str, int, int, bytes]) -> None:
    """Payload -> rows -> payload gives the same bits (int8: the same values within a step)."""
    dtype, tokens, width, payload = case
    rows = wire.decode(payload, dtype, tokens, width)
    if dtype == "int8":
        rows = np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0)
        back = wire.decode(wire.encode(rows, "int8"), "int8", tokens, width)
        step = np.abs(rows).max(axis=1, initial=0.0, keepdims=True) / np.float32(127)
        assert (np.abs(back - rows) <= 0.5 * step * (1 + 1e-5) + np.abs(rows) * 1e-6 + 1e-38).all()
        return
    again = wire.encode(rows, dtype)
    assert len(again) == len(payload)
    if dtype == "f32":
        assert again == payload  # bit for bit, NaN payloads included
        return
    # f16/bf16: identical except that a NaN may come back with another payload (still NaN).
    before = np.frombuffer(payload, dtype="<u2")
    after = np.frombuffer(again, dtype="<u2")
    nan = np.isnan(rows.reshape(-1))
    assert (before[~nan] == after[~nan]).all()
    assert np.isnan(wire.decode(again, dtype, tokens, width).reshape(-1)[nan]).all()


FINITE_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


# int8 turns values within a rounding of float32's largest into inf: see
# test_int8_keeps_float32_max_finite. The property stays clear of that edge.
INT8_SAFE_MAX = float(np.float32(3.0e38))


@st.composite
def encodable_rows(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    dtype = draw(st.sampled_from(wire.DTYPES))
    tokens, width = draw(st.integers(0, 5)), draw(st.integers(1, 9))
    values = st.floats(-INT8_SAFE_MAX, INT8_SAFE_MAX, width=32) if dtype == "int8" else FINITE_F32
    values = draw(st.lists(values | st.sampled_from([0.0, 1.0, -65504.0, 65519.0, 1e-40]),
                           min_size=tokens * width, max_size=tokens * width))
    return dtype, np.array(values, dtype=np.float32).reshape(tokens, width)


def check_rows_round_trip(case: tuple[str, np.ndarray]) -> None:
    """Rows -> payload -> rows: exact for f32, one rounding for f16/bf16, one step for int8."""
    dtype, rows = case
    try:
        payload = wire.encode(rows, dtype)
    except ValueError:
        assert dtype == "f16" and (np.abs(rows) >= 65520.0).any(), "only f16 may refuse finite rows"
        return
    back = wire.decode(payload, dtype, *rows.shape)
    if dtype == "f32":
        assert back.tobytes() == rows.tobytes()
    elif dtype == "f16":
        assert (back == rows.astype(np.float16).astype(np.float32)).all()
    elif dtype == "bf16":
        # Within half a bf16 ulp; inf only for values past bf16's largest finite (~3.3895e38).
        finite = np.isfinite(back)
        tol = np.maximum(np.abs(rows.astype(np.float64)) * 2.0**-8, 2.0**-133)
        assert (np.abs(back.astype(np.float64) - rows)[finite] <= tol[finite]).all()
        assert (finite | (np.abs(rows) >= 3.3895e38)).all()
    else:
        step = np.abs(rows).max(axis=1, initial=0.0, keepdims=True).astype(np.float64) / 127
        err = np.abs(back.astype(np.float64) - rows.astype(np.float64))
        assert (err <= 0.5 * step * (1 + 1e-5) + np.abs(rows) * 1e-6 + 1e-38).all()


@st.composite
def descriptor_cases(draw: st.DrawFn) -> tuple[wire.FrameDescriptor, dict[str, object], bool]:
    """A consistent descriptor and its checks, maybe with fields replaced by anything."""
    dtype = draw(st.sampled_from(wire.DTYPES))
    tokens = draw(st.integers(0, 100))
    entries = draw(st.integers(0, 8))
    width = draw(st.sampled_from([N_EMBD, 1, 4096]))
    start, end = draw(st.sampled_from([(0, 10), (10, 20), (0, 1)]))
    desc = wire.make_descriptor(dtype=dtype, producer_stage_index=0, layer_start=start, layer_end=end,
                                token_count=tokens, sequence_count=entries, width=width)
    checks: dict[str, object] = dict(payload_len=desc.payload_bytes, expected_layer_start=end, expected_width=width,
                                     accepted_dtypes=wire.DTYPES, entry_rows=tokens, entry_count=entries)
    any_int = st.integers() | st.sampled_from([-1, 0, 2**63, UINT64_MAX, INT32_MAX])
    # Fields keep their types (the gRPC edge builds descriptors from protobuf ints and the
    # enum names); their values are anything.
    names = st.text(max_size=8) | st.sampled_from(list(wire.DTYPES) + ["token-major", "F32", ""])
    changes = draw(st.lists(st.sampled_from(DESCRIPTOR_FIELDS).flatmap(
        lambda k: st.tuples(st.just(k), names if k in ("dtype", "layout") else any_int)), max_size=3).map(dict))
    check_changes = draw(st.dictionaries(st.sampled_from(sorted(checks)), st.one_of(
        st.integers(0, 2**40), st.frozensets(st.sampled_from(list(wire.DTYPES) + ["x"]))), max_size=2))
    original: dict[str, object] = {}
    for key, value in check_changes.items():
        if (key == "accepted_dtypes") != isinstance(value, frozenset):
            continue
        original[key], checks[key] = checks[key], value
    # Refusal is justified only by a change to a field the check looks at.
    checked_fields = [k for k in changes if k not in ("producer_stage_index", "flags")]
    mutated = any(getattr(desc, k) != changes[k] for k in checked_fields) or any(
        (dtype not in checks[k]) if k == "accepted_dtypes" else checks[k] != v for k, v in original.items())
    return dataclasses.replace(desc, **changes), checks, mutated


def check_descriptor(case: tuple[wire.FrameDescriptor, dict[str, object], bool]) -> None:
    desc, checks, mutated = case
    try:
        wire.validate_descriptor(desc, **checks)
    except InvalidRequestError as exc:
        assert str(exc), "the refusal names the field"
        assert mutated, f"a consistent descriptor was refused: {exc}"
        return
    # Accepted: then it really describes a payload this stage can decode.
    assert desc.payload_bytes == checks["payload_len"]
    if desc.payload_bytes <= 1 << 24:
        wire.decode(bytes(desc.payload_bytes), desc.dtype, desc.token_count, desc.width)


def check_descriptor_from_pb(desc: pb.FrameDescriptor) -> None:
    """Total: any descriptor converts; one the wire cannot carry is refused by the check."""
    out = descriptor_from_pb(desc)
    if out.dtype in wire.DTYPES and out.layout == wire.LAYOUT_TOKEN_MAJOR:
        return
    out = dataclasses.replace(out, version=wire.WIRE_VERSION)  # the check looks at the version first
    with pytest.raises(InvalidRequestError, match=r"frame\.descriptor\.(dtype|layout)="):
        wire.validate_descriptor(out, payload_len=out.payload_bytes, expected_layer_start=out.layer_end,
                                 expected_width=out.width, accepted_dtypes=wire.DTYPES, entry_rows=out.token_count,
                                 entry_count=out.sequence_count)


PB_DESCRIPTORS = st.one_of(
    garbage_messages(pb.FrameDescriptor),
    st.builds(pb.FrameDescriptor, version=UINT32, dtype=st.integers(0, 6) | INT32, layout=st.integers(0, 3) | INT32,
              token_count=UINT32, width=UINT32, payload_bytes=st.integers(0, UINT64_MAX)),
)

# -- config ---------------------------------------------------------------------------

FIELD_NAMES = sorted(f for f in StageConfig.__dataclass_fields__)
BASE_CONFIG: dict[str, object] = {
    "model_path": "/models/m.gguf", "stage_id": "stage-1", "stage_index": 1, "layer_start": 10, "layer_end": 20,
    "bind_addr": "127.0.0.1:0",
    "upstream": {"stage_id": "stage-0", "stage_index": 0, "endpoint": "127.0.0.1:7000"},
    "downstream": {"stage_id": "stage-2", "stage_index": 2, "endpoint": "127.0.0.1:7002"},
}
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 64, 256, 257, 1024, 1023, 65535, 65536, INT32_MAX, 2**63, -(2**63), 10**30,
                     10**4000, -(10**4000)]),
    st.integers(),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-300, 1e300, math.nan, math.inf, -math.inf, 86400.0, 86400.5, 3600.0]),
    st.floats(),
    HOSTILE_TEXT,
    st.sampled_from(["f16", "q8_0", "enabled", "layer", "runtime-slice", "layer-package", "int8", "unary",
                     "127.0.0.1:0", "[::1]:7000", "host:65536", "host:-1", "a:1\n", "", "true", "1"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10) | st.sampled_from(
        ["stage_id", "stage_index", "endpoint"]), inner, max_size=4),
    max_leaves=8,
)
CONFIG_KEYS = st.sampled_from(FIELD_NAMES) | st.text(max_size=12)
PEERS = st.fixed_dictionaries(
    {"stage_id": st.sampled_from(["stage-0", "stage-2", ""]) | JSON_SCALARS,
     "stage_index": st.sampled_from([0, 2, 1, -1]) | JSON_SCALARS,
     "endpoint": st.sampled_from(["127.0.0.1:7000", "h:0", "[::1]:1", "nohost"]) | JSON_SCALARS},
    optional={"extra": JSON_SCALARS},
)


def plausible_values(name: str) -> st.SearchStrategy:
    """Values of the field's own type near its edges, so mutations often pass validation."""
    kind = str(StageConfig.__dataclass_fields__[name].type)
    choices = {"cache_type_k": CACHE_TYPES, "cache_type_v": CACHE_TYPES, "flash_attn_type": FLASH_ATTN_TYPES,
               "load_mode": LOAD_MODES, "split_mode": SPLIT_MODES, "wire_dtype": WIRE_DTYPES,
               "hop_transport": ("stream", "unary", "grpc")}
    if name in choices:
        return st.sampled_from(choices[name])
    if name in ("upstream", "downstream"):
        return PEERS | st.none()
    if kind.startswith("bool"):
        return st.booleans()
    if kind.startswith("int"):
        return st.sampled_from([0, 1, 2, 4, 8, 64, 512, 1024, 65535, 65536]) | st.integers(-2, 300)
    if kind.startswith("float"):
        return st.sampled_from([0.0, 0.001, 1.0, 30.0, 3600.0, 86400.0]) | st.integers(0, 90000) | st.floats(0, 1e6)
    return st.sampled_from(["x", "/tmp/x", "127.0.0.1:7000", "stage-1"]) | HOSTILE_TEXT


@st.composite
def config_dicts(draw: st.DrawFn) -> dict[str, object]:
    """A valid base config with a few fields replaced, removed or added — or anything at all."""
    if draw(rarely(6)):
        return draw(st.dictionaries(CONFIG_KEYS, JSON_VALUES, max_size=12))
    data = dict(BASE_CONFIG)
    if draw(rarely(6)):
        del data[draw(st.sampled_from(sorted(BASE_CONFIG)))]
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELD_NAMES))
        data[key] = draw(JSON_VALUES | PEERS if draw(rarely(3)) else plausible_values(key))
    if draw(rarely(10)):
        data[draw(st.text(max_size=12))] = draw(JSON_VALUES)
    return data


def check_from_dict(data: object) -> None:
    try:
        cfg = StageConfig.from_dict(data)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert str(exc)
        return
    # Accepted: every checked field has its type and range...
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for name in ("admission_wait_s", "downstream_ready_timeout_s"):
        value = getattr(cfg, name)
        assert number(value) and 0 < value <= 86400, name
    assert number(cfg.session_idle_ttl_s) and 0 <= cfg.session_idle_ttl_s <= 86400
    assert number(cfg.recovery_wait_s) and 0 <= cfg.recovery_wait_s <= 3600
    assert cfg.ctx_size is None or (isinstance(cfg.ctx_size, int) and not isinstance(cfg.ctx_size, bool)
                                    and cfg.ctx_size >= 1)
    for name in ("lane_count", "n_batch", "n_ubatch", "n_threads", "max_inflight"):
        value = getattr(cfg, name)
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, name
    for name in ("mlock", "direct_io", "repack", "check_tensors", "no_host_buffer", "kv_offload", "kv_unified",
                 "swa_full"):
        assert isinstance(getattr(cfg, name), bool), name
    for name in ("mmap", "op_offload"):
        assert getattr(cfg, name) is None or isinstance(getattr(cfg, name), bool), name
    # ...and it survives its own serialisation (what `up` writes and `serve` reads).
    again = StageConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(cfg.to_dict(), sort_keys=True)


def config_files() -> st.SearchStrategy[bytes]:
    return st.one_of(
        config_dicts().map(lambda d: json.dumps(d).encode()),
        st.dictionaries(CONFIG_KEYS, JSON_VALUES, max_size=6).map(lambda d: json.dumps(d).encode()),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.text(max_size=64).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.sampled_from([b"", b"{", b"\xef\xbb\xbf{}", b"null", b"[]", b'{"stage_id": NaN}', b"\x00" * 8]),
    )


def check_load_config(directory: Path) -> Callable[[bytes], None]:
    path = directory / f"hostile-{uuid.uuid4().hex}.json"

    def check(content: bytes) -> None:
        path.write_bytes(content)
        try:
            load_config(path)
        except ConfigError as exc:
            assert str(exc)
    return check


# -- requests -------------------------------------------------------------------------

BATCH_REQUESTS = weighted(
    (2, st.tuples(st.just(0), batch_specs(frame=False))),
    (3, st.tuples(st.sampled_from([1, 2]), batch_specs(frame=True))),
    (1, st.tuples(st.sampled_from(SHAPE_NAMES), batch_specs(frame=None))),
).map(lambda t: (t[0], build_batch(t[1], t[0]))) | st.tuples(
    st.sampled_from(SHAPE_NAMES), garbage_messages(pb.IterationBatchRequest))


def check_entries_from_request(case: tuple[int, pb.IterationBatchRequest]) -> None:
    index, request = case
    try:
        entries = runtime_entries(step_from_pb(request), SHAPES[index])
    except SkippyError:
        return
    assert len(entries) == len(request.entries)
    for entry, raw in zip(entries, request.entries):
        assert len(entry.positions) == len(raw.positions) > 0
        if entry.hidden is not None:
            assert entry.hidden.shape == (len(raw.positions), N_EMBD)


GENERATE_SPECS = weighted((4, generate_requests()), (1, garbage_messages(pb.GenerateRequest)))


def check_generate_spec(request: pb.GenerateRequest) -> None:
    try:
        spec = generate_spec_from_pb(request, max_tokens_limit=512)
    except InvalidRequestError:
        return
    assert isinstance(spec, GenerateSpec) and 1 <= spec.max_tokens <= 512
    assert spec.stream_interval_ms is None or 0 <= spec.stream_interval_ms <= 1000
    assert (spec.prompt is None) != (not spec.messages)


def pure_properties(tmp: Path) -> list[tuple[str, st.SearchStrategy, Callable[[object], None]]]:
    return [
        ("wire.decode raises only InvalidRequestError", decode_inputs(), check_decode),
        ("wire payload -> rows -> payload round-trips", round_trip_inputs(), check_round_trip),
        ("wire rows -> payload -> rows round-trips", encodable_rows(), check_rows_round_trip),
        ("wire.validate_descriptor raises only InvalidRequestError", descriptor_cases(), check_descriptor),
        ("codec.descriptor_from_pb is total; the check refuses what the wire cannot carry", PB_DESCRIPTORS, check_descriptor_from_pb),
        ("StageConfig.from_dict raises only ConfigError", config_dicts(), check_from_dict),
        ("load_config raises only ConfigError", config_files(), check_load_config(tmp)),
        ("codec.step_from_pb + steps.runtime_entries raise only SkippyError", BATCH_REQUESTS, check_entries_from_request),
        ("service.generate_spec_from_pb raises only InvalidRequestError", GENERATE_SPECS, check_generate_spec),
    ]


PURE_DEFAULT = {
    "wire.decode raises only InvalidRequestError": 200,
    "wire payload -> rows -> payload round-trips": 100,
    "wire rows -> payload -> rows round-trips": 100,
    "wire.validate_descriptor raises only InvalidRequestError": 200,
    "codec.descriptor_from_pb is total; the check refuses what the wire cannot carry": 100,
    "StageConfig.from_dict raises only ConfigError": 200,
    "load_config raises only ConfigError": 100,
    "codec.step_from_pb + steps.runtime_entries raise only SkippyError": 100,
    "service.generate_spec_from_pb raises only InvalidRequestError": 100,
}
PURE_SLOW = {
    "wire.decode raises only InvalidRequestError": 2000,
    "wire payload -> rows -> payload round-trips": 1000,
    "wire rows -> payload -> rows round-trips": 1000,
    "wire.validate_descriptor raises only InvalidRequestError": 2000,
    "codec.descriptor_from_pb is total; the check refuses what the wire cannot carry": 1000,
    "StageConfig.from_dict raises only ConfigError": 2000,
    "load_config raises only ConfigError": 1000,
    "codec.step_from_pb + steps.runtime_entries raise only SkippyError": 1500,
    "service.generate_spec_from_pb raises only InvalidRequestError": 1000,
}


# Hostile payloads (an int8 scale of inf, say) decode to inf or NaN with numpy's warning.
@pytest.mark.filterwarnings("ignore::RuntimeWarning:skippy_stage.stage.wire")
@pytest.mark.parametrize("name", list(PURE_DEFAULT))
def test_pure_property(name: str, tmp_path: Path) -> None:
    strategy, check = next((s, c) for n, s, c in pure_properties(tmp_path) if n == name)
    count = run_cases(strategy, check, PURE_DEFAULT[name])
    report(name, count)
    assert count > 0


# -- gaps the properties found, each with its minimal example ----------------------------------


def test_int8_keeps_float32_max_finite() -> None:
    # 127 * (absmax / 127 rounded to nearest) overflowed: the scale rounds toward zero instead.
    rows = np.array([[np.finfo(np.float32).max], [-np.finfo(np.float32).max]], dtype=np.float32)
    with np.errstate(over="raise"):
        back = wire.decode(wire.encode(rows, "int8"), "int8", 2, 1)
    assert np.isfinite(back).all(), back
    assert back[0, 0] > 0 > back[1, 0]


def test_deeply_nested_config_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError):
        load_config(path)


def test_a_config_number_too_long_to_parse_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "long-int.json"
    path.write_text('{"ctx_size": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError):
        load_config(path)


@pytest.mark.parametrize("key,value", [("session_idle_ttl_s", "soon"), ("admission_wait_s", -1.0),
                                       ("downstream_ready_timeout_s", math.nan)])
def test_a_nonsense_timeout_is_a_config_error(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        StageConfig.from_dict({**BASE_CONFIG, key: value})


# =====================================================================================
# Against a real pipeline
# =====================================================================================


def lane_kv_stats(status: pb.StageStatus) -> dict[str, object]:
    """What must be the same before and after the run.

    A lane used and dropped comes back warm ("idle") rather than "free", by design, so
    the split between the two is not compared, only that every lane is one of them.
    """
    return {
        "state": status.state, "lane_count": status.lane_count, "active_sessions": status.active_sessions,
        "unbound_lanes": status.idle_lanes + status.free_lanes + len(status.resident_prefixes),
        "max_session_tokens": status.max_session_tokens,
        "total_session_tokens": status.total_session_tokens, "kv_pool_tokens": status.kv_pool_tokens,
        "kv_cells_per_lane": status.kv_cells_per_lane, "discarded_lanes": status.discarded_lanes,
        "bound_rows": sorted(r.session_id for r in status.lanes if r.state == "active"),
    }


@dataclass
class Pipeline:
    procs: list
    stages: list[StageHandle]
    log_dir: Path
    baseline: list[dict[str, object]] = field(default_factory=list)

    def statuses(self) -> list[pb.StageStatus]:
        return [s.stub.GetStatus(pb.GetStatusRequest(), timeout=CALL_TIMEOUT_S) for s in self.stages]

    def assert_alive(self) -> None:
        for stage, proc in zip(self.stages, self.procs):
            assert proc.poll() is None, f"stage-{stage.index} exited with code {proc.returncode}"

    def assert_settled(self) -> None:
        """No stage holds a session or a KV cell (background frees get SETTLE_S)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.assert_alive()
            held = [(s.active_sessions, s.total_session_tokens, [r.session_id for r in s.lanes if r.state == "active"])
                    for s in self.statuses()]
            if all(a == 0 and t == 0 for a, t, _ in held):
                return
            if time.monotonic() > deadline:
                self.force_clean(held)
                raise AssertionError(f"sessions outlive the case (active, tokens, ids) per stage: {held}")
            time.sleep(0.05)

    def force_clean(self, held: list[tuple[int, int, list[str]]]) -> None:
        """Drop leaked sessions, so the next case (and hypothesis' shrinking) starts clean."""
        for stage, (_, _, ids) in zip(self.stages, held):
            for session_id in ids:
                try:
                    stage.stub.DropSession(pb.DropSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S)
                except grpc.RpcError:
                    pass

    def assert_serving_and_unchanged(self) -> None:
        self.assert_alive()
        for stage in self.stages:
            for service in ("", SERVICE):
                status = stage.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
                assert status.status == health_pb2.HealthCheckResponse.SERVING, (stage.index, service)
        self.assert_settled()
        after = [lane_kv_stats(s) for s in self.statuses()]
        assert after == self.baseline
        for stats in after:
            assert stats["active_sessions"] == 0 and stats["total_session_tokens"] == 0

    def log_problems(self) -> list[str]:
        """Lines in the stages' logs (stderr) that say a handler blew up."""
        logs = sorted(self.log_dir.glob("*.log"))
        assert len(logs) == len(self.stages) and all(p.stat().st_size for p in logs), "no stage logs to read"
        bad = ("Traceback", "Exception calling application", "Exception iterating responses", "Segmentation")
        return [f"{p.name}: {line.strip()[:300]}" for p in logs
                for line in p.read_text(errors="replace").splitlines() if any(b in line for b in bad)]


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline, tmp_path_factory) -> Iterator[Pipeline]:
    log_dir = tmp_path_factory.mktemp("hostile-logs")
    local = start_pipeline(smollm2, RANGES, log_dir=log_dir, n_threads=1, n_batch=N_BATCH, n_ubatch=N_BATCH,
                           lane_count=LANE_COUNT, max_message_bytes=MAX_MESSAGE_BYTES)
    stages = handles(local.configs, CALL_TIMEOUT_S)
    p = Pipeline(local.procs, stages, log_dir)
    p.baseline = [lane_kv_stats(s) for s in p.statuses()]
    assert all(b["active_sessions"] == 0 for b in p.baseline)
    yield p
    for stage in stages:
        stage.channel.close()


# -- operations ------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchOp:
    rpc: str  # IterationBatch | ActivationFrame
    stage: int
    spec: BatchSpec


@dataclass(frozen=True)
class DecodeOp:
    stage: int
    session_id: str
    position: int | str
    token_id: int
    sampling: pb.SamplingParams | None
    want_logits: bool


@dataclass(frozen=True)
class DropOp:
    stage: int
    session_id: str


@dataclass(frozen=True)
class GenerateOp:
    stage: int
    request: pb.GenerateRequest


@dataclass(frozen=True)
class StreamOp:
    stage: int
    hops: tuple[tuple[int, BatchSpec, float], ...]  # hop_id, request, timeout_s


@dataclass(frozen=True)
class RawOp:
    stage: int
    method: str
    base: BatchSpec | None  # serialised, then mutated; None: just the garbage bytes
    garbage: bytes
    flips: tuple[tuple[int, int], ...]


class Case:
    """Runs one case's calls, checks every status, and frees what the successful ones opened."""

    def __init__(self, pipeline: Pipeline, codes: Counter[str]) -> None:
        self.p = pipeline
        self.codes = codes  # status code name -> calls, over the whole property run
        self.opened: set[tuple[int, str]] = set()
        self.next_pos: dict[tuple[int, str], int] = {}

    # -- plumbing --

    def _status(self, code: grpc.StatusCode, details: str, what: str, also: frozenset = frozenset()) -> None:
        # An error message past gRPC's metadata limit arrives as RESOURCE_EXHAUSTED: allowed (it
        # is a status), counted apart, and pinned by test_an_error_echoing_a_huge_value_keeps_its_code.
        oversized = "metadata size exceeds hard limit" in details
        self.codes[f"{code.name} (error message too big)" if oversized else code.name] += 1
        assert code in ALLOWED | also, f"{what}: {code.name}: {details!r}"
        assert details != GRPC_DESERIALIZE_FAILURE, f"{what}: {code.name}: {details!r}"

    def unary(self, stage: int, method: str, request: object, what: str, *, call: Callable | None = None,
              also: frozenset = frozenset()) -> object | None:
        """One unary call; the response, or None when it was refused (with an allowed code)."""
        call = call or getattr(self.p.stages[stage].stub, method)
        try:
            response = call(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            self._status(err.code(), err.details() or "", what, also)
            return None
        finally:
            self.p.assert_alive()
        self._status(grpc.StatusCode.OK, "", what)
        return response

    def _opened(self, stage: int, session_id: str, next_position: int | None) -> None:
        """A call at ``stage`` succeeded: the session now lives there and on every stage below."""
        if not 1 <= len(session_id) <= MAX_SESSION_ID_LEN:
            return  # refused by every stage: it cannot have been opened
        self.opened.add((stage, session_id))
        if next_position is not None:
            for below in range(stage, len(RANGES)):
                self.next_pos[(below, session_id)] = next_position

    def _opened_batch(self, stage: int, request: pb.IterationBatchRequest) -> None:
        for e in request.entries:
            self._opened(stage, e.session_id, e.positions[-1] + 1 if len(e.positions) else None)

    def _build(self, spec: BatchSpec, stage: int) -> pb.IterationBatchRequest:
        return build_batch(spec, stage, lambda sid: self.next_pos.get((stage, sid), 0))

    def _generate(self, call: Iterator[object], what: str, also: frozenset = frozenset()) -> None:
        """Read up to three messages, then hang up (the stage must free the session)."""
        try:
            for received, _ in enumerate(call, start=1):
                if received >= 3:
                    call.cancel()  # type: ignore[attr-defined]
                    self.codes["OK (then cancelled by the test)"] += 1
                    return
        except grpc.RpcError as err:
            self._status(err.code(), err.details() or "", what, also)
            return
        finally:
            self.p.assert_alive()
        self._status(grpc.StatusCode.OK, "", what)

    # -- operations --

    def run(self, op: object) -> None:
        if isinstance(op, BatchOp):
            request = self._build(op.spec, op.stage)
            if self.unary(op.stage, op.rpc, request, f"{op.rpc} to stage-{op.stage}") is not None:
                self._opened_batch(op.stage, request)
        elif isinstance(op, DecodeOp):
            position = self.next_pos.get((op.stage, op.session_id), 0) if op.position == NEXT else op.position
            request = pb.DecodeRequest(session_id=op.session_id, position=position, token_id=op.token_id,
                                       want_logits=op.want_logits)
            if op.sampling is not None:
                request.sampling.CopyFrom(op.sampling)
            if self.unary(op.stage, "Decode", request, f"Decode to stage-{op.stage}") is not None:
                self._opened(op.stage, op.session_id, position + 1)
        elif isinstance(op, DropOp):
            request = pb.DropSessionRequest(session_id=op.session_id)
            if self.unary(op.stage, "DropSession", request, f"DropSession to stage-{op.stage}") is not None:
                for below in range(op.stage, len(RANGES)):
                    self.opened.discard((below, op.session_id))
                    self.next_pos.pop((below, op.session_id), None)
        elif isinstance(op, GenerateOp):
            call = self.p.stages[op.stage].stub.Generate(op.request, timeout=GENERATE_TIMEOUT_S)
            self._generate(call, f"Generate to stage-{op.stage}")
        elif isinstance(op, StreamOp):
            self.stream(op)
        elif isinstance(op, RawOp):
            self.raw(op)
        else:  # pragma: no cover
            raise AssertionError(op)

    def stream(self, op: StreamOp) -> None:
        # relay: the outputs come back on this stream, so every hop gets exactly one reply (its
        # outputs, or its error); frames from a real neighbour send them on to the head instead.
        hops = [pb.HopRequest(hop_id=hop_id, request=self._build(spec, op.stage), timeout_s=timeout, relay=True)
                for hop_id, spec, timeout in op.hops]
        what = f"ActivationStream to stage-{op.stage}"
        try:
            replies = list(self.p.stages[op.stage].stub.ActivationStream(iter(hops), timeout=GENERATE_TIMEOUT_S))
        except grpc.RpcError as err:
            self._status(err.code(), err.details() or "", what)
            # The stream as a whole failed (say, one hop past max_message_bytes): hops before
            # it may have been answered unseen, so free whatever they could have opened.
            for hop in hops:
                self._opened_batch(op.stage, hop.request)
            return
        finally:
            self.p.assert_alive()
        assert sorted(r.hop_id for r in replies) == sorted(h.hop_id for h in hops), f"{what}: a hop went unanswered"
        by_id: dict[int, list[pb.HopRequest]] = {}
        for hop in hops:
            by_id.setdefault(hop.hop_id, []).append(hop)
        for reply in replies:
            code = next((c for c in grpc.StatusCode if c.value[0] == reply.code), None)
            assert code is not None, f"{what}: hop {reply.hop_id}: unknown code {reply.code}"
            # A hop that declared its own deadline already gone may be told so by the stage below.
            expired = any(not (h.timeout_s == 0 or h.timeout_s >= HOP_EXPIRED_BELOW_S) for h in by_id[reply.hop_id])
            also = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED}) if expired else frozenset()
            self._status(code, reply.message, f"{what}: hop {reply.hop_id}", also)
            if code == grpc.StatusCode.OK:
                for hop in by_id[reply.hop_id]:
                    self._opened_batch(op.stage, hop.request)

    def raw(self, op: RawOp) -> None:
        data = bytearray(op.garbage)
        if op.base is not None:
            data = bytearray(self._build(op.base, op.stage).SerializeToString())
            for where, value in op.flips:
                if data:
                    data[where % len(data)] = value
        payload = bytes(data)
        channel = self.p.stages[op.stage].channel
        path = f"/{SERVICE}/{op.method}"
        what = f"{op.method} to stage-{op.stage} with raw bytes {payload[:48]!r}"
        if op.method == "Generate":
            self._generate(channel.unary_stream(path)(payload, timeout=GENERATE_TIMEOUT_S), what)
            return
        if self.unary(op.stage, op.method, payload, what, call=channel.unary_unary(path)) is None:
            return
        # Accepted: free what it opened.
        if op.method in ("IterationBatch", "ActivationFrame"):
            self._opened_batch(op.stage, pb.IterationBatchRequest.FromString(payload))
        elif op.method == "Decode":
            self._opened(op.stage, pb.DecodeRequest.FromString(payload).session_id, None)

    def cleanup(self) -> None:
        for stage, session_id in sorted(self.opened):
            try:
                self.p.stages[stage].stub.DropSession(pb.DropSessionRequest(session_id=session_id),
                                                      timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as err:
                # Gone already: a later call of the case failed and freed it, as it must.
                assert err.code() == grpc.StatusCode.NOT_FOUND, err


def rpc_check(pipeline: Pipeline, codes: Counter[str]) -> Callable[[tuple[object, ...]], None]:
    def check(ops: tuple[object, ...]) -> None:
        case = Case(pipeline, codes)
        try:
            for op in ops:
                case.run(op)
        finally:
            case.cleanup()
        pipeline.assert_settled()
    return check


def report_rpc(name: str, count: int, codes: Counter[str]) -> None:
    seen = ", ".join(f"{code} {n}" for code, n in codes.most_common())
    print(f"\nhostile cases: {name}: {count} ({sum(codes.values())} calls: {seen})")


# -- operation strategies ----------------------------------------------------------------

STAGES = st.sampled_from([0, 1, 2])
TIMEOUTS = st.sampled_from([0.0, 0.0, 5.0, 30.0, math.inf, 1e300, math.nan, -1.0, 1e-9, 0.001])


def batch_ops(rpc: str) -> st.SearchStrategy[BatchOp]:
    head = st.builds(BatchOp, st.just(rpc), st.just(0), batch_specs(frame=False))
    below = st.builds(BatchOp, st.just(rpc), st.sampled_from([1, 2]), batch_specs(frame=True))
    anywhere = st.builds(BatchOp, st.just(rpc), STAGES, batch_specs(frame=None))
    return weighted((3, head), (1, anywhere)) if rpc == "IterationBatch" else weighted((3, below), (1, anywhere))


DECODE_OPS = st.builds(
    DecodeOp, stage=st.sampled_from([0, 0, 0, 1, 2]), session_id=SESSION_IDS,
    position=st.sampled_from([0, NEXT, NEXT]) | INT32, token_id=st.sampled_from(VALID_TOKENS) | INT32,
    sampling=st.none() | sampling_params(), want_logits=st.booleans(),
)
DROP_OPS = st.builds(DropOp, stage=STAGES, session_id=SESSION_IDS)
GENERATE_OPS = st.builds(GenerateOp, stage=st.sampled_from([0] * 8 + [1, 2]), request=generate_requests())
STREAM_OPS = st.builds(
    StreamOp, stage=st.sampled_from([1, 1, 2, 2, 0]),
    hops=st.lists(st.tuples(st.sampled_from([1, 2, 3, 0, UINT64_MAX]), batch_specs(frame=True), TIMEOUTS),
                  min_size=1, max_size=3).map(tuple),
)
RAW_METHODS = ("IterationBatch", "ActivationFrame", "Decode", "DropSession", "GetStatus", "Generate")
RAW_OPS = st.builds(
    RawOp, stage=STAGES, method=st.sampled_from(RAW_METHODS), base=st.none() | batch_specs(frame=None),
    garbage=st.binary(max_size=64) | st.sampled_from([b"\x12\x03\x0a\x01\xff", b"\xff", b"\x0a\x80"]),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4).map(tuple),
)
# An opened session met again by the next call: open "a".."c" validly at the head, then the op.
OPEN_POOL = st.builds(
    BatchOp, st.just("IterationBatch"), st.just(0),
    st.builds(BatchSpec, st.lists(st.builds(EntrySpec, st.sampled_from(SESSION_POOL), st.just(0),
                                            st.integers(1, 6)), min_size=1, max_size=3,
                                  unique_by=lambda e: e.session_id).map(tuple)),
)


def cases(op: st.SearchStrategy) -> st.SearchStrategy[tuple[object, ...]]:
    """One to three calls, mostly after a valid call that opened sessions of the pool."""
    opener = weighted((3, st.tuples(OPEN_POOL)), (1, st.just(())))
    return st.tuples(opener, st.lists(op, min_size=1, max_size=3)).map(lambda t: tuple(t[0]) + tuple(t[1]))


RPC_PROPERTIES: dict[str, st.SearchStrategy] = {
    "IterationBatch": cases(batch_ops("IterationBatch")),
    "ActivationFrame": cases(batch_ops("ActivationFrame")),
    "ActivationStream": cases(STREAM_OPS),
    "Decode": cases(DECODE_OPS),
    "DropSession": cases(weighted((2, DROP_OPS), (1, batch_ops("IterationBatch")), (1, batch_ops("ActivationFrame")))),
    "Generate": cases(GENERATE_OPS),
    "raw bytes": cases(RAW_OPS),
}
# 150 cases in all by default.
RPC_DEFAULT = {"IterationBatch": 35, "ActivationFrame": 30, "ActivationStream": 15, "Decode": 15, "DropSession": 15,
               "Generate": 25, "raw bytes": 15}
RPC_SLOW = {"IterationBatch": 300, "ActivationFrame": 300, "ActivationStream": 150, "Decode": 150,
            "DropSession": 150, "Generate": 150, "raw bytes": 150}


@pytest.mark.parametrize("rpc", list(RPC_DEFAULT))
def test_hostile_requests_get_a_status_in_time_and_leave_nothing_behind(pipeline: Pipeline, rpc: str) -> None:
    codes: Counter[str] = Counter()
    count = run_cases(RPC_PROPERTIES[rpc], rpc_check(pipeline, codes), RPC_DEFAULT[rpc])
    report_rpc(rpc, count, codes)
    assert count > 0


def test_after_the_hostile_run_every_stage_is_serving_with_lanes_and_kv_unchanged(pipeline: Pipeline) -> None:
    pipeline.assert_serving_and_unchanged()
    assert pipeline.log_problems() == []


# IterationBatchRequest{entries: [{session_id: b"\xff"}]}: invalid UTF-8 in a string field; and a
# field key with no value after it (any message).
@pytest.mark.parametrize("stage,rpc,message,data", [
    (0, "IterationBatch", "IterationBatchRequest", b"\x12\x03\x0a\x01\xff"),
    (2, "ActivationFrame", "IterationBatchRequest", b"\x12\x03\x0a\x01\xff"),
    (1, "DropSession", "DropSessionRequest", b"\x0a"),
    (0, "Generate", "GenerateRequest", b"\x0a\x05ab"),
])
def test_undecodable_request_is_invalid_argument(pipeline: Pipeline, stage: int, rpc: str, message: str,
                                                 data: bytes) -> None:
    channel = pipeline.stages[stage].channel
    with pytest.raises(grpc.RpcError) as caught:
        if rpc == "Generate":
            list(channel.unary_stream(f"/{SERVICE}/{rpc}")(data, timeout=CALL_TIMEOUT_S))
        else:
            channel.unary_unary(f"/{SERVICE}/{rpc}")(data, timeout=CALL_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details().startswith(f"undecodable {message}: "), caught.value.details()


@pytest.mark.parametrize("stage,rpc", [(0, "DropSession"), (2, "DropSession"), (0, "IterationBatch")])
def test_an_error_echoing_a_huge_value_keeps_its_code(pipeline: Pipeline, stage: int, rpc: str) -> None:
    session_id = "é" * 3000  # 6000 bytes of UTF-8, 18000 once percent-encoded into grpc-message
    if rpc == "DropSession":
        request: object = pb.DropSessionRequest(session_id=session_id)
        expected = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}
    else:
        request = pb.IterationBatchRequest(entries=[pb.BatchEntry(session_id=session_id, positions=[0],
                                                                  token_ids=[1])])
        expected = {grpc.StatusCode.INVALID_ARGUMENT}
    with pytest.raises(grpc.RpcError) as caught:
        getattr(pipeline.stages[stage].stub, rpc)(request, timeout=CALL_TIMEOUT_S)
    assert caught.value.code() in expected, caught.value.details()


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.filterwarnings("ignore::RuntimeWarning:skippy_stage.stage.wire")
def test_slow_ten_thousand_hostile_cases(pipeline: Pipeline, tmp_path: Path) -> None:
    started = time.monotonic()
    counts: dict[str, int] = {}
    for name, strategy, check in pure_properties(tmp_path):
        counts[name] = run_cases(strategy, check, PURE_SLOW[name])
        report(name, counts[name])
    for rpc, strategy in RPC_PROPERTIES.items():
        codes: Counter[str] = Counter()
        counts[rpc] = run_cases(strategy, rpc_check(pipeline, codes), RPC_SLOW[rpc])
        report_rpc(rpc, counts[rpc], codes)
    pipeline.assert_serving_and_unchanged()
    assert pipeline.log_problems() == []
    total = sum(counts.values())
    print(f"\nhostile cases in all: {total} in {time.monotonic() - started:.0f}s")
    assert total >= 10_000
