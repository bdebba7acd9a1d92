"""``skippy-stage ab`` decides whether set-up B decodes faster than A: both stay loaded, each round
times them back to back (B first in odd rounds), and the summary is the mean of the per-round ratios
with two standard errors. Times are never asserted (machines are noisy): what each line says is.
"""

from __future__ import annotations

import re
import subprocess
import sys


def test_two_set_ups_are_timed_in_every_round_and_compared_by_their_per_round_ratios():
    run = subprocess.run([sys.executable, "-m", "skippy_stage", "--log-level", "warning", "ab", "--stages", "1",
                          "--rounds", "2", "--tokens", "4", "--b", '{"native_frames": false}',
                          "--b-env", "GOMP_SPINCOUNT=1000"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rounds = re.findall(r"^round (\d+): 1 stages A ([\d.]+), 1 stages B ([\d.]+)$", run.stdout, re.M)
    assert [r[0] for r in rounds] == ["0", "1"], run.stdout
    summary = re.search(r"^1 stages: A ([\d.]+) B ([\d.]+) ms/token \(medians\); A/B per round ([\d.]+) ± ([\d.]+) "
                        r"\(mean ± 2 s\.e\.\), ([012]) of 2 B faster; hop latency A \d+ B \d+ us", run.stdout, re.M)
    assert summary, run.stdout
    ratios = [float(a) / float(b) for _, a, b in rounds]
    assert abs(float(summary[3]) - sum(ratios) / 2) < 1e-3 + 0.01 * max(ratios), (summary[3], ratios)
    # the rounds' figures are printed rounded: a ratio within 0.5 % of 1 may have gone either way
    assert sum(r > 1.005 for r in ratios) <= int(summary[5]) <= sum(r > 0.995 for r in ratios)
