"""Recording one generation's batch schedule at the head (``GenerateRequest.record_schedule``).

The scheduler tells the recorder each entry it sends for the task (``sent``), what came back for it
(``returned``, or ``failed``), and each token it hands to the client (``emit``, attributed to the
step whose outputs are being taken); the generator returns the finished :class:`Schedule` as JSON
with the generation's last message. Entries of a recorded task ask the final stage for a digest of
every logit row it samples (``StepEntry.digest_logits``), which ``replay`` compares bit for bit.

Only the scheduler's worker that owns the task touches its recorder while it runs; the handler
reads the schedule once the worker has let the task go (``settle``: nothing of it in flight any
more — a generation can end while windows chained behind its last one are still out, and their
outputs belong in the record).
"""

from __future__ import annotations

import threading

from skippy_stage.model.digest import digest_hex
from skippy_stage.model.schedule import (
    ROWS_ALL,
    ROWS_LAST,
    ROWS_NONE,
    SAMPLE_LAST,
    SAMPLE_NONE,
    SAMPLE_VERIFY,
    Schedule,
    ScheduleStep,
)
from skippy_stage.stage.steps import Output, StepEntry


class ScheduleRecorder:
    """The schedule of one task, as its steps go out and come back."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._session_id: str | None = None
        self._session = -1
        # The step whose outputs the scheduler is taking: the tokens it emits are this step's.
        self.current: ScheduleStep | None = None
        self._settled = threading.Event()

    def sent(self, entry: StepEntry, batch_rows: int) -> ScheduleStep:
        """``entry`` left in a batch of ``batch_rows`` rows; it asks for digests of its samples."""
        if entry.session_id != self._session_id:  # the first step, or a recovery's new session
            self._session_id = entry.session_id
            self._session += 1
        entry.digest_logits = entry.sample_last
        every_row = entry.all_rows or entry.verify or entry.prompt_logprobs is not None
        step = ScheduleStep(
            index=len(self.schedule.steps), session=self._session, start=int(entry.positions[0]),
            tokens=[int(t) for t in entry.token_ids], rewind=entry.rewind,
            rows=ROWS_ALL if every_row else ROWS_LAST if entry.sample_last or entry.want_logits else ROWS_NONE,
            sample=SAMPLE_VERIFY if entry.verify else SAMPLE_LAST if entry.sample_last else SAMPLE_NONE,
            continues=entry.continues, draws_before=entry.draws_before if entry.sample_last else 0,
            batch_rows=batch_rows,
        )
        self.schedule.steps.append(step)
        return step

    def returned(self, step: ScheduleStep, out: Output, *, stale: bool = False) -> None:
        """What the final stage sampled for ``step`` (and whether the head drops it as stale); the
        step is the one whose tokens ``emit`` records next."""
        if out.tokens is not None:
            step.samples = [int(t) for t in out.tokens]
        elif out.token is not None:
            step.samples = [int(out.token)]
        step.digests = [digest_hex(d) for d in out.logit_digests or ()]
        step.stale = stale
        self.current = step

    @staticmethod
    def failed(step: ScheduleStep, error: BaseException) -> None:
        step.failed = str(error) or type(error).__name__

    def emit(self, token: int) -> None:
        """The head handed ``token`` to the client."""
        self.schedule.completion.append(int(token))
        if self.current is not None:
            self.current.emitted.append(int(token))

    def settle(self) -> None:
        """The scheduler let the task go: nothing of it is in flight, the record is complete."""
        self._settled.set()

    def finish(self, reason: str, *, wait_s: float) -> str:
        """The schedule as JSON, once the generation ended with ``reason`` and the scheduler let it
        go (at most ``wait_s``: a record then ends with the steps that came back)."""
        self._settled.wait(wait_s)
        self.schedule.finish = reason
        return self.schedule.to_json()
