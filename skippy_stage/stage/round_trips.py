"""The measured round trip of one link: this stage to its downstream, or a final stage to the head.

Nothing extra travels for it. The downstream watch (``server/monitor``) already calls the stage
below's health service every ``health_interval_s`` over the edge's gRPC channel, and a final stage
with a direct return calls the head's the same way over its ``return_to`` channel. Each answered
call is timed from request to answer, so a sample is the link's round trip plus one small gRPC call
at each end (a few hundred microseconds on one host). The first call of a channel also connects it;
the median of the last :data:`WINDOW` samples keeps such an outlier, and a passing stall, out.

``GetStatus`` reports the median and the number of samples (``downstream_rtt_us``,
``return_rtt_us``), and so does Prometheus (``skippy_downstream_rtt_seconds``,
``skippy_return_rtt_seconds``); ``skippy-stage plan --measure`` reads them to choose a split.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

# Samples the median is taken over: 8 s of probes at the default health_interval_s (0.5 s).
WINDOW = 16


@dataclass(frozen=True)
class RoundTrip:
    """A link's recent round trip: the median of its last samples (0.0 with none) and how many
    samples were ever taken."""

    median_s: float
    samples: int

    @property
    def median_us(self) -> int:
        return round(self.median_s * 1e6)


class RoundTrips:
    """The timed answers of one link, thread-safe (the watch adds, status and scrapes read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=WINDOW)
        self._count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            self._count += 1

    def read(self) -> RoundTrip:
        with self._lock:
            recent, count = list(self._recent), self._count
        return RoundTrip(statistics.median(recent) if recent else 0.0, count)


NOT_MEASURED = RoundTrip(0.0, 0)
