"""``skippy-stage floor`` measures the split with no protocol: the floor under bench's ratios.

The unsplit model, its slices chained in one process and its slices in processes of their own
(hidden rows over pipes) decode the same greedy tokens; the command checks that before it
prints anything, so its figures compare the same work. Times are never asserted.
"""

from __future__ import annotations

import re
import subprocess
import sys


def test_the_split_without_a_protocol_decodes_the_unsplit_models_tokens_and_reports_ratios():
    run = subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", "floor", "--rounds", "1",
                          "--tokens", "6"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "6 greedy tokens, the same from every contender" in run.stdout
    rows = dict(re.findall(r"^(whole|pipe2|pipe3|chain3)\s+[\d.]+\s+([\d.]+)\s+[\d.]+", run.stdout, re.M))
    assert set(rows) == {"whole", "pipe2", "pipe3", "chain3"}, run.stdout
    assert rows["whole"] == "1.000"
