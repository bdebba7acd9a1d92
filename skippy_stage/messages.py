"""Protobuf messages <-> domain objects, with one validating function per message.

Client input is checked here field by field and refused with InvalidRequestError naming
the field and the value; deeper checks that need the loaded model (vocabulary size,
positions against lane state) happen in the runtime, still before llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from skippy_stage import wire
from skippy_stage.errors import InvalidRequestError, RuntimeFailure
from skippy_stage.runtime import BatchEntry, EntryResult
from skippy_stage.sampling import RANDOM_SEED, SamplingParams
from skippy_stage.v1 import stage_pb2 as pb

DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16, "int8": pb.DTYPE_INT8}
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


def sampling_from_pb(msg: pb.SamplingParams | None, where: str = "sampling") -> SamplingParams:
    if msg is None:
        return SamplingParams()
    params = SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        min_p=float(msg.min_p),
        repeat_penalty=float(msg.repeat_penalty) if msg.HasField("repeat_penalty") else 1.0,
        repeat_last_n=int(msg.repeat_last_n) if msg.HasField("repeat_last_n") else 64,
        seed=int(msg.seed) if msg.HasField("seed") else RANDOM_SEED,
    )
    try:
        return params.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc).replace("sampling.", f"{where}.", 1)) from None


def sampling_to_pb(params: SamplingParams | None) -> pb.SamplingParams:
    p = params or SamplingParams()
    msg = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p)
    msg.top_p = p.top_p
    msg.repeat_penalty = p.repeat_penalty
    msg.repeat_last_n = p.repeat_last_n
    if p.seed != RANDOM_SEED:
        msg.seed = p.seed
    return msg


def descriptor_from_pb(msg: pb.FrameDescriptor) -> wire.FrameDescriptor:
    dtype = PB_TO_DTYPE.get(msg.dtype)
    if dtype is None:
        raise InvalidRequestError(f"frame.descriptor.dtype={pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype} is not a wire dtype")
    if msg.layout != pb.LAYOUT_TOKEN_MAJOR:
        raise InvalidRequestError(f"frame.descriptor.layout={msg.layout} is not LAYOUT_TOKEN_MAJOR")
    return wire.FrameDescriptor(
        version=msg.version, dtype=dtype, layout=wire.LAYOUT_TOKEN_MAJOR,
        producer_stage_index=msg.producer_stage_index, layer_start=msg.layer_start, layer_end=msg.layer_end,
        token_count=msg.token_count, sequence_count=msg.sequence_count, payload_bytes=msg.payload_bytes,
        flags=msg.flags, width=msg.width,
    )


def descriptor_to_pb(desc: wire.FrameDescriptor) -> pb.FrameDescriptor:
    return pb.FrameDescriptor(
        version=desc.version, dtype=DTYPE_TO_PB[desc.dtype], layout=pb.LAYOUT_TOKEN_MAJOR,
        producer_stage_index=desc.producer_stage_index, layer_start=desc.layer_start, layer_end=desc.layer_end,
        token_count=desc.token_count, sequence_count=desc.sequence_count, payload_bytes=desc.payload_bytes,
        flags=desc.flags, width=desc.width,
    )


@dataclass(frozen=True)
class StageShape:
    """What a stage checks an incoming request against."""

    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    n_embd: int
    include_embeddings: bool
    include_output: bool
    wire_dtype: str


def entries_from_request(req: pb.IterationBatchRequest, shape: StageShape) -> list[BatchEntry]:
    """Turn a batch request (and its frame, below stage 0) into runtime entries."""
    if not req.entries:
        raise InvalidRequestError("entries is empty: a batch needs at least one entry")
    has_frame = req.HasField("frame")
    if shape.include_embeddings and has_frame:
        raise InvalidRequestError(f"frame is not accepted at stage {shape.stage_id}: it takes token_ids (layer_start=0)")
    if not shape.include_embeddings and not has_frame:
        raise InvalidRequestError(f"frame is required at stage {shape.stage_id} (layer_start={shape.layer_start})")
    rows_per_entry = [len(e.positions) for e in req.entries]
    hidden: np.ndarray | None = None
    if has_frame:
        desc = descriptor_from_pb(req.frame.descriptor)
        wire.validate_descriptor(
            desc, payload_len=len(req.frame.payload), expected_layer_start=shape.layer_start,
            expected_width=shape.n_embd, accepted_dtypes=wire.DTYPES, entry_rows=sum(rows_per_entry),
            entry_count=len(req.entries),
        )
        hidden = wire.decode(req.frame.payload, desc.dtype, desc.token_count, desc.width)
    entries: list[BatchEntry] = []
    offset = 0
    for i, e in enumerate(req.entries):
        n = rows_per_entry[i]
        if n == 0:
            raise InvalidRequestError(f"entries[{i}].positions is empty")
        token_ids = np.asarray(e.token_ids, dtype=np.int64) if len(e.token_ids) else None
        if token_ids is not None and token_ids.shape[0] != n:
            raise InvalidRequestError(f"entries[{i}].token_ids has {token_ids.shape[0]} values for {n} positions")
        rows = None if hidden is None else hidden[offset : offset + n]
        offset += n
        # Sampling is checked at every stage (a bad value is refused before any compute)
        # but acted on only at the final stage; the flags ride along to it.
        sampling = sampling_from_pb(e.sampling, f"entries[{i}].sampling") if e.sample_last else None
        entries.append(BatchEntry(
            session_id=e.session_id,
            positions=np.asarray(e.positions, dtype=np.int64),
            token_ids=token_ids,
            hidden=rows,
            want_logits=e.want_logits and shape.include_output,
            sample=e.sample_last and shape.include_output,
            sampling=sampling,
        ))
    return entries


def forward_request(
    req: pb.IterationBatchRequest, results: Sequence[EntryResult], shape: StageShape
) -> pb.IterationBatchRequest:
    """The request this stage sends downstream: same entries, its own output frame."""
    rows = np.concatenate([r.hidden for r in results]) if len(results) > 1 else results[0].hidden
    desc = wire.make_descriptor(
        dtype=shape.wire_dtype, producer_stage_index=shape.stage_index, layer_start=shape.layer_start,
        layer_end=shape.layer_end, token_count=int(rows.shape[0]), sequence_count=len(results), width=shape.n_embd,
    )
    try:
        payload = wire.encode(rows, shape.wire_dtype)
    except ValueError as exc:  # values the configured codec cannot carry (f16 range, int8 NaN)
        raise RuntimeFailure(f"stage {shape.stage_id}: wire_dtype={shape.wire_dtype} cannot encode this "
                             f"batch's hidden states: {exc}") from exc
    return pb.IterationBatchRequest(
        request_id=req.request_id,
        entries=req.entries,
        frame=pb.ActivationFrame(descriptor=descriptor_to_pb(desc), payload=payload),
        return_key=req.return_key,
    )


def response_from_results(results: Sequence[EntryResult], stage_id: str) -> pb.IterationBatchResponse:
    outputs = []
    for r in results:
        out = pb.EntryOutput(session_id=r.session_id)
        if r.token is not None:
            out.has_token = True
            out.token = r.token
        if r.logits is not None:
            out.logits.extend(r.logits.tolist())
        outputs.append(out)
    return pb.IterationBatchResponse(outputs=outputs, final_stage_id=stage_id)


@dataclass(frozen=True)
class GenerateSpec:
    """A validated Generate request."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]


def generate_spec_from_pb(req: pb.GenerateRequest, *, max_tokens_limit: int, limit_hint: str = "") -> GenerateSpec:
    if bool(req.prompt) == bool(req.messages):
        raise InvalidRequestError("exactly one of prompt and messages must be set "
                                  f"(prompt has {len(req.prompt)} characters, messages has {len(req.messages)} items)")
    max_tokens = req.max_tokens or 128
    if max_tokens > max_tokens_limit:
        raise InvalidRequestError(f"max_tokens={max_tokens} exceeds this pipeline's limit {max_tokens_limit}"
                                  + (f" ({limit_hint})" if limit_hint else ""))
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(req.stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(req.stop):
        if not s or len(s) > MAX_STOP_LEN:
            raise InvalidRequestError(f"stop[{i}]={s!r} must be 1..{MAX_STOP_LEN} characters")
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"messages[{i}].role={m.role!r} must be system, user, assistant or tool")
    return GenerateSpec(
        prompt=req.prompt or None,
        messages=tuple((m.role, m.content) for m in req.messages),
        max_tokens=max_tokens,
        sampling=sampling_from_pb(req.sampling if req.HasField("sampling") else None),
        stop=tuple(req.stop),
    )
