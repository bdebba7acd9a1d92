"""What the next shared step carries: decode entries first (latency), then prompt chunks within
the token budget and the final stage's output rows; a speculating session's drafts, and the windows
it chains behind those still in flight (``chain_window``); a prompt's forks joining their source at
its last token. Bookkeeping on the tasks alone (no threads, locks
or network): the scheduler's workers call it for their group each step."""

from __future__ import annotations

import numpy as np

from skippy_stage.head.tasks import Task
from skippy_stage.head.windows import Window
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.projector import PLACEHOLDER_TOKEN
from skippy_stage.stage.steps import PHASE_DECODE, PHASE_PREFILL, StepEntry


def plan_step(batch: list[Task], *, n_batch: int, n_ubatch: int,
              max_context: int) -> tuple[list[StepEntry], list[tuple[Task, int]]]:
    """Decode entries first (latency), then prompt chunks within the token budget, and within
    the final stage's output rows (n_ubatch per batch: a verify entry and a speculating
    session's prompt chunk output every row)."""
    budget = n_batch
    outputs = n_ubatch
    entries: list[StepEntry] = []
    plan: list[tuple[Task, int]] = []
    for task in batch:
        if task.recovering is not None:
            continue
        if task.prefilled == len(task.to_feed) and task.last_token is not None and budget > 0 and outputs > 0:
            position = len(task.prompt) + task.generated - 1
            drafts = _draft(task, position, min(budget, outputs) - 1, max_context)
            n = 1 + len(drafts)
            entries.append(StepEntry(session_id=task.session_id, phase=PHASE_DECODE,
                                     positions=range(position, position + n), token_ids=[task.last_token, *drafts],
                                     sample_last=True, sampling=task.sampling,
                                     rewind=task.drafter is not None, verify=bool(drafts),
                                     top_logprobs=task.top_logprobs, draws_before=task.samples))
            plan.append((task, 0))
            budget -= n
            outputs -= n
    for task in batch:
        if _source(task) is not None:
            continue  # it joins its source's step
        feed = task.to_feed
        hold = _hold(task)
        remaining = (len(feed) if hold is None else hold) - task.prefilled
        every_row = _every_row(task, task.prefilled)
        if task.recovering is not None or budget <= 0 or outputs <= 0:
            continue
        if hold is not None and remaining == 0:
            taken = _fork_entries(task, hold, budget, outputs, entries, plan, batch)
            budget -= taken
            outputs -= taken
            continue
        if remaining <= 0:
            continue
        n = min(remaining, n_ubatch, budget, outputs if every_row else budget)
        start = task.prefilled
        if task.replay is not None:
            # Re-feed tokens as they were first computed: llama.cpp's kernels differ between
            # one-token and larger batches (up to 0.6 in a logit on an AVX2 EPYC), so KV
            # rebuilt in one big batch could steer a greedy text elsewhere. The prompt goes in
            # chunks as before, each generated token in a step of its own.
            n = min(n, len(task.prompt) - start) if start < len(task.prompt) else 1
        n = media_cut(task, start, n)
        entry = _prefill_entry(task, start, n, every_row=every_row, prefix_id=task.prefix_id)
        entries.append(entry)
        plan.append((task, n))
        budget -= n
        outputs -= n if every_row else int(entry.sample_last)
    return entries, plan


def _every_row(task: Task, start: int) -> bool:
    """Whether a prefill chunk of ``task`` from ``start`` computes logits for every row: a reference
    computing logits for every row (speculation, logprobs) has these shapes; so do the prompt's
    chunks when its logprobs are asked."""
    return task.drafter is not None or task.top_logprobs is not None \
        or (task.prompt_logprobs is not None and start < len(task.prompt))


def media_cut(task: Task, start: int, n: int) -> int:
    """``n`` cut so the chunk from ``start`` is text alone or one image's rows alone: a llama_batch
    carries token ids or embedding rows, and the one-process reference feeds each image as its own
    batch (llama-cpp-python's multimodal handler, mtmd_helper_eval_chunk_single)."""
    for span in task.media:
        if start < span.start:
            return min(n, span.start - start)
        if start < span.end:
            return min(n, span.end - start)
    return n


def media_rows(task: Task, start: int, n: int) -> tuple[np.ndarray, ImageGrid | None] | None:
    """The image rows at ``start .. start + n`` (a chunk ``media_cut`` made) and, for an M-RoPE image,
    where they sit on its grid; None for text."""
    for span in task.media:
        if span.start <= start < span.end:
            grid = None if span.grid is None else ImageGrid(*span.grid, first_row=start - span.start)
            return span.rows[start - span.start : start - span.start + n], grid
    return None


def image_start(task: Task, row: int) -> int:
    """``row``, or where the M-RoPE image it falls strictly inside starts: such an image's rows share
    one model position, so a session is never cut (a prefix kept, a fork copied) inside one."""
    for span in task.media:
        if span.grid is not None and span.start < row < span.end:
            return span.start
    return row


def _tokens_and_rows(task: Task, feed: list[int], start: int,
                     n: int) -> tuple[list[int], np.ndarray | None, ImageGrid | None]:
    """What an entry feeding ``feed[start:start + n]`` carries: the tokens, or for an image's rows the
    rows, a placeholder token each (``feed`` holds the image's keys there, never token ids) and the
    grid they sit on where the image takes M-RoPE positions."""
    found = media_rows(task, start, n)
    if found is None:
        return feed[start : start + n], None, None
    return [PLACEHOLDER_TOKEN] * n, *found


def _prefill_entry(task: Task, start: int, n: int, *, every_row: bool, prefix_id: str | None) -> StepEntry:
    """The entry feeding ``task``'s ``to_feed[start:start + n]``; it samples when it is the last."""
    feed = task.to_feed
    # After a recovery the next input token is already known: do not sample again.
    last = start + n == len(feed) and task.last_token is None
    in_prompt = task.prompt_logprobs is not None and start < len(task.prompt)
    tokens, rows, grid = _tokens_and_rows(task, feed, start, n)
    return StepEntry(session_id=task.session_id, phase=PHASE_PREFILL,
                     positions=range(start, start + n), token_ids=tokens,
                     sample_last=last, sampling=task.sampling, prefix_id=prefix_id,
                     top_logprobs=task.top_logprobs if last else None,
                     all_rows=every_row, prompt_logprobs=task.prompt_logprobs if in_prompt else None,
                     next_token=feed[start + n] if in_prompt and start + n < len(task.prompt) else None,
                     draws_before=task.samples if last else 0, embd=rows, image=grid)


def prefill_ahead(task: Task, *, n_ubatch: int, chunks: int) -> bool:
    """Whether ``task``'s prompt has a chunk to send before those in flight come back: more than one
    chunk of it is still to be fed when none is in flight, or its chunks in flight (fewer than
    ``chunks``) are all prompt that samples nothing and more of the prompt follows them. Not for a
    recovery's replay (its steps keep their first shapes) or a prompt that waits for its forks."""
    if chunks < 2 or task.replay is not None or task.hold_at is not None or task.cancelled \
            or task.recovering is not None or task.last_token is not None:
        return False
    windows = live_windows(task)
    if not windows:
        return len(task.to_feed) - task.prefilled > n_ubatch
    # A chunk that names a resident prefix may be refused for it (the prefix was evicted): the
    # prompt then starts over, so nothing follows it until it came back.
    if task.prefix_id is not None or len(windows) >= chunks or any(w.decode or w.samples for w in windows):
        return False
    last = windows[-1]
    return last.start + len(last.tokens) < len(task.to_feed)


def chain_prefill(task: Task, *, room: int, outputs: int, n_ubatch: int,
                  chunks: int) -> tuple[StepEntry, Window] | None:
    """The next chunk of ``task``'s prompt, sent behind its chunks in flight (``prefill_ahead``): the
    chunk the head would send once they came back, so the batches are those of one chunk at a time
    while the stages work on several (stage 0 computes chunk 2 while chunk 1 crosses the link).
    None when there is none to send or no room in this step."""
    if not live_windows(task) or not prefill_ahead(task, n_ubatch=n_ubatch, chunks=chunks):
        return None
    last = live_windows(task)[-1]
    start = last.start + len(last.tokens)
    every_row = _every_row(task, start)
    n = media_cut(task, start, min(len(task.to_feed) - start, n_ubatch, room, outputs if every_row else room))
    if n <= 0:
        return None
    entry = _prefill_entry(task, start, n, every_row=every_row, prefix_id=None)
    if entry.sample_last and not every_row and outputs < 1:
        return None
    return entry, Window(start=start, tokens=[int(t) for t in entry.token_ids], n_prefill=n, drafted=0,
                         samples=entry.sample_last)


def _source(task: Task) -> Task | None:
    """The session ``task`` will start as a copy of, while that is still on; else None (and it
    prefills the prompt itself, as after a recovery of either)."""
    source = task.fork_from
    if source is None:
        return None
    if (source.cancelled or source.recovering is not None or source.replay is not None or source.hold_at is None
            or task.cancelled or task.recovering is not None or task.replay is not None):
        task.fork_from = None
        return None
    return source


def _hold(task: Task) -> int | None:
    """Where ``task``'s prefill waits for its forks (None: it does not, or no longer)."""
    if task.hold_at is not None and (task.replay is not None
                                     or not any(_source(f) is task for f in task.forks)):
        task.hold_at = None
    return task.hold_at


def _fork_entries(source: Task, hold: int, budget: int, outputs: int, entries: list[StepEntry],
                  plan: list[tuple[Task, int]], batch: list[Task]) -> int:
    """The step that feeds the prompt's last token to ``source`` and to each fork of this step's
    batch (a freed one is in no batch), which starts as a copy of ``source``'s KV up to it: one row
    and one sample each. Returns the rows taken (0: not this step, the batch is too full)."""
    family = [source, *(f for f in source.forks if f in batch and _source(f) is source)]
    if len(family) > min(budget, outputs):
        return 0
    for member in family:
        tokens, rows, grid = _tokens_and_rows(member, member.prompt, hold, 1)
        entries.append(StepEntry(session_id=member.session_id, phase=PHASE_PREFILL,
                                 positions=range(hold, hold + 1), token_ids=tokens, embd=rows, image=grid,
                                 sample_last=True, sampling=member.sampling, top_logprobs=member.top_logprobs,
                                 all_rows=member.drafter is not None or member.top_logprobs is not None,
                                 fork_of=None if member is source else source.session_id))
        plan.append((member, hold + 1 - member.prefilled))
    return len(family)


def _draft(task: Task, position: int, room: int, max_context: int) -> list[int]:
    """The tokens ``task`` drafts to follow its last one this step (llama-cpp-python's schedule:
    drafted from every token so far, the last sampled one included, as many as the drafter
    gives up to k, capped only by the session's KV cells and the batch)."""
    task.drafted = 0
    if task.drafter is None or task.draft_budget is None:
        return []
    k = min(task.draft_budget.next_k(), room, max_context - position - 1)
    if k <= 0:
        return []
    drafts = task.drafter([*task.history, task.last_token], k)[:k]
    task.drafted = len(drafts)
    return drafts


def live_windows(task: Task) -> list[Window]:
    """``task``'s windows in flight that are not stale, oldest first."""
    return [w for w in task.windows if not w.stale]


def chain_window(task: Task, *, room: int, max_context: int) -> tuple[StepEntry, Window] | None:
    """The window to send behind ``task``'s live windows, on the guess that they are all kept: the
    drafter's guess of the sample after them (from the optimistic history: what the live windows
    feed, the drafts included), then the drafts that follow the guess, as many as a window drafts —
    exactly the window the head would send once the guess came back right, so whatever comes back
    whole, the batches are those of one window at a time (llama-cpp-python's prompt lookup, with a
    number k). Behind a prompt's last chunk too: the
    first window then leaves without waiting for the first token. None when there is nothing to
    chain: no live window that samples, its depth reached, nothing drafted, or the generation would
    end before it."""
    if task.drafter is None or task.draft_budget is None or task.depth is None or task.cancelled \
            or task.recovering is not None:
        return None
    windows = live_windows(task)
    if not windows or not all(w.samples for w in windows) or len(windows) >= task.depth.depth():
        return None
    last = windows[-1]
    start = last.start + len(last.tokens)
    ahead = sum(w.most for w in windows)
    if room < 1 or start + 1 >= max_context or task.generated + ahead >= task.max_tokens:
        return None
    # what the stages hold before the first live window, then what the live windows feed
    fed = task.history if windows[0].decode else task.to_feed[: windows[0].start]
    history = [*fed, *(t for w in windows for t in w.tokens)]
    guess = [int(t) for t in task.drafter(history, 1)[:1]]
    if not guess:
        return None
    k = min(task.draft_budget.next_k(), room - 1, max_context - start - 2)
    tokens = guess + ([int(t) for t in task.drafter([*history, *guess], k)[:k]] if k > 0 else [])
    entry = StepEntry(session_id=task.session_id, phase=PHASE_DECODE, positions=range(start, start + len(tokens)),
                      token_ids=tokens, sample_last=True, sampling=task.sampling, rewind=True, verify=True,
                      top_logprobs=task.top_logprobs, draws_before=task.samples + ahead, continues=True)
    return entry, Window(start=start, tokens=tokens, n_prefill=0, drafted=len(tokens), chained=True)
