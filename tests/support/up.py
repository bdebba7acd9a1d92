"""``skippy-stage up`` as a user starts it: the console script installed beside this Python, from a
directory of the caller's choosing, its slice cache shared with the run; stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "skippy-stage"


@contextlib.contextmanager
def running_up(*args: str, cache: Path, cwd: Path | None = None,
               log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``skippy-stage --log-level warning up ARGS``; yields the head endpoint it prints and the
    process. Its stderr goes to ``log`` (else nowhere)."""
    assert SCRIPT.exists(), f"the console script is not installed beside {sys.executable}"
    env = {**os.environ, "SKIPPY_STAGE_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)
    with contextlib.ExitStack() as stack:
        stderr = stack.enter_context(log.open("w")) if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen([str(SCRIPT), "--log-level", "warning", "up", *args], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env=env, cwd=cwd)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint, f"up exited with {proc.wait()} before printing the head endpoint" + (
            f": {log.read_text()}" if log is not None else "")
        yield endpoint, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
