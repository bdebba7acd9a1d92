"""``skippy-stage bench``: what a split costs, as ratios against the unsplit model, in one run.

Everything runs here, now, on the packaged SmolLM2: the single-process llama-cpp-python
baseline and real pipelines of ``serve`` processes on loopback, with the same thread
budget on both sides (all cores for the single process and for each stage: only the stage
holding the token computes). Single-stream decode runs in interleaved rounds, medians
reported. The numbers are reported, never asserted: machines are noisy, so only same-run
ratios mean anything.

``report`` runs the sections chosen (``BenchPlan``; all by default) in turn and assembles the report;
``table`` prints it. Each section has a module: ``decode`` (single stream), ``batched`` (prefill and
concurrency), ``chat`` (the prefix cache), ``speculative``, ``images`` (the head's projector: an
image's encode and the first token after it), ``mtp`` (the final stage's multi-token-prediction
drafts, on a model with next-n layers), ``repack``, ``floors`` (a hop with no model) and ``wan``
(the 3-stage split over emulated links, at each delay). They
share ``workload`` (what is sent), ``pipeline`` (the pipelines measured), ``quiet_client``
(the decode figures' client) and ``readings`` (CPU and metrics read off the processes).
"""

from __future__ import annotations

from skippy_stage.cli.bench.decode import HEADLINE_CONTENDERS
from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze, wake_latency_setting
from skippy_stage.cli.bench.quiet_client import QuietClient, quiet_client_loop
from skippy_stage.cli.bench.readings import _histogram_sums, hop_latency_median_us
from skippy_stage.cli.bench.report import SECTIONS, BenchPlan, run
from skippy_stage.cli.bench.table import format_table
from skippy_stage.cli.bench.wan import WanSetup
from skippy_stage.cli.bench.workload import PROMPT

# ``run``, its plan and ``format_table`` are the command's; the rest, the parts the other measuring commands reuse.
__all__ = ["HEADLINE_CONTENDERS", "PROMPT", "SECTIONS", "BenchPlan", "QuietClient", "WanSetup", "_Pipeline", "_awake",
           "_histogram_sums", "after_freeze", "format_table", "hop_latency_median_us", "quiet_client_loop", "run",
           "wake_latency_setting"]
