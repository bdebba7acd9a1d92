"""How many batches the head keeps in flight: as many as the links leave room for, measured.

One batch in flight leaves every stage idle while its frames travel: a step costs the chain's
compute plus the ring's link latency ``L`` (each one-way delay, once). Several batches — disjoint
session groups, one per scheduler worker — fill that time, but each costs something: smaller
batches compute less efficiently, and every step has its own fixed work at the head. So the
count follows what a step measures (``T``, from the plan to the outputs) against the links'
share of it:

* stages that share the host's cores and take turns on them (``compute_lock_path``): the chain's
  compute is one resource, so ``T / (T - L)`` batches keep it busy — one on loopback, two where a
  link's delay is a fair part of a step;
* stages on hosts of their own each compute a ``1/S`` share of a step: ``S * T / (T - L)``.

Less ``MARGIN`` before rounding up, so that a link's share of a few percent does not split the
sessions; never more than ``max_inflight`` (the cap) nor fewer than one. ``L`` is the stage count
times half the head's measured round trip to its downstream (health probes travel that link):
it assumes the chain's links are alike, as ``plan``'s estimate does. Until both are measured,
one batch.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

# How much of a step the links must take before another batch goes out (see the module's docstring).
MARGIN = 0.1


@dataclass
class BatchCount:
    """``count()``: batches to keep in flight now; ``step(seconds)``: a step's measured time."""

    cap: int
    stages: int
    shared_cores: bool
    ring_s: Callable[[], float]  # the ring's link latency now (0.0: not measured)
    WEIGHT = 0.2
    _step_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self, seconds: float) -> None:
        """A step of the scheduler's (plan to outputs) took ``seconds``: a moving average."""
        with self._lock:
            self._step_s = seconds if self._step_s == 0.0 else self._step_s + self.WEIGHT * (seconds - self._step_s)

    @property
    def step_s(self) -> float:
        with self._lock:
            return self._step_s

    def count(self) -> int:
        if self.cap <= 1:
            return 1
        step, ring = self.step_s, self.ring_s()
        if step <= 0.0 or ring <= 0.0:
            return 1
        compute = max(step - ring, step * 0.05)  # a ring measured above a step: links are most of it
        wanted = step / compute * (1 if self.shared_cores else self.stages)
        return max(1, min(self.cap, math.ceil(wanted - MARGIN)))
