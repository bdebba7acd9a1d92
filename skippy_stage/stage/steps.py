"""A step as the stage logic sees it: what travels down the chain and what comes back.

Protobuf lives at the edges (``codec``, used by the gRPC service, the frame listener and
the socket transports); the stage, the head's scheduler and the in-process hop speak
these types, so a step the head runs on its own layers is never serialised to be parsed
back, and stage logic is tested without sockets.

The codec's conversions are total: everything a client can get wrong is refused here, in
``runtime_entries``, with InvalidRequestError naming the field and the value, before any
of it reaches the runtime (which checks what needs the loaded model: vocabulary,
positions against lane state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from skippy_stage.errors import InvalidRequestError, RuntimeFailure
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.runtime import BatchEntry, EntryResult, TokenLogprob
from skippy_stage.model.sampling import SamplingParams, validated_once
from skippy_stage.stage import wire

PHASE_DECODE = "decode"
PHASE_PREFILL = "prefill"
MAX_RETURN_KEY_LEN = 64


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class StepEntry:
    """One session's share of a step, as it travels to every stage.

    ``sample_last`` and ``want_logits`` are acted on by the final stage only; ``sampling`` is
    checked at every stage so a bad value is refused before any compute.
    """

    session_id: str
    positions: Sequence[int] | np.ndarray
    token_ids: Sequence[int] | np.ndarray | None = None
    phase: str = ""
    sample_last: bool = False
    want_logits: bool = False
    sampling: SamplingParams | None = None
    # The first entry of a session that takes a resident prefix, keeping positions[0] of its tokens.
    prefix_id: str | None = None
    # Speculative decoding: cut the session back to positions[0] first (every stage); sample every
    # row, stopping at the first rejected draft (final stage); output every row (final stage).
    rewind: bool = False
    verify: bool = False
    all_rows: bool = False
    top_logprobs: int | None = None  # final stage: logprobs of each sample and this many alternatives
    # A new session starting as a copy of this live one's first positions[0] tokens (every stage).
    fork_of: str | None = None
    # Final stage: each row's next token's logprob and this many alternatives (a prompt's logprobs).
    prompt_logprobs: int | None = None
    next_token: int | None = None  # with prompt_logprobs: the token after the last position
    draws_before: int = 0  # final stage: samples the session took before (a rebuilt sampler skips them)
    digest_logits: bool = False  # final stage: a digest of each sampled logit row (a recorded schedule)
    # Final stage, verify: a window in flight behind the previous one; sampled only if it continues it.
    continues: bool = False
    # An M-RoPE image's rows (every stage): the image's grid and this entry's first row in it.
    image: ImageGrid | None = None
    # The head's own, never on the wire: an image's rows (float32, one per position) that its layers take
    # in place of the token embeddings; ``token_ids`` then hold placeholders.
    embd: np.ndarray | None = None


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class Activations:
    """A stage's hidden states for the next one, encoded in the wire dtype."""

    descriptor: wire.FrameDescriptor
    payload: bytes


@dataclass
class Step:
    """One iteration batch: every entry runs in the same llama_decode on each stage.

    ``return_key`` is set by whoever waits for the outputs; a final stage with a way to the
    head sends them back under it.
    """

    request_id: str
    entries: Sequence[StepEntry]
    frame: Activations | None = None
    return_key: str = ""
    # Opaque to the stage logic: the entries as they arrived on the wire (set by ``codec``), so a
    # stage forwards them without encoding them again. Never read here.
    wire_entries: object = field(default=None, repr=False, compare=False)

    @property
    def session_ids(self) -> list[str]:
        return [e.session_id for e in self.entries]


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class Output:
    session_id: str
    token: int | None = None
    logits: np.ndarray | None = None
    tokens: tuple[int, ...] | None = None  # a verify entry's samples (``token`` is the last)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per sample, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # one per row with a next token, when asked
    logit_digests: tuple[int, ...] | None = None  # one per sample, when asked (``digest_logits``)
    # native_mtp_enabled: the final stage's MTP layers' guess of the token after ``token``
    draft: int | None = None


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class Outputs:
    """A step's outputs, one per entry in order, from the final stage."""

    outputs: Sequence[Output]
    final_stage_id: str
    # Opaque: the response these outputs were read from (``codec``), so a stage that relays them
    # (or the head answering a unary call) sends it on without encoding the logits again.
    wire: object = field(default=None, repr=False, compare=False)


@dataclass
class Frame:
    """A step on one edge: what a stage hands its downstream hop."""

    step: Step
    hop_id: int = 0
    timeout_s: float = 0.0  # what is left of the caller's deadline (0: none)
    relay: bool = False  # the outputs must come back up the edges, not straight to the head
    sent_unix_ns: int = 0


@dataclass(frozen=True)
class Reply:
    """A message on an edge's back channel: relayed outputs (code "OK"), or an error naming
    the stage that failed and the sessions every stage on the way frees. An error with no
    ``return_key`` means the edge below ``failed_stage`` broke."""

    hop_id: int = 0
    return_key: str = ""
    outputs: Outputs | None = None
    code: str = "OK"
    message: str = ""
    failed_stage: str = ""
    session_ids: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class StageShape:
    """What a stage checks an incoming step against."""

    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    n_embd: int
    include_embeddings: bool
    include_output: bool
    wire_dtype: str


def check_sampling(params: SamplingParams | None, where: str) -> SamplingParams:
    if params is None:
        return SamplingParams()
    try:
        return validated_once(params)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc).replace("sampling.", f"{where}.", 1)) from None


def runtime_entries(step: Step, shape: StageShape) -> list[BatchEntry]:
    """Check one step against this stage and turn it (and its frame, below stage 0) into
    runtime entries."""
    if not step.entries:
        raise InvalidRequestError("entries is empty: a batch needs at least one entry")
    if len(step.return_key) > MAX_RETURN_KEY_LEN:
        raise InvalidRequestError(f"return_key must be at most {MAX_RETURN_KEY_LEN} characters, "
                                  f"got {len(step.return_key)}")
    frame = step.frame
    if shape.include_embeddings and frame is not None:
        raise InvalidRequestError(f"frame is not accepted at stage {shape.stage_id}: it takes token_ids (layer_start=0)")
    if not shape.include_embeddings and frame is None:
        raise InvalidRequestError(f"frame is required at stage {shape.stage_id} (layer_start={shape.layer_start})")
    rows_per_entry = [len(e.positions) for e in step.entries]
    hidden: np.ndarray | None = None
    if frame is not None:
        desc = frame.descriptor
        wire.validate_descriptor(
            desc, payload_len=len(frame.payload), expected_layer_start=shape.layer_start,
            expected_width=shape.n_embd, accepted_dtypes=wire.DTYPES, entry_rows=sum(rows_per_entry),
            entry_count=len(step.entries),
        )
        hidden = wire.decode(frame.payload, desc.dtype, desc.token_count, desc.width)
    entries: list[BatchEntry] = []
    offset = 0
    final = shape.include_output
    for i, e in enumerate(step.entries):
        n = rows_per_entry[i]
        if n == 0:
            raise InvalidRequestError(f"entries[{i}].positions is empty")
        token_ids = None
        if e.token_ids is not None and len(e.token_ids):
            token_ids = np.asarray(e.token_ids, dtype=np.int64)
            if token_ids.shape[0] != n:
                raise InvalidRequestError(f"entries[{i}].token_ids has {token_ids.shape[0]} values for {n} positions")
        rows = e.embd if shape.include_embeddings else hidden[offset : offset + n]
        offset += n
        sample_last, verify = e.sample_last, e.verify
        if verify:
            if not sample_last:
                raise InvalidRequestError(f"entries[{i}].verify needs sample_last (it samples every row)")
            if e.want_logits:
                raise InvalidRequestError(f"entries[{i}] sets both verify and want_logits: a verify entry returns "
                                          f"samples only")
            if token_ids is None:
                raise InvalidRequestError(f"entries[{i}].verify needs token_ids: the drafts it verifies")
        elif e.continues:
            raise InvalidRequestError(f"entries[{i}].continues needs verify (a window of drafts it samples or not)")
        sampling = check_sampling(e.sampling, f"entries[{i}].sampling") if sample_last else None
        sampled = sample_last and final
        # Positional, in BatchEntry's field order (keywords cost a dict per entry per frame).
        entries.append(BatchEntry(
            e.session_id,
            np.asarray(e.positions, dtype=np.int64),
            token_ids,
            rows,
            e.want_logits and final,
            sampled,
            sampling,
            e.prefix_id,
            e.rewind,
            verify and final,
            (e.all_rows or verify) and final,
            e.top_logprobs if sampled else None,
            e.fork_of,
            e.prompt_logprobs if final else None,
            e.next_token if final else None,
            e.draws_before if sampled else 0,
            e.digest_logits and sampled,
            e.continues and final,
            e.image,
        ))
    return entries


def forward_step(step: Step, results: Sequence[EntryResult], shape: StageShape) -> Step:
    """The step this stage sends downstream: the same entries, its own output frame."""
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
    return Step(request_id=step.request_id, entries=step.entries, frame=Activations(desc, payload),
                return_key=step.return_key, wire_entries=step.wire_entries)


def outputs_from_results(results: Sequence[EntryResult], stage_id: str) -> Outputs:
    return Outputs([Output(r.session_id, r.token, r.logits, r.tokens, r.logprobs, r.prompt_logprobs, r.logit_digests,
                           r.draft)
                    for r in results], stage_id)
