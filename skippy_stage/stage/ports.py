"""What an edge needs of a stage at its far end in this process: the interfaces a Stage implements.

The edges (``hops``, ``downstream``, ``returns``) sit below the stage: it builds them and
hands them callbacks. Chained in one process (``Stage.connect_local``, ``Stage.return_locally``)
the far end of an edge is another stage, and the edge calls it through these interfaces, never
through ``Stage`` itself, so no edge imports the stage. Tests stand in for a stage with
anything that has these members.
"""

from __future__ import annotations

from typing import Protocol

from skippy_stage.stage.peers import Peer
from skippy_stage.stage.reports import StageDrop, StageReport, StageTrim
from skippy_stage.stage.steps import Frame, Outputs
from skippy_stage.stage.upstream import Inbound, Sink


class StageBelow(Protocol):
    """The stage below, in this process: what its upstream's ``LocalHop`` sends frames to and
    ``LocalDownstream`` makes control calls on."""

    @property
    def runtime(self) -> object | None:
        """None until the stage has loaded (a frame cannot run there yet)."""

    @property
    def inbound(self) -> Inbound:
        """The back channels of its upstream edges; the hop adds its own."""

    @property
    def ready(self) -> bool: ...

    def accept_frame(self, frame: Frame, sink: Sink) -> None:
        """Run the frame on the caller's thread; errors and relayed outputs go up ``sink``."""

    def release_sessions(self, session_ids: list[str], owner: Peer | None) -> None: ...

    def retire_sessions(self, session_ids: list[str], owner: Peer | None) -> None: ...

    def drop_session(self, session_id: str, remaining_s: float | None, *,
                     keep_prefix: bool = False) -> list[StageDrop]: ...

    def trim_session(self, session_id: str, tokens: int, remaining_s: float | None) -> list[StageTrim]: ...

    def status(self) -> StageReport: ...


class HeadAbove(Protocol):
    """The head, in this process: where a final stage's ``LocalReturn`` hands a step's outputs."""

    def deliver_return(self, key: str, outputs: Outputs) -> bool:
        """Settle the step waiting under ``key``; False when none waits (late or unknown)."""
