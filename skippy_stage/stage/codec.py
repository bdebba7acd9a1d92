"""Protobuf <-> domain, at the edge: the gRPC service, the frame listener, the transports.

Conversions from protobuf are total (any message parses to a domain value); what a client
can get wrong is refused by the domain checks (``steps.runtime_entries``,
``SamplingParams.validate``, ``wire.validate_descriptor``) with the field and the value.
(A Generate request is the head's business: ``server.service`` checks it as it reads it.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from skippy_stage.config import MAX_LANES, MAX_SESSION_ID_LEN
from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.lanes import LaneRow, LaneStats, ResidentRow
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.runtime import KvPage, KvPageDesc, TokenLogprob
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams
from skippy_stage.stage import wire
from skippy_stage.stage.reports import StageDrop, StageReport, StageTrim
from skippy_stage.stage.steps import (
    PHASE_DECODE,
    PHASE_PREFILL,
    Activations,
    Frame,
    Output,
    Outputs,
    Reply,
    Step,
    StepEntry,
)
from skippy_stage.v1 import stage_pb2 as pb

DTYPE_TO_PB = {"f32": pb.DTYPE_F32, "f16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16, "int8": pb.DTYPE_INT8}
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}
_PHASE_TO_PB = {PHASE_DECODE: pb.PHASE_DECODE, PHASE_PREFILL: pb.PHASE_PREFILL}
_PB_TO_PHASE = {v: k for k, v in _PHASE_TO_PB.items()}
_CODE_VALUE = {code.name: code.value[0] for code in grpc.StatusCode}
_CODE_NAME = {value: name for name, value in _CODE_VALUE.items()}


def _list(values) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


# -- sampling ------------------------------------------------------------------------

def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        min_p=float(msg.min_p),
        repeat_penalty=float(msg.repeat_penalty) if msg.HasField("repeat_penalty") else 1.0,
        repeat_last_n=int(msg.repeat_last_n) if msg.HasField("repeat_last_n") else 64,
        seed=int(msg.seed) if msg.HasField("seed") else RANDOM_SEED,
        grammar=msg.grammar,
        grammar_start=int(msg.grammar_start),
        frequency_penalty=float(msg.frequency_penalty),
        presence_penalty=float(msg.presence_penalty),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
    )


# Parsed sampling messages by their bytes: a session sends the same settings with every token,
# to every stage, and parsing them costs a dozen field reads each time. Bounded in entries and
# in size (a large message — a grammar, a long logit_bias — is parsed every time: a peer could
# send many); a miss parses.
_SAMPLING_SEEN: dict[bytes, SamplingParams] = {}
_SAMPLING_SEEN_MAX = 512
_SAMPLING_SEEN_BYTES = 512


def _sampling_of(msg: pb.SamplingParams) -> SamplingParams:
    key = msg.SerializeToString()
    if len(key) > _SAMPLING_SEEN_BYTES:
        return sampling_from_pb(msg)
    params = _SAMPLING_SEEN.get(key)
    if params is None:
        params = sampling_from_pb(msg)
        if len(_SAMPLING_SEEN) >= _SAMPLING_SEEN_MAX:
            _SAMPLING_SEEN.clear()
        _SAMPLING_SEEN[key] = params
    return params


# The reverse, for the head: a session's SamplingParams object goes out with every token.
# Keyed by id, the object kept beside its message so a reused id cannot match; bounded as above.
_SAMPLING_SENT: dict[int, tuple[SamplingParams, pb.SamplingParams]] = {}


def _sampling_msg(params: SamplingParams) -> pb.SamplingParams:
    seen = _SAMPLING_SENT.get(id(params))
    if seen is not None and seen[0] is params:
        return seen[1]
    msg = sampling_to_pb(params)
    if msg.ByteSize() > _SAMPLING_SEEN_BYTES:
        return msg
    if len(_SAMPLING_SENT) >= _SAMPLING_SEEN_MAX:
        _SAMPLING_SENT.clear()
    _SAMPLING_SENT[id(params)] = (params, msg)
    return msg


def sampling_to_pb(params: SamplingParams | None) -> pb.SamplingParams:
    p = params or SamplingParams()
    msg = pb.SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p,
                            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty)
    msg.top_p = p.top_p
    msg.repeat_penalty = p.repeat_penalty
    msg.repeat_last_n = p.repeat_last_n
    if p.seed != RANDOM_SEED:
        msg.seed = p.seed
    if p.grammar:
        msg.grammar, msg.grammar_start = p.grammar, p.grammar_start
    for token, bias in p.logit_bias:
        msg.logit_bias[token] = bias
    return msg


# -- a step --------------------------------------------------------------------------

def descriptor_from_pb(msg: pb.FrameDescriptor) -> wire.FrameDescriptor:
    """An unknown dtype or layout keeps its protobuf name, for the check to refuse by name."""
    dtype = PB_TO_DTYPE.get(msg.dtype)
    if dtype is None:
        dtype = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
    layout = wire.LAYOUT_TOKEN_MAJOR if msg.layout == pb.LAYOUT_TOKEN_MAJOR else (
        pb.Layout.Name(msg.layout) if msg.layout in pb.Layout.values() else str(msg.layout))
    return wire.FrameDescriptor(
        version=msg.version, dtype=dtype, layout=layout,
        producer_stage_index=msg.producer_stage_index, layer_start=msg.layer_start, layer_end=msg.layer_end,
        token_count=msg.token_count, sequence_count=msg.sequence_count, payload_bytes=msg.payload_bytes,
        flags=msg.flags, width=msg.width,
    )


def descriptor_to_pb(desc: wire.FrameDescriptor) -> pb.FrameDescriptor:
    return _write_descriptor(desc, pb.FrameDescriptor())


def _write_descriptor(d: wire.FrameDescriptor, into: pb.FrameDescriptor) -> pb.FrameDescriptor:
    into.version, into.dtype, into.layout = d.version, DTYPE_TO_PB[d.dtype], pb.LAYOUT_TOKEN_MAJOR
    into.producer_stage_index, into.layer_start, into.layer_end = d.producer_stage_index, d.layer_start, d.layer_end
    into.token_count, into.sequence_count, into.payload_bytes = d.token_count, d.sequence_count, d.payload_bytes
    into.flags, into.width = d.flags, d.width
    return into


def entry_from_pb(e: pb.BatchEntry) -> StepEntry:
    # Positional, in StepEntry's field order: keywords cost a dict per entry per frame, and this
    # runs for every entry at every stage, on caches the last decode has just emptied.
    sample_last = e.sample_last
    return StepEntry(
        e.session_id,
        # Tuples: the checks turn them into arrays once (np.array here would cost as much again).
        tuple(e.positions),
        tuple(e.token_ids) if len(e.token_ids) else None,
        _PB_TO_PHASE.get(e.phase, ""),
        sample_last,
        e.want_logits,
        # Acted on by the final stage only, and checked only where it will be.
        _sampling_of(e.sampling) if sample_last and e.HasField("sampling") else None,
        e.prefix_id or None,
        e.rewind,
        e.verify,
        e.all_rows,
        e.top_logprobs if e.HasField("top_logprobs") else None,
        e.fork_of or None,
        e.prompt_logprobs if e.HasField("prompt_logprobs") else None,
        e.next_token if e.HasField("next_token") else None,
        e.draws_before,
        e.digest_logits,
        e.continues,
        ImageGrid(e.image.width, e.image.height, e.image.first_row) if e.HasField("image") else None,
    )


def entry_to_pb(e: StepEntry) -> pb.BatchEntry:
    msg = pb.BatchEntry(session_id=e.session_id, phase=_PHASE_TO_PB.get(e.phase, pb.PHASE_UNSPECIFIED),
                        positions=_list(e.positions), sample_last=e.sample_last, want_logits=e.want_logits)
    if e.token_ids is not None:
        msg.token_ids.extend(_list(e.token_ids))
    if e.sampling is not None:
        msg.sampling.CopyFrom(_sampling_msg(e.sampling))
    if e.prefix_id is not None:
        msg.prefix_id = e.prefix_id
    msg.rewind, msg.verify, msg.all_rows = e.rewind, e.verify, e.all_rows
    if e.top_logprobs is not None:
        msg.top_logprobs = e.top_logprobs
    if e.fork_of is not None:
        msg.fork_of = e.fork_of
    if e.prompt_logprobs is not None:
        msg.prompt_logprobs = e.prompt_logprobs
    if e.next_token is not None:
        msg.next_token = e.next_token
    msg.draws_before = e.draws_before
    if e.digest_logits:
        msg.digest_logits = True
    if e.continues:
        msg.continues = True
    if e.image is not None:
        msg.image.width, msg.image.height, msg.image.first_row = e.image.width, e.image.height, e.image.first_row
    return msg


def step_from_pb(msg: pb.IterationBatchRequest) -> Step:
    frame = None
    if msg.HasField("frame"):
        frame = Activations(descriptor_from_pb(msg.frame.descriptor), msg.frame.payload)
    return Step(request_id=msg.request_id, entries=[entry_from_pb(e) for e in msg.entries], frame=frame,
                return_key=msg.return_key, wire_entries=msg.entries)


def step_to_pb(step: Step) -> pb.IterationBatchRequest:
    return _fill_step(pb.IterationBatchRequest(), step)


def _fill_step(msg: pb.IterationBatchRequest, step: Step) -> pb.IterationBatchRequest:
    """Written in place: a message handed to a constructor is copied, payload and all."""
    msg.request_id = step.request_id
    msg.entries.extend(step.wire_entries if step.wire_entries is not None else [entry_to_pb(e) for e in step.entries])
    msg.return_key = step.return_key
    if step.frame is not None:
        _write_descriptor(step.frame.descriptor, msg.frame.descriptor)
        msg.frame.payload = step.frame.payload
    return msg


def outputs_from_pb(msg: pb.IterationBatchResponse) -> Outputs:
    return Outputs([Output(o.session_id, o.token if o.has_token else None,
                           np.array(o.logits, dtype=np.float32) if len(o.logits) else None,
                           tuple(o.tokens) if len(o.tokens) else None,
                           _logprobs_from_pb(o.logprobs), _logprobs_from_pb(o.prompt_logprobs),
                           tuple(o.logit_digests) if len(o.logit_digests) else None,
                           o.draft if o.HasField("draft") else None)
                    for o in msg.outputs],
                   msg.final_stage_id, wire=msg)


def _logprobs_from_pb(items) -> tuple[TokenLogprob, ...] | None:
    if not len(items):
        return None
    return tuple(TokenLogprob(lp.token, lp.logprob, tuple(zip(lp.top_tokens, lp.top_logprobs))) for lp in items)


def logprobs_to_pb(items: tuple[TokenLogprob, ...] | None, into) -> None:
    for lp in items or ():
        into.add(token=lp.token, logprob=lp.logprob, top_tokens=[t for t, _ in lp.top],
                 top_logprobs=[v for _, v in lp.top])


def outputs_to_pb(outputs: Outputs, into: pb.IterationBatchResponse | None = None) -> pb.IterationBatchResponse:
    """``into``: the message to write them in (a message handed to a constructor is copied)."""
    if outputs.wire is not None:
        # read from the wire and unchanged: no second encoding of the logits
        if into is None:
            return outputs.wire
        into.CopyFrom(outputs.wire)
        return into
    msg = pb.IterationBatchResponse() if into is None else into
    for o in outputs.outputs:
        out = msg.outputs.add(session_id=o.session_id)
        if o.token is not None:
            out.has_token = True
            out.token = o.token
        if o.logits is not None:
            out.logits.extend(o.logits.tolist())
        if o.tokens is not None:
            out.tokens.extend(o.tokens)
        logprobs_to_pb(o.logprobs, out.logprobs)
        logprobs_to_pb(o.prompt_logprobs, out.prompt_logprobs)
        if o.logit_digests is not None:
            out.logit_digests.extend(o.logit_digests)
        if o.draft is not None:
            out.draft = o.draft
    msg.final_stage_id = outputs.final_stage_id
    return msg


# -- an edge -------------------------------------------------------------------------

def frame_from_pb(msg: pb.HopRequest) -> Frame:
    return Frame(step=step_from_pb(msg.request), hop_id=msg.hop_id, timeout_s=msg.timeout_s, relay=msg.relay,
                 sent_unix_ns=msg.sent_unix_ns)


@dataclass(frozen=True)
class Released:
    """What a release message names (``HopRequest`` without a request): sessions to drop, sessions
    that moved above the edge, and sessions to end but keep as resident prefixes."""

    dropped: list[str]
    moved: list[str]
    retired: list[str]


def released_from_pb(msg: pb.HopRequest) -> Released | None:
    """The sessions a release message names (``drop_session_ids``, ``moved_session_ids``,
    ``retire_session_ids``); None for a frame. InvalidRequestError for one that also carries a
    request, or names more sessions than a stage has lanes or ids no lane could hold."""
    if not msg.drop_session_ids and not msg.moved_session_ids and not msg.retire_session_ids:
        return None
    released = Released(list(msg.drop_session_ids), list(msg.moved_session_ids), list(msg.retire_session_ids))
    if msg.HasField("request"):
        raise InvalidRequestError("a HopRequest with drop_session_ids, moved_session_ids or retire_session_ids "
                                  "carries no request (releases travel alone)")
    for name, ids in (("drop_session_ids", released.dropped), ("moved_session_ids", released.moved),
                      ("retire_session_ids", released.retired)):
        if len(ids) > MAX_LANES:
            raise InvalidRequestError(f"{name} names {len(ids)} sessions; a stage has at most {MAX_LANES}")
        for i, session_id in enumerate(ids):
            if not session_id or len(session_id) > MAX_SESSION_ID_LEN:
                raise InvalidRequestError(f"{name}[{i}] must be 1..{MAX_SESSION_ID_LEN} characters, "
                                          f"got {len(session_id)}")
    return released


def frame_to_pb(frame: Frame) -> pb.HopRequest:
    msg = pb.HopRequest(hop_id=frame.hop_id, timeout_s=frame.timeout_s, relay=frame.relay,
                        sent_unix_ns=frame.sent_unix_ns)
    _fill_step(msg.request, frame.step)
    return msg


def reply_from_pb(msg: pb.HopReply) -> Reply:
    return Reply(hop_id=msg.hop_id, return_key=msg.return_key,
                 outputs=outputs_from_pb(msg.response) if msg.code == 0 else None,
                 code=_CODE_NAME.get(msg.code, "UNKNOWN"), message=msg.message, failed_stage=msg.failed_stage,
                 session_ids=tuple(msg.session_ids))


def reply_to_pb(reply: Reply) -> pb.HopReply:
    msg = pb.HopReply(hop_id=reply.hop_id, return_key=reply.return_key, code=_CODE_VALUE.get(reply.code, 2),
                      message=reply.message, failed_stage=reply.failed_stage, session_ids=list(reply.session_ids))
    if reply.outputs is not None:
        outputs_to_pb(reply.outputs, msg.response)
    return msg


def returned_to_pb(key: str, outputs: Outputs) -> pb.ReturnedBatch:
    msg = pb.ReturnedBatch(return_key=key)
    outputs_to_pb(outputs, msg.response)
    return msg


# -- reports -------------------------------------------------------------------------

def report_to_pb(r: StageReport) -> pb.StageStatus:
    msg = pb.StageStatus(
        stage_id=r.stage_id, stage_index=r.stage_index, run_id=r.run_id, topology_id=r.topology_id,
        model_id=r.model_id, architecture=r.architecture, layer_start=r.layer_start, layer_end=r.layer_end,
        include_embeddings=r.include_embeddings, include_output=r.include_output, state=r.state,
        wire_dtype=r.wire_dtype, downstream_ok=r.downstream_ok, downstream_error=r.downstream_error,
        hop_transport=r.hop_transport, frame_port=r.frame_port, tls=r.tls,
        downstream_stage_id=r.downstream_stage_id, downstream_endpoint=r.downstream_endpoint, n_embd=r.n_embd,
        downstream_rtt_us=r.downstream_rtt_us, downstream_rtt_samples=r.downstream_rtt_samples,
        return_rtt_us=r.return_rtt_us, return_rtt_samples=r.return_rtt_samples,
    )
    s = r.lanes
    if s is not None:
        msg.lane_count, msg.active_sessions, msg.idle_lanes = s.lane_count, s.active_sessions, s.idle_lanes
        msg.free_lanes, msg.max_session_tokens = s.free_lanes, s.max_session_tokens
        msg.total_session_tokens, msg.kv_pool_tokens = s.total_session_tokens, s.kv_pool_tokens
        msg.kv_cells_per_lane, msg.discarded_lanes = s.kv_cells_per_lane, s.discarded_lanes
        msg.lanes.extend(pb.LaneRow(lane=row.lane, state=row.state, session_id=row.session_id or "",
                                    tokens=row.n_tokens) for row in s.lanes)
        msg.resident_prefixes.extend(pb.ResidentPrefix(prefix_id=r.prefix_id, lane=r.lane, tokens=r.n_tokens,
                                                       age_s=r.age_s) for r in s.resident)
    return msg


def report_from_pb(m: pb.StageStatus) -> StageReport:
    lanes = None
    if m.n_embd:  # loaded: its lane figures mean something
        lanes = LaneStats(
            lane_count=m.lane_count, active_sessions=m.active_sessions, idle_lanes=m.idle_lanes,
            free_lanes=m.free_lanes, max_session_tokens=m.max_session_tokens,
            total_session_tokens=m.total_session_tokens, kv_pool_tokens=m.kv_pool_tokens,
            kv_cells_per_lane=m.kv_cells_per_lane, discarded_lanes=m.discarded_lanes,
            lanes=tuple(LaneRow(row.lane, row.state, row.session_id or None, row.tokens) for row in m.lanes),
            resident=tuple(ResidentRow(r.prefix_id, r.lane, r.tokens, r.age_s) for r in m.resident_prefixes),
        )
    return StageReport(
        stage_id=m.stage_id, stage_index=m.stage_index, run_id=m.run_id, topology_id=m.topology_id,
        model_id=m.model_id, architecture=m.architecture, layer_start=m.layer_start, layer_end=m.layer_end,
        include_embeddings=m.include_embeddings, include_output=m.include_output, state=m.state,
        wire_dtype=m.wire_dtype, hop_transport=m.hop_transport, frame_port=m.frame_port, tls=m.tls,
        downstream_ok=m.downstream_ok, downstream_error=m.downstream_error,
        downstream_stage_id=m.downstream_stage_id, downstream_endpoint=m.downstream_endpoint, n_embd=m.n_embd,
        lanes=lanes, downstream_rtt_us=m.downstream_rtt_us, downstream_rtt_samples=m.downstream_rtt_samples,
        return_rtt_us=m.return_rtt_us, return_rtt_samples=m.return_rtt_samples,
    )


def drops_to_pb(drops: Sequence[StageDrop]) -> pb.DropSessionResponse:
    return pb.DropSessionResponse(stages=[pb.StageDrop(stage_id=d.stage_id, found=d.found, reset_ms=d.reset_ms)
                                          for d in drops])


def drops_from_pb(msg: pb.DropSessionResponse) -> list[StageDrop]:
    return [StageDrop(d.stage_id, d.found, d.reset_ms) for d in msg.stages]


def trims_to_pb(trims: Sequence[StageTrim]) -> pb.TrimSessionResponse:
    return pb.TrimSessionResponse(stages=[pb.StageTrim(stage_id=t.stage_id, tokens_before=t.tokens_before)
                                          for t in trims])


def trims_from_pb(msg: pb.TrimSessionResponse) -> list[StageTrim]:
    return [StageTrim(t.stage_id, t.tokens_before) for t in msg.stages]


def page_to_pb(page: KvPage) -> pb.KvPage:
    d = page.descriptor
    return pb.KvPage(descriptor=pb.KvPageDesc(
        version=d.version, model_digest=d.model_digest, layer_start=d.layer_start, layer_end=d.layer_end,
        n_tokens=d.n_tokens, cache_type_k=d.cache_type_k, cache_type_v=d.cache_type_v, n_ctx=d.n_ctx,
        batches=d.batches),
        data=page.data, token_ids=list(page.token_ids),
        images=[pb.KvImage(row=row, width=width, height=height) for row, width, height in page.images])


def page_from_pb(msg: pb.KvPage) -> KvPage:
    d = msg.descriptor
    return KvPage(KvPageDesc(d.version, d.model_digest, d.layer_start, d.layer_end, d.n_tokens, d.cache_type_k,
                             d.cache_type_v, d.n_ctx, d.batches), bytes(msg.data), tuple(msg.token_ids),
                  tuple((i.row, i.width, i.height) for i in msg.images))
