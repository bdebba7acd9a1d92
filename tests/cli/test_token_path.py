"""``scripts/token_path.py`` traces a token through real stage processes, step by step.

Every stage marks the same points of its frame path (``skippy_stage/tracing.py``) when
``SKIPPY_TRACE_DIR`` is set; the script lines the stages' marks up and prints the median of
each step. Times are never asserted (machines are noisy): the path is.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "token_path.py"


def test_a_token_is_traced_from_the_head_through_every_stage_and_back():
    run = subprocess.run([sys.executable, str(SCRIPT), "--stages", "2", "--tokens", "12", "--rounds", "1"],
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


def test_marks_cost_nothing_and_write_nothing_when_tracing_is_off(tmp_path, monkeypatch):
    from skippy_stage import tracing

    monkeypatch.chdir(tmp_path)
    assert tracing._marks is None  # the test run does not set SKIPPY_TRACE_DIR
    tracing.mark("d0")
    tracing.flush()
    assert list(tmp_path.iterdir()) == []
