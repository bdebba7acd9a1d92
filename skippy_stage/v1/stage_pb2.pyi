from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_TOKEN_MAJOR: _ClassVar[Layout]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
DTYPE_INT8: DType
LAYOUT_UNSPECIFIED: Layout
LAYOUT_TOKEN_MAJOR: Layout
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "seed", "grammar", "grammar_start", "frequency_penalty", "presence_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    seed: int
    grammar: str
    grammar_start: int
    frequency_penalty: float
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., seed: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_start: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class BatchEntry(_message.Message):
    __slots__ = ("session_id", "phase", "positions", "token_ids", "sample_last", "want_logits", "sampling", "prefix_id", "rewind", "verify", "all_rows", "top_logprobs", "fork_of", "prompt_logprobs", "next_token", "draws_before", "digest_logits", "continues", "image")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_LAST_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    ALL_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAWS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_LOGITS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    phase: Phase
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_last: bool
    want_logits: bool
    sampling: SamplingParams
    prefix_id: str
    rewind: bool
    verify: bool
    all_rows: bool
    top_logprobs: int
    fork_of: str
    prompt_logprobs: int
    next_token: int
    draws_before: int
    digest_logits: bool
    continues: bool
    image: ImageGrid
    def __init__(self, session_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sample_last: _Optional[bool] = ..., want_logits: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefix_id: _Optional[str] = ..., rewind: _Optional[bool] = ..., verify: _Optional[bool] = ..., all_rows: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., fork_of: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ..., next_token: _Optional[int] = ..., draws_before: _Optional[int] = ..., digest_logits: _Optional[bool] = ..., continues: _Optional[bool] = ..., image: _Optional[_Union[ImageGrid, _Mapping]] = ...) -> None: ...

class ImageGrid(_message.Message):
    __slots__ = ("width", "height", "first_row")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    first_row: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., first_row: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class FrameDescriptor(_message.Message):
    __slots__ = ("version", "dtype", "layout", "producer_stage_index", "layer_start", "layer_end", "token_count", "sequence_count", "payload_bytes", "flags", "width")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    version: int
    dtype: DType
    layout: Layout
    producer_stage_index: int
    layer_start: int
    layer_end: int
    token_count: int
    sequence_count: int
    payload_bytes: int
    flags: int
    width: int
    def __init__(self, version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., layout: _Optional[_Union[Layout, str]] = ..., producer_stage_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_count: _Optional[int] = ..., sequence_count: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., flags: _Optional[int] = ..., width: _Optional[int] = ...) -> None: ...

class ActivationFrame(_message.Message):
    __slots__ = ("descriptor", "payload")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    descriptor: FrameDescriptor
    payload: bytes
    def __init__(self, descriptor: _Optional[_Union[FrameDescriptor, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class IterationBatchRequest(_message.Message):
    __slots__ = ("request_id", "entries", "frame", "return_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    RETURN_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    entries: _containers.RepeatedCompositeFieldContainer[BatchEntry]
    frame: ActivationFrame
    return_key: str
    def __init__(self, request_id: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[BatchEntry, _Mapping]]] = ..., frame: _Optional[_Union[ActivationFrame, _Mapping]] = ..., return_key: _Optional[str] = ...) -> None: ...

class ReturnedBatch(_message.Message):
    __slots__ = ("return_key", "response")
    RETURN_KEY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    return_key: str
    response: IterationBatchResponse
    def __init__(self, return_key: _Optional[str] = ..., response: _Optional[_Union[IterationBatchResponse, _Mapping]] = ...) -> None: ...

class ReturnAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class HopRequest(_message.Message):
    __slots__ = ("hop_id", "request", "timeout_s", "relay", "sent_unix_ns", "drop_session_ids", "moved_session_ids", "retire_session_ids")
    HOP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    DROP_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    MOVED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    RETIRE_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    hop_id: int
    request: IterationBatchRequest
    timeout_s: float
    relay: bool
    sent_unix_ns: int
    drop_session_ids: _containers.RepeatedScalarFieldContainer[str]
    moved_session_ids: _containers.RepeatedScalarFieldContainer[str]
    retire_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hop_id: _Optional[int] = ..., request: _Optional[_Union[IterationBatchRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., relay: _Optional[bool] = ..., sent_unix_ns: _Optional[int] = ..., drop_session_ids: _Optional[_Iterable[str]] = ..., moved_session_ids: _Optional[_Iterable[str]] = ..., retire_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HopReply(_message.Message):
    __slots__ = ("hop_id", "response", "code", "message", "failed_stage", "return_key", "session_ids")
    HOP_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILED_STAGE_FIELD_NUMBER: _ClassVar[int]
    RETURN_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    hop_id: int
    response: IterationBatchResponse
    code: int
    message: str
    failed_stage: str
    return_key: str
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hop_id: _Optional[int] = ..., response: _Optional[_Union[IterationBatchResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., failed_stage: _Optional[str] = ..., return_key: _Optional[str] = ..., session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FrameHello(_message.Message):
    __slots__ = ("version", "purpose", "token", "stage_id")
    class Purpose(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PURPOSE_UNSPECIFIED: _ClassVar[FrameHello.Purpose]
        PURPOSE_HOP: _ClassVar[FrameHello.Purpose]
        PURPOSE_RETURN: _ClassVar[FrameHello.Purpose]
    PURPOSE_UNSPECIFIED: FrameHello.Purpose
    PURPOSE_HOP: FrameHello.Purpose
    PURPOSE_RETURN: FrameHello.Purpose
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    purpose: FrameHello.Purpose
    token: str
    stage_id: str
    def __init__(self, version: _Optional[int] = ..., purpose: _Optional[_Union[FrameHello.Purpose, str]] = ..., token: _Optional[str] = ..., stage_id: _Optional[str] = ...) -> None: ...

class FrameWelcome(_message.Message):
    __slots__ = ("code", "message", "stage_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    stage_id: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., stage_id: _Optional[str] = ...) -> None: ...

class EntryOutput(_message.Message):
    __slots__ = ("session_id", "has_token", "token", "logits", "tokens", "logprobs", "prompt_logprobs", "logit_digests", "draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    has_token: bool
    token: int
    logits: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    logit_digests: _containers.RepeatedScalarFieldContainer[int]
    draft: int
    def __init__(self, session_id: _Optional[str] = ..., has_token: _Optional[bool] = ..., token: _Optional[int] = ..., logits: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., logit_digests: _Optional[_Iterable[int]] = ..., draft: _Optional[int] = ...) -> None: ...

class IterationBatchResponse(_message.Message):
    __slots__ = ("outputs", "final_stage_id")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINAL_STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EntryOutput]
    final_stage_id: str
    def __init__(self, outputs: _Optional[_Iterable[_Union[EntryOutput, _Mapping]]] = ..., final_stage_id: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "position", "token_id", "sampling", "want_logits", "draws_before")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    DRAWS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    token_id: int
    sampling: SamplingParams
    want_logits: bool
    draws_before: int
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., want_logits: _Optional[bool] = ..., draws_before: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token", "logits")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logits: _Optional[_Iterable[float]] = ...) -> None: ...

class DropSessionRequest(_message.Message):
    __slots__ = ("session_id", "keep_prefix")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_PREFIX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_prefix: bool
    def __init__(self, session_id: _Optional[str] = ..., keep_prefix: _Optional[bool] = ...) -> None: ...

class TrimSessionRequest(_message.Message):
    __slots__ = ("session_id", "tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class StageTrim(_message.Message):
    __slots__ = ("stage_id", "tokens_before")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    tokens_before: int
    def __init__(self, stage_id: _Optional[str] = ..., tokens_before: _Optional[int] = ...) -> None: ...

class TrimSessionResponse(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageTrim]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageTrim, _Mapping]]] = ...) -> None: ...

class KvPageDesc(_message.Message):
    __slots__ = ("version", "model_digest", "layer_start", "layer_end", "n_tokens", "cache_type_k", "cache_type_v", "n_ctx", "batches")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TYPE_K_FIELD_NUMBER: _ClassVar[int]
    CACHE_TYPE_V_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_digest: str
    layer_start: int
    layer_end: int
    n_tokens: int
    cache_type_k: str
    cache_type_v: str
    n_ctx: int
    batches: int
    def __init__(self, version: _Optional[int] = ..., model_digest: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., n_tokens: _Optional[int] = ..., cache_type_k: _Optional[str] = ..., cache_type_v: _Optional[str] = ..., n_ctx: _Optional[int] = ..., batches: _Optional[int] = ...) -> None: ...

class KvPage(_message.Message):
    __slots__ = ("descriptor", "data", "token_ids", "images")
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    descriptor: KvPageDesc
    data: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[KvImage]
    def __init__(self, descriptor: _Optional[_Union[KvPageDesc, _Mapping]] = ..., data: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[KvImage, _Mapping]]] = ...) -> None: ...

class KvImage(_message.Message):
    __slots__ = ("row", "width", "height")
    ROW_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    row: int
    width: int
    height: int
    def __init__(self, row: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("session_id", "wait_for_tokens", "release", "wait_for_batches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_BATCHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    wait_for_tokens: int
    release: bool
    wait_for_batches: int
    def __init__(self, session_id: _Optional[str] = ..., wait_for_tokens: _Optional[int] = ..., release: _Optional[bool] = ..., wait_for_batches: _Optional[int] = ...) -> None: ...

class ImportSessionRequest(_message.Message):
    __slots__ = ("session_id", "page", "resident")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    page: KvPage
    resident: bool
    def __init__(self, session_id: _Optional[str] = ..., page: _Optional[_Union[KvPage, _Mapping]] = ..., resident: _Optional[bool] = ...) -> None: ...

class ImportSessionResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class ResidentPrefix(_message.Message):
    __slots__ = ("prefix_id", "lane", "tokens", "age_s")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    lane: int
    tokens: int
    age_s: float
    def __init__(self, prefix_id: _Optional[str] = ..., lane: _Optional[int] = ..., tokens: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class StageDrop(_message.Message):
    __slots__ = ("stage_id", "found", "reset_ms")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    RESET_MS_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    found: bool
    reset_ms: float
    def __init__(self, stage_id: _Optional[str] = ..., found: _Optional[bool] = ..., reset_ms: _Optional[float] = ...) -> None: ...

class DropSessionResponse(_message.Message):
    __slots__ = ("stages",)
    STAGES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageDrop]
    def __init__(self, stages: _Optional[_Iterable[_Union[StageDrop, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LaneRow(_message.Message):
    __slots__ = ("lane", "state", "session_id", "tokens")
    LANE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    lane: int
    state: str
    session_id: str
    tokens: int
    def __init__(self, lane: _Optional[int] = ..., state: _Optional[str] = ..., session_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage_id", "stage_index", "run_id", "topology_id", "model_id", "architecture", "layer_start", "layer_end", "include_embeddings", "include_output", "n_embd", "state", "lane_count", "active_sessions", "idle_lanes", "free_lanes", "max_session_tokens", "total_session_tokens", "kv_pool_tokens", "kv_cells_per_lane", "discarded_lanes", "lanes", "downstream_stage_id", "downstream_endpoint", "downstream_ok", "downstream_error", "wire_dtype", "hop_transport", "frame_port", "tls", "resident_prefixes", "downstream_rtt_us", "downstream_rtt_samples", "return_rtt_us", "return_rtt_samples")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LANE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    IDLE_LANES_FIELD_NUMBER: _ClassVar[int]
    FREE_LANES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_PER_LANE_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_LANES_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_OK_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_ERROR_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOP_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FRAME_PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_RTT_US_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_RTT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RETURN_RTT_US_FIELD_NUMBER: _ClassVar[int]
    RETURN_RTT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    stage_index: int
    run_id: str
    topology_id: str
    model_id: str
    architecture: str
    layer_start: int
    layer_end: int
    include_embeddings: bool
    include_output: bool
    n_embd: int
    state: str
    lane_count: int
    active_sessions: int
    idle_lanes: int
    free_lanes: int
    max_session_tokens: int
    total_session_tokens: int
    kv_pool_tokens: int
    kv_cells_per_lane: int
    discarded_lanes: int
    lanes: _containers.RepeatedCompositeFieldContainer[LaneRow]
    downstream_stage_id: str
    downstream_endpoint: str
    downstream_ok: bool
    downstream_error: str
    wire_dtype: str
    hop_transport: str
    frame_port: int
    tls: bool
    resident_prefixes: _containers.RepeatedCompositeFieldContainer[ResidentPrefix]
    downstream_rtt_us: int
    downstream_rtt_samples: int
    return_rtt_us: int
    return_rtt_samples: int
    def __init__(self, stage_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., run_id: _Optional[str] = ..., topology_id: _Optional[str] = ..., model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., include_embeddings: _Optional[bool] = ..., include_output: _Optional[bool] = ..., n_embd: _Optional[int] = ..., state: _Optional[str] = ..., lane_count: _Optional[int] = ..., active_sessions: _Optional[int] = ..., idle_lanes: _Optional[int] = ..., free_lanes: _Optional[int] = ..., max_session_tokens: _Optional[int] = ..., total_session_tokens: _Optional[int] = ..., kv_pool_tokens: _Optional[int] = ..., kv_cells_per_lane: _Optional[int] = ..., discarded_lanes: _Optional[int] = ..., lanes: _Optional[_Iterable[_Union[LaneRow, _Mapping]]] = ..., downstream_stage_id: _Optional[str] = ..., downstream_endpoint: _Optional[str] = ..., downstream_ok: _Optional[bool] = ..., downstream_error: _Optional[str] = ..., wire_dtype: _Optional[str] = ..., hop_transport: _Optional[str] = ..., frame_port: _Optional[int] = ..., tls: _Optional[bool] = ..., resident_prefixes: _Optional[_Iterable[_Union[ResidentPrefix, _Mapping]]] = ..., downstream_rtt_us: _Optional[int] = ..., downstream_rtt_samples: _Optional[int] = ..., return_rtt_us: _Optional[int] = ..., return_rtt_samples: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "max_tokens", "sampling", "stop", "speculative", "top_logprobs", "stream_interval_ms", "record_schedule", "media")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    RECORD_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculative: Speculative
    top_logprobs: int
    stream_interval_ms: int
    record_schedule: bool
    media: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., stream_interval_ms: _Optional[int] = ..., record_schedule: _Optional[bool] = ..., media: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Speculative(_message.Message):
    __slots__ = ("drafter", "k", "ngram", "adaptive", "window_depth")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_DEPTH_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    ngram: int
    adaptive: bool
    window_depth: int
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ..., ngram: _Optional[int] = ..., adaptive: _Optional[bool] = ..., window_depth: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "done", "finish_reason", "prompt_tokens", "completion_tokens", "session_id", "cached_tokens", "logprobs", "schedule_json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    session_id: str
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    schedule_json: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., session_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., schedule_json: _Optional[str] = ...) -> None: ...
