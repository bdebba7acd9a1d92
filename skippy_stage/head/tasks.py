"""A generation as the head's scheduler runs it (``Task``), and the events its handler receives:
each sampled token (bare, or a ``Sampled`` with its log-probabilities; several at once as
``Tokens``), the prompt's log-probabilities, then its ``End`` or ``Failed``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from skippy_stage.errors import SkippyError
from skippy_stage.head.drafting import DraftBudget, Drafter
from skippy_stage.head.events import Events
from skippy_stage.head.recording import ScheduleRecorder
from skippy_stage.head.windows import Window, WindowDepth
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.model.projector import MediaSpan
from skippy_stage.model.sampling import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class End:
    """The last event of a task: why it finished."""

    reason: str


@dataclass(frozen=True)
class Failed:
    error: SkippyError


@dataclass(frozen=True)
class Sampled:
    """A sampled token with its log-probabilities (events are bare ints when none were asked)."""

    token: int
    logprob: TokenLogprob


@dataclass(frozen=True)
class Tokens:
    """Several sampled tokens delivered at once (``stream_interval_s``), each an int or a Sampled."""

    items: tuple[int | Sampled, ...]


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens with their log-probabilities (None for the first: nothing precedes it),
    before the first sampled token (OpenAI's echo with logprobs)."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]


@dataclass
class Task:
    """One generation as the scheduler sees it; events flow to the waiting handler."""

    session_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    events: Events = field(default_factory=Events)
    prefilled: int = 0
    generated: int = 0
    last_token: int | None = None
    # Every token the chain has been fed for this session: the prompt, then each sampled
    # token once the next step carries it. A recovery re-prefills it as ``replay``.
    history: list[int] = field(default_factory=list)
    replay: list[int] | None = None
    # Set while the session waits for the chain to come back; the error to give up with.
    recovering: SkippyError | None = None
    failing_since: float | None = None
    # Session ids this task used before a recovery; some stage below may still hold them.
    stale_sessions: list[str] = field(default_factory=list)
    recoveries: int = 0
    # A resident prefix claimed at admission: the first prefill entry names it, and the prompt's
    # first ``cached_tokens`` come from its KV. Cleared once a step carried it through the chain.
    prefix_id: str | None = None
    cached_tokens: int = 0
    failed: bool = False  # its session's state is uncertain: freed, never kept as a prefix
    # Speculative decoding: who drafts (None: no speculation), how many at most now, and how many
    # the step under way carries.
    drafter: Drafter | None = None
    draft_budget: DraftBudget | None = None
    drafted: int = 0
    # Log-probabilities of each sampled token and this many alternatives (None: none).
    top_logprobs: int | None = None
    # Log-probabilities of the prompt's tokens too, with this many alternatives (None: not asked);
    # gathered by position as the prompt's chunks come back.
    prompt_logprobs: int | None = None
    prompt_lps: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_lps_sent: bool = False
    # Samples the final stage took for this task (every sampled token received, drafts' verify rows
    # and an ending token included): a sampler rebuilt below skips as many seeded draws.
    samples: int = 0
    # n choices of one prompt: the first (the source) prefills all but the prompt's last token and
    # holds there (``hold_at``) until its ``forks`` join it; each fork then starts as a copy of the
    # source's KV on every stage (``fork_of``) and feeds that last token itself, in the same step.
    forks: list[Task] = field(default_factory=list)
    fork_from: Task | None = None
    hold_at: int | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    delivered_at: float = float("-inf")  # when its handler was last handed tokens
    stream_interval_s: float | None = None  # its request's own (None: SchedulerLimits.stream_interval_s)
    # Records the batch schedule the pipeline runs for it (``record_schedule``; None: not asked).
    schedule: ScheduleRecorder | None = None
    # Its entries in flight, oldest first, while the scheduler keeps windows in flight for it; and how
    # many windows pay (None: one step at a time).
    windows: list[Window] = field(default_factory=list)
    depth: WindowDepth | None = None
    window_depth: int | None = None  # its request's bound on windows in flight (None: the head's)
    arrived_at: float | None = None  # when its last step's outputs arrived (perf_counter)
    # Its prompt's images, in order: each one's rows enter the head's layers at its positions, where
    # ``prompt`` holds the image's keys (negative, never token ids; a resident prefix matches on them).
    media: tuple[MediaSpan, ...] = ()
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def stale_windows(self) -> int:
        """Every window in flight is stale (one before them was cut short); how many were not yet."""
        count = 0
        for window in self.windows:
            count += not window.stale
            window.stale = True
        return count

    def cancel(self) -> None:
        """Ask the scheduler to stop this task and free its session (idempotent)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def reserve(self, max_context: int) -> int:
        """KV cells to hold for it: prompt and answer, and the drafts a last step may carry past them."""
        drafts = self.draft_budget.k if self.draft_budget is not None else 0
        return min(len(self.prompt) + self.max_tokens + drafts, max_context)

    @property
    def to_feed(self) -> list[int]:
        """Tokens to prefill: the prompt, or after a recovery everything fed before."""
        return self.prompt if self.replay is None else self.replay
