"""``skippy-stage profile`` traces a token through real stage processes, step by step.

Every stage marks the same points of its frame path (``skippy_stage/tracing.py``) when
``SKIPPY_TRACE_DIR`` is set; the command lines the stages' marks up and prints the median of
each step. Times are never asserted (machines are noisy): the path is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def test_a_token_is_traced_from_the_head_through_every_stage_and_back():
    run = subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", "profile", "--stages", "2",
                          "--tokens", "12", "--rounds", "1", "--fields", '{"n_threads": 2}'],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    steps = re.findall(r"^\s+(S\d:\w+) -> (S\d:\w+)\s+(\d+)$", run.stdout, re.M)
    path = [a for a, _, _ in steps] + [steps[-1][1]]
    # the head computes and sends, the final stage receives, computes and returns, the head has it
    for mark in ("S0:proc", "S0:d0", "S0:d1", "S0:s1", "S1:recv", "S1:parsed", "S1:d0", "S1:d1", "S1:s1",
                 "S0:rrecv", "S0:woke"):
        assert mark in path, (mark, path)
    assert path[0] == path[-1] == "S0:proc", "one token: from one head step to the next"
    assert path.index("S0:d1") < path.index("S1:recv") < path.index("S1:d0") < path.index("S0:rrecv")
    assert re.search(r"sum \d+: llama_decode \d+, the rest \d+", run.stdout)


def _trace_in_a_process(env_dir: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = ("from skippy_stage import tracing; tracing.label('stage7'); tracing.mark('d0'); tracing.mark('d1'); "
            "print(tracing._marks is None)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "SKIPPY_TRACE_DIR": env_dir})


def test_a_traced_process_writes_its_marks_in_order_at_exit_and_an_untraced_one_keeps_none(tmp_path):
    on = _trace_in_a_process(str(tmp_path), tmp_path)
    assert on.returncode == 0, on.stderr[-2000:]
    (trace,) = tmp_path.glob("stage7.*.trace")
    assert [line.split()[0] for line in trace.read_text().splitlines()] == ["d0", "d1"]
    trace.unlink()
    off = _trace_in_a_process("", tmp_path)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.strip() == "True", "off, a mark keeps nothing"
    assert list(tmp_path.iterdir()) == []
