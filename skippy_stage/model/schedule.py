"""A generation's batch schedule: what the pipeline actually ran for one session, step by step.

Exactness used to be "the same text as llama-cpp-python's own loop", which holds only while the
pipeline's batches are the reference's. Speculative windows kept in flight make the batches'
shapes depend on timing (how many windows are out, which turn stale), so the contract becomes:
*the pipeline computes exactly what the unsplit model computes for the batches it ran*. A
schedule records those batches, and ``replay`` runs them on the unsplit model in one process.

Per step (one ``IterationBatch`` entry of this session; every stage runs the same entry): the
first position and the token ids fed, whether every stage first cut the session back to that
position (``rewind``: the absolute position each stage trims to), which rows the final stage
computed as outputs and which it sampled (one, or every row of a verify window, stopping at the
first rejected draft), the samples and a digest of each sampled logit row (``digest``), and the
tokens the head took from the step — none from a stale window. Plus what a replay needs to build
the same context (the head's settings, the KV cells the runtime gave it) and to sample the same
way (the sampling settings), and the completion the client was sent.

A JSON document (``to_json`` / ``from_json``), versioned; no llama.cpp or gRPC here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from skippy_stage.config import StageConfig
from skippy_stage.errors import InvalidRequestError
from skippy_stage.model.sampling import SamplingParams

SCHEDULE_VERSION = 1

# What the final stage computed as output rows, and what it sampled.
ROWS_ALL, ROWS_LAST, ROWS_NONE = "all", "last", "none"
SAMPLE_NONE, SAMPLE_LAST, SAMPLE_VERIFY = "none", "last", "verify"

# The head's settings a replay's context must share (StageConfig field names); ``ctx_size`` is the
# KV cells the runtime actually made, whatever the config said.
CONTEXT_FIELDS = ("ctx_size", "lane_count", "kv_unified", "n_batch", "n_ubatch", "n_threads", "n_threads_batch",
                  "n_gpu_layers", "flash_attn_type", "cache_type_k", "cache_type_v", "swa_full", "repack",
                  "kv_offload", "op_offload", "wire_dtype")


@dataclass
class ScheduleStep:
    """One step of the session: its entry as every stage ran it, and what came of it."""

    index: int  # the step's place in the schedule (what a replay names when it differs)
    session: int  # 0, then 1, 2 … after each recovery (a new session re-prefilled from position 0)
    start: int  # positions[0]; the entry covers start .. start + len(tokens) - 1
    tokens: list[int]
    rewind: bool = False  # every stage first dropped the session's KV from ``start`` on
    rows: str = ROWS_LAST  # the final stage's output rows
    sample: str = SAMPLE_NONE
    # The window went out before the previous one came back: the final stage samples it only if its
    # first token is the session's last sample at that position (else it is stale: no samples).
    continues: bool = False
    draws_before: int = 0  # samples the session took before (a sampler rebuilt here skips them)
    batch_rows: int = 0  # rows of the whole batch the entry travelled in (other sessions' too)
    samples: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)  # one per sample (``digest.digest_hex``)
    emitted: list[int] = field(default_factory=list)  # the tokens the head took from this step
    stale: bool = False  # the head dropped its outputs (a window after a rejection)
    failed: str = ""  # the step did not come back (the error); a recovery re-prefills after it


@dataclass
class Schedule:
    """The whole record of one generation (see the module docstring)."""

    model: str  # the model file's name (a replay is told the path)
    context: dict[str, Any]
    sampling: dict[str, Any]
    prompt: list[int]
    max_tokens: int
    max_context: int  # KV cells one session may hold (a generation ends with "length" there)
    speculative: dict[str, Any] = field(default_factory=dict)  # how it drafted (for people; not replayed)
    steps: list[ScheduleStep] = field(default_factory=list)
    completion: list[int] = field(default_factory=list)  # the tokens the client was sent
    finish: str = ""
    version: int = SCHEDULE_VERSION

    def sampling_params(self) -> SamplingParams:
        values = dict(self.sampling)
        values["logit_bias"] = tuple((int(t), float(b)) for t, b in values.get("logit_bias", ()))
        return SamplingParams(**values)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Refuses a document that is not a schedule of this version, naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"schedule: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidRequestError("schedule: a JSON object is expected")
        if raw.get("version") != SCHEDULE_VERSION:
            raise InvalidRequestError(f"schedule: version={raw.get('version')!r}, this build reads "
                                      f"{SCHEDULE_VERSION}")
        try:
            steps = [ScheduleStep(**s) for s in raw.pop("steps", [])]
            schedule = cls(**raw, steps=steps)
        except TypeError as exc:
            raise InvalidRequestError(f"schedule: {exc}") from None
        for i, step in enumerate(schedule.steps):
            if step.rows not in (ROWS_ALL, ROWS_LAST, ROWS_NONE) or step.sample not in (SAMPLE_NONE, SAMPLE_LAST,
                                                                                        SAMPLE_VERIFY):
                raise InvalidRequestError(f"schedule: steps[{i}] has rows={step.rows!r} sample={step.sample!r}")
            if not step.tokens or step.start < 0:
                raise InvalidRequestError(f"schedule: steps[{i}] feeds {len(step.tokens)} tokens at {step.start}")
        return schedule


def context_of(cfg: StageConfig, n_ctx: int) -> dict[str, Any]:
    """The head's settings a replay's context must share; ``n_ctx``: the KV cells it holds."""
    values = {name: getattr(cfg, name) for name in CONTEXT_FIELDS}
    values["ctx_size"] = n_ctx
    return values


def sampling_of(params: SamplingParams) -> dict[str, Any]:
    values = dataclasses.asdict(params)
    values["logit_bias"] = [list(pair) for pair in params.logit_bias]
    return values
