"""What a stage says about itself (GetStatus) and about a session it freed or cut (DropSession,
TrimSession).

Domain types, so the stage builds them without protobuf and the edge agreement reads a
neighbour's report the same way whether it came over gRPC or from a stage in this process.
``codec`` converts them at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from skippy_stage.model.lanes import LaneStats


@dataclass(frozen=True)
class StageReport:
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
    state: str
    wire_dtype: str
    hop_transport: str
    frame_port: int
    tls: bool
    downstream_ok: bool
    downstream_error: str = ""
    downstream_stage_id: str = ""
    downstream_endpoint: str = ""
    n_embd: int = 0  # 0 until the stage is loaded
    lanes: LaneStats | None = None  # None until the stage is loaded
    # The links' measured round trips (``round_trips``): to the downstream, and a final stage's
    # direct return to the head. Median of the recent samples in us (0 with none), and the count.
    downstream_rtt_us: int = 0
    downstream_rtt_samples: int = 0
    return_rtt_us: int = 0
    return_rtt_samples: int = 0


@dataclass(frozen=True)
class StageDrop:
    """Whether one stage held the session, and how long freeing its lane took."""

    stage_id: str
    found: bool
    reset_ms: float = 0.0


@dataclass(frozen=True)
class StageTrim:
    """How many tokens one stage held for the session before it was cut back."""

    stage_id: str
    tokens_before: int
