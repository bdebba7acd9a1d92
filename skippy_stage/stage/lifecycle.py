"""A stage's lifecycle: LOADING → SERVING → DRAINING → STOPPED, and what each state lets run.

:class:`Lifecycle` is the base every other part of a :class:`~skippy_stage.stage.stage.Stage` builds
on (``sessions``, ``frame_path``, ``stage``): the settings they read, the metrics they record, the
runtime once loaded, and the state with its guarded transitions. Work already admitted may finish
while the stage drains; nothing new starts once it stops.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import structlog

from skippy_stage.config import StageConfig
from skippy_stage.errors import StageUnavailableError
from skippy_stage.metrics import StageMetrics
from skippy_stage.model.runtime import StageRuntime

log = structlog.get_logger("skippy_stage.stage")


class StageState(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_TRANSITIONS = {
    StageState.LOADING: {StageState.SERVING, StageState.DRAINING, StageState.STOPPED},
    StageState.SERVING: {StageState.DRAINING, StageState.STOPPED},
    StageState.DRAINING: {StageState.STOPPED},
    StageState.STOPPED: set(),
}


@dataclass(frozen=True)
class Timeouts:
    """Every timeout, named by its scope: a view of the StageConfig's fields (see there)."""

    hop_s: float
    health_probe_s: float
    health_interval_s: float
    step_s: float
    drop_s: float

    @classmethod
    def from_config(cls, cfg: StageConfig) -> Timeouts:
        return cls(hop_s=cfg.hop_timeout_s, health_probe_s=cfg.health_probe_s, health_interval_s=cfg.health_interval_s,
                   step_s=cfg.step_timeout_s, drop_s=cfg.drop_timeout_s)


class Lifecycle:
    """The stage's settings, metrics and runtime, and the state that says what may run on it."""

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.timeouts = Timeouts.from_config(config)
        self.log = log.bind(stage_id=config.stage_id, run_id=config.run_id)
        self.metrics = StageMetrics(config.stage_id)
        self.runtime: StageRuntime | None = None  # set once loaded (``Stage.load``)
        self._state = StageState.LOADING
        self._state_lock = threading.Lock()

    @property
    def state(self) -> StageState:
        return self._state

    def transition(self, new: StageState) -> bool:
        """Move to ``new`` if the lifecycle allows it; False when it does not."""
        with self._state_lock:
            if new not in _TRANSITIONS[self._state]:
                return False
            self._state = new
        self.log.info("stage state", state=new.value)
        return True

    @property
    def accepting_frames(self) -> bool:
        """Whether a frame may run here now (serving, or draining work already admitted)."""
        return self.runtime is not None and self._state in (StageState.SERVING, StageState.DRAINING)

    def require_runtime(self, *, draining_ok: bool = True) -> StageRuntime:
        """The runtime, or UNAVAILABLE; work already admitted may finish while draining."""
        if self.runtime is None or self._state is StageState.LOADING:
            raise StageUnavailableError(f"stage {self.config.stage_id} is still loading")
        if self._state is StageState.DRAINING and draining_ok:
            return self.runtime
        if self._state is not StageState.SERVING:
            raise StageUnavailableError(f"stage {self.config.stage_id} is {self._state.value}")
        return self.runtime
