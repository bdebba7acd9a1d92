"""What every bench phase sends and how much of it: the prompt, token counts, rounds and splits.

SKIPPY_BENCH_QUICK=1 shrinks every run (the test suite uses it to check the report's shape).
"""

from __future__ import annotations

import os

QUICK = os.environ.get("SKIPPY_BENCH_QUICK") == "1"
DECODE_TOKENS = 16 if QUICK else 128
AGG_TOKENS = 8 if QUICK else 64
# Five rounds (medians): on a busy 2-vCPU host one round of a 3-stage decode can take 2x the next.
DECODE_ROUNDS = 1 if QUICK else 5
PREFILL_TOKENS = 64 if QUICK else 512
CONCURRENCY = (1, 4, 8)
# The 3-stage split every 3-stage figure runs.
THREE = [(0, 10), (10, 20), (20, 30)]
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
