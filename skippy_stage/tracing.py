"""Where one token's time goes across the stages: timestamps at fixed points of the frame path.

Off unless ``SKIPPY_TRACE_DIR`` names a directory when the process starts. Then every mark is
kept in memory (the newest ``KEPT`` of them) and written to ``<dir>/<label>.<pid>.trace``
every ``FLUSH_EVERY`` marks and at exit, one ``name time_ns`` line each, on the wall clock that
every process of one host shares. ``skippy-stage profile`` runs a pipeline with it on,
lines the stages' files up and prints the median of every step of a token's path: compute,
the Python around it, each hop.

Off, a mark is one global read. The histograms in ``metrics`` stay the operator's view; this
is the developer's, for the questions they cannot answer (which of twenty ~50 us steps grew).

The marks, in the order a decode token meets them (stage 0 is the head):

  proc   head: the scheduler hands a step to its stage        recv    a frame's bytes are in
  rb0    a batch enters the runtime (checks, lanes)            parsed  ... and parsed
  d0/d1  llama_decode starts / returns                         done    the frame is handled
  rb1    the batch's results are ready                         rrecv   head: a return's bytes are in
  s0     the next frame (or return) goes to its transport      rdeliv  head: ... and delivered
  enc    ... serialised                                        wait    head: waits for the outputs
  s1     ... sent                                              woke    head: has them
                                                               took    head: the scheduler took the tokens
                                                               built   head: ... and built the next step
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import deque
from pathlib import Path

KEPT = 200_000
FLUSH_EVERY = 4096

_dir = os.environ.get("SKIPPY_TRACE_DIR") or None
_marks: deque[tuple[str, int]] | None = deque(maxlen=KEPT) if _dir else None
_label = "process"
_count = 0
_lock = threading.Lock()


def label(name: str) -> None:
    """Name this process's trace file (a stage sets its stage index)."""
    global _label
    _label = name


def mark(name: str) -> None:
    global _count
    if _marks is None:
        return
    _marks.append((name, time.time_ns()))
    _count += 1
    if _count % FLUSH_EVERY == 0:
        flush()


def mark_at(name: str, t_ns: int) -> None:
    """A mark taken elsewhere (the native frame path's clock readings: the same wall clock)."""
    if _marks is not None and t_ns:
        _marks.append((name, t_ns))


def flush() -> None:
    if _marks is None:
        return
    with _lock:
        lines = "\n".join(f"{name} {t}" for name, t in list(_marks))
        path = Path(_dir) / f"{_label}.{os.getpid()}.trace"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(lines)
            tmp.replace(path)
        except OSError:
            pass  # a trace is a developer's aid: never a reason for a stage to fail


if _marks is not None:
    atexit.register(flush)
