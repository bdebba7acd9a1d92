"""Speculative decoding at the head: who drafts the next tokens, and how many to draft.

A drafter proposes up to k tokens after a session's last sampled one; the step carries the
last token and the drafts through every stage in one batch, and the final stage samples every
row, stopping at the first sample that differs from the draft after it (``verify``). The
drafters here are deterministic (a proposal is a single token, not a distribution), and for
such drafts "sample the row and keep the draft if the sample equals it" *is* the standard
speculative-sampling acceptance rule: the draft d is kept with probability p(d), and otherwise
the token emitted is distributed as p with d removed and renormalised, so every emitted token
is distributed as the target model's p, at any temperature. Greedy runs are exact.

- ``ngram``: prompt lookup, no model: llama-cpp-python's own ``LlamaPromptLookupDecoding`` (the
  reference the tests hold the pipeline to) with a fixed k; with adaptive drafting (k "auto"), the
  occurrence whose context agrees furthest back (``lookup_by_context``).
- ``model``: a small GGUF at the head with the target's vocabulary, run with llama-cpp-python,
  drafting greedily.
- ``mtp``: the model's own multi-token-prediction layers, at the final stage (``native_mtp_enabled``):
  with each sample it returns their greedy guess of the next token, which the head sends as the
  next step's one draft (``ReturnedDraft``). Nothing runs at the head.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from skippy_stage.config import SpeculativeConfig
from skippy_stage.errors import ConfigError, InvalidRequestError
from skippy_stage.model.batch import NO_DRAFT
from skippy_stage.model.tokenizer import Tokenizer

log = structlog.get_logger("skippy_stage.drafting")

# A drafter: up to k tokens to follow a session's history (its tokens so far, the last sampled
# one included).
Drafter = Callable[[list[int], int], list[int]]


@dataclass(frozen=True)
class SpeculativeRequest:
    """A request's own speculative settings (unset: the head's)."""

    drafter: str | None = None
    k: int | str | None = None  # a number (fixed drafting) or "auto" (adaptive)
    ngram: int | None = None
    adaptive: bool | None = None
    window_depth: int | None = None  # most windows in flight (at most the head's verify_window_depth)

    def over(self, base: SpeculativeConfig) -> SpeculativeConfig:
        """These settings over the head's, refused by field (INVALID_ARGUMENT)."""
        spec = base.override(drafter=self.drafter, k=self.k, ngram=self.ngram, adaptive=self.adaptive)
        if (problem := spec.problem()) is not None:
            raise InvalidRequestError(f"speculative.{problem}")
        return spec


class NgramDrafter:
    """Prompt lookup. ``by_context`` off: exactly as llama-cpp-python does it (its reference
    implementation, which takes the *earliest* earlier occurrence of the last n tokens); on (the
    adaptive mode): see :func:`lookup_by_context`."""

    def __init__(self, ngram: int, *, by_context: bool = False) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._find = LlamaPromptLookupDecoding.find_candidate_pred_tokens
        self.ngram = ngram
        self.by_context = by_context

    def __call__(self, history: list[int], k: int) -> list[int]:
        if k <= 0 or len(history) < 2:
            return []
        ids = np.asarray(history, dtype=np.intc)
        if self.by_context:
            return lookup_by_context(ids, self.ngram, k)
        found = self._find(ids, max_ngram_size=self.ngram, num_pred_tokens=k)
        return [int(t) for t in found]


# How far back the tokens before an occurrence are compared with those before the last n.
CONTEXT_WINDOW = 64


def lookup_by_context(ids: np.ndarray, ngram: int, k: int) -> list[int]:
    """The continuation of the earlier occurrence of the last n tokens (n from ``ngram`` down to 1,
    the same candidates as the reference) whose *preceding* tokens agree furthest back with those
    before the last n (up to CONTEXT_WINDOW; among equals the latest).

    In a text that quotes or repeats a passage, a short n-gram (", and", "of the") occurs at many
    places; the earliest is as likely wrong as right, and a wrong pick costs a trip of rejected
    rows. The place whose context matches is where the quote is. Simulated on ``bench``'s
    repetitive prompt with the adaptive budget: 5.0 tokens per trip against the reference's 4.75."""
    n = len(ids)
    for size in range(min(ngram, n - 1), 0, -1):
        tail = ids[n - size :]
        windows = np.lib.stride_tricks.sliding_window_view(ids, size)
        found = np.flatnonzero((windows == tail).all(axis=1))
        found = found[found + size < n - size]  # as the reference: a continuation that starts before the tail
        if found.size == 0:
            continue
        best = int(found[0])
        if found.size > 1:
            back = np.arange(1, CONTEXT_WINDOW + 1)
            mine, theirs = n - size - back, found[:, None] - back
            same = (theirs >= 0) & (mine >= 0) & (ids[np.maximum(theirs, 0)] == ids[np.maximum(mine, 0)])
            agree = np.cumprod(same, axis=1).sum(axis=1)
            best = int(found[np.flatnonzero(agree == agree.max())[-1]])
        return [int(t) for t in ids[best + size : best + size + k]]
    return []


class ModelDrafter:
    """A small model at the head drafting greedily, with llama-cpp-python (its KV keeps the longest
    common prefix of the last history it saw, so a session's next draft evaluates only what is new)."""

    def __init__(self, model_path: str, *, n_ctx: int, n_threads: int, target: Tokenizer) -> None:
        from skippy_stage.model.loader import reference_llama

        self.model_path = model_path
        self.n_ctx = n_ctx
        try:
            self._llm = reference_llama(model_path, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=n_threads,
                                        verbose=False)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"speculative.model_path={model_path!r} cannot be loaded: {exc}") from None
        self._lock = threading.Lock()
        mine = Tokenizer(self._llm._model.model)
        n_vocab, want = self._llm.n_vocab(), target.n_vocab
        if n_vocab != want:
            self.close()
            raise ConfigError(f"speculative.model_path={model_path!r} has a vocabulary of {n_vocab} tokens, the target "
                              f"model {want}: a draft model must share the target's vocabulary")
        for token in range(n_vocab):
            if mine.token_bytes(token) != target.token_bytes(token):
                self.close()
                raise ConfigError(f"speculative.model_path={model_path!r}: token {token} is "
                                  f"{mine.token_bytes(token)!r} there and {target.token_bytes(token)!r} in the target "
                                  f"model: a draft model must share the target's vocabulary")

    def __call__(self, history: list[int], k: int) -> list[int]:
        k = min(k, self.n_ctx - len(history) - 1)
        if k <= 0 or not history:
            return []
        out: list[int] = []
        with self._lock:
            if self._llm is None:
                return []
            for token in self._llm.generate(history, temp=0.0, top_k=1, reset=True):
                out.append(int(token))
                if len(out) >= k:
                    break
        return out

    def close(self) -> None:
        """Under the lock: a worker still drafting finishes first (the scheduler's join may time out)."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            llm, self._llm = getattr(self, "_llm", None), None
        else:
            with lock:
                llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()


@dataclass
class DraftBudget:
    """Adaptive k for one session. A drafted row costs the chain about a third to a half of a
    one-row trip on a CPU (``bench``: the layers and the output head run on every row), and saves a
    trip when it is kept. So the session drafts ``START`` tokens, two more after a step whose
    drafts were all kept (up to ``k``: a quote or a code edit keeps dozens in a row) and half as
    many after a rejection (mostly the text has left the pattern it followed, as at the end of a
    quote: the next trips should not carry nearly as many rows again); and while the share of
    drafted tokens kept (an average over the last steps) is below ``FLOOR`` it stops drafting,
    drafting one token every ``PROBE_EVERY`` steps to notice when its text turns repetitive.
    Off (a fixed k): always k, as llama-cpp-python's draft models are asked."""

    k: int
    adaptive: bool
    kept: float = 1.0  # moving average of accepted / drafted per step
    idle_steps: int = 0
    now: int = 0  # adaptive: tokens to draft next while drafting pays (set on first use)
    FLOOR = 0.4
    PROBE_EVERY = 8
    WEIGHT = 0.3
    START = 4
    GROW = 2

    def next_k(self) -> int:
        if not self.adaptive:
            return self.k
        if self.kept < self.FLOOR:
            self.idle_steps += 1
            return 1 if self.idle_steps % self.PROBE_EVERY == 0 else 0
        if self.now == 0:
            self.now = min(self.k, self.START)
        return self.now

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.kept += self.WEIGHT * (accepted / drafted - self.kept)
        if self.adaptive:
            now = self.now or min(self.k, self.START)
            self.now = min(self.k, now + self.GROW) if accepted == drafted else max(1, now // 2)


class ReturnedDraft:
    """The drafter of one session whose final stage drafts (``mtp``): the draft that came back with its
    last sample, offered once, for the history it was drafted after (``offer``). Any other history (a
    window chained behind one in flight guesses further ahead) gets none."""

    def __init__(self) -> None:
        self._after: int | None = None
        self._draft: int | None = None

    def offer(self, history_length: int, draft: int) -> None:
        """``draft`` follows a history of ``history_length`` tokens (the last sample its last); ``NO_DRAFT``:
        none this time."""
        self._after, self._draft = (history_length, draft) if draft != NO_DRAFT else (None, None)

    def __call__(self, history: list[int], k: int) -> list[int]:
        if k < 1 or self._draft is None or len(history) != self._after:
            return []
        draft, self._after, self._draft = self._draft, None, None
        return [draft]


class Drafters:
    """The head's drafters: one prompt-lookup drafter per n-gram size and lookup (stateless, made on
    first use) and the draft model, if its config loads one."""

    def __init__(self, model: ModelDrafter | None = None) -> None:
        self.model = model
        self._ngram: dict[tuple[int, bool], NgramDrafter] = {}
        self._lock = threading.Lock()

    def for_spec(self, spec: SpeculativeConfig) -> Drafter | None:
        if spec.drafter == "ngram":
            with self._lock:
                key = (spec.ngram, spec.adaptive)
                return self._ngram.setdefault(key, NgramDrafter(spec.ngram, by_context=spec.adaptive))
        if spec.drafter == "mtp":
            return ReturnedDraft()  # one per session: it holds that session's draft
        if spec.drafter == "model":
            if self.model is None:
                raise InvalidRequestError("speculative.drafter='model': this head has no draft model "
                                          "(set speculative.model_path in its config)")
            return self.model
        return None

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
