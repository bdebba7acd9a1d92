"""The host's compute lock: co-located stages that would oversubscribe the cores take turns.

ggml's graph threads meet at a barrier after every op and spin there. Two stages that each run
all the host's cores, decoding at the same moment, run twice as many threads as there are cores:
every barrier waits for a thread the kernel has descheduled, and both decodes slow down far
more than twofold (measured on 2 cores, 3 stages of 2 threads: a prompt's first token 8.8-11.7 s
with four chunks in flight against 4.3 s one at a time). With one lock around every
``llama_decode`` on the host only one stage computes at a time, on every core, and the others'
batches wait their turn instead of fighting for the cores. That makes overlap safe where it pays:
several batches (``max_inflight``) or a prompt's chunks in flight, where links leave cores idle.

An advisory ``flock`` on a file the co-located stages share (``compute_lock_path``; the local
launcher sets it): the kernel releases it when a process dies, so a stage that crashes while
decoding never blocks its neighbours. Speed only, never correctness: a lock that cannot be taken
leaves the decode unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os
from types import TracebackType

from skippy_stage.errors import ConfigError


class ComputeLock:
    """The lock file of ``compute_lock_path``, open for this process's life (``close``)."""

    def __init__(self, path: str, *, stage_id: str) -> None:
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"parse compute_lock_path for {stage_id}: cannot open {path!r}: {exc.strerror}") from exc
        self.path = path
        self._held = False

    @property
    def fd(self) -> int:
        """The descriptor the native frame path locks around its decodes (-1 once closed)."""
        return self._fd

    def __enter__(self) -> ComputeLock:
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                self._held = True
                return self
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return self  # unlocked: see the module's docstring

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._held:
            self._held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
