"""The head's generation front: tokenise, hand the session to the scheduler, stream text.

Only stage 0 has the tokenizer and the chat template. The scheduler (``scheduler``)
advances every active session in shared batches down the chain; this module turns each
session's sampled tokens into text. Text leaves as valid UTF-8 pieces, held back while it could still be the
start of a stop string, so what a client reads equals what llama-cpp-python's
``create_completion`` returns for the same prompt and settings.
"""

from __future__ import annotations

import array
import codecs
import dataclasses
import queue
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
import structlog
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from skippy_stage.config import SpeculativeConfig
from skippy_stage.errors import ConfigError, InvalidFieldError, InvalidRequestError
from skippy_stage.head.drafting import DraftBudget, Drafter, Drafters, ModelDrafter, SpeculativeRequest
from skippy_stage.head.inflight import BatchCount
from skippy_stage.head.prefixes import PrefixCache
from skippy_stage.head.recording import ScheduleRecorder
from skippy_stage.head.scheduler import Scheduler, SchedulerLimits
from skippy_stage.head.tasks import FINISH_LENGTH, FINISH_STOP, End, Failed, PromptLogprobs, Sampled, Task, Tokens
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.model.projector import MEDIA_PART, MediaPrompt
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams, parse_grammar
from skippy_stage.model.schedule import Schedule, context_of, sampling_of
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.steps import Outputs, Step

log = structlog.get_logger("skippy_stage.head")

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256


@dataclass(frozen=True)
class GenerateSpec:
    """A validated Generate request."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    speculative: SpeculativeRequest | None = None
    top_logprobs: int | None = None  # each token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the prompt tokens' too (a PromptLogprobs event before the pieces)
    # max_tokens was not asked for (it is the session's size): n > 1 choices then each take at most
    # their share of the KV pool, rather than being refused for not fitting at once
    max_tokens_fit: bool = False
    # Tokens within this many ms of the last delivery go together (None: the head's stream_interval_ms).
    stream_interval_ms: float | None = None
    # Record the batch schedule the pipeline runs (``Finish.schedule_json``, for ``skippy-stage replay``).
    record_schedule: bool = False
    # For a chat template that renders tool calls (the OpenAI API's ``tools``): the chat as whole
    # message dicts (``tool_calls``, ``tool_call_id``), rendered in place of ``messages``, and the
    # template's ``tools``.
    chat_messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    # Images (encoded PNG, JPEG, ...) for the prompt's media markers, in order (a head with a projector).
    media: tuple[bytes, ...] = ()


# How often a waiting handler checks whether its client is still there.
_POLL_S = 0.1


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked


@dataclass(frozen=True)
class Finish:
    reason: str
    prompt_tokens: int
    completion_tokens: int
    session_id: str
    cached_tokens: int = 0  # prompt tokens whose KV came from a resident prefix
    schedule_json: str = ""  # the recorded schedule (``GenerateSpec.record_schedule``)
    stop_sequence: str | None = None  # the stop string that ended it (reason "stop"); None: end of generation


class StopScanner:
    """Releases generated text, holding back what might still become a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.released = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string found (the earliest; the first listed at a tie)

    def feed(self, new_text: str) -> str:
        self.text += new_text
        # No stop string starts in released text (a prefix of one at the end is held back), so
        # only the rest is searched: a long generation does not rescan its whole text per token.
        hits = [(self.text.find(s, self.released), i) for i, s in enumerate(self.stops)]
        hits = sorted((h, i) for h, i in hits if h >= 0)
        if hits:
            end, first = hits[0]
            self.matched = self.stops[first]
            self.stopped = True
        else:
            end = len(self.text) - self._held_suffix()
        out = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return out

    def _held_suffix(self) -> int:
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def flush(self) -> str:
        out = self.text[self.released :]
        self.released = len(self.text)
        return out


def load_drafters(stage: Stage) -> Drafters:
    """The head's drafters for its ``speculative`` config: the draft model loaded and its
    vocabulary checked against the target's; refused for a model whose state cannot be cut back."""
    runtime = stage.require_runtime()
    cfg = stage.config
    spec = cfg.speculative
    if spec.enabled and not runtime.cuttable:
        raise ConfigError(f"stage {cfg.stage_id}: speculative.drafter={spec.drafter!r}: this model's state cannot "
                          f"be cut back (recurrent layers), so rejected drafts could not be removed")
    if spec.drafter != "model" or not spec.model_path:
        return Drafters()
    return Drafters(ModelDrafter(spec.model_path, n_ctx=runtime.cells_per_lane + 32, n_threads=cfg.n_threads,
                                 target=runtime.tokenizer))


def _waiting_tokens(task: Task, event: int | Sampled | Tokens) -> tuple[list[int | Sampled], object | None]:
    """``event``'s tokens and those queued behind it, for one message: a handler that fell behind
    (the cores busy decoding) catches up in one send rather than one a token, each of which costs
    gRPC's hand-offs between threads. The first event that is not a token (End, Failed) is
    returned, to be handled after them (None: none has come)."""
    items = list(event.items) if isinstance(event, Tokens) else [event]
    while True:
        try:
            more = task.events.get_nowait()
        except queue.Empty:
            return items, None
        if isinstance(more, Tokens):
            items.extend(more.items)
        elif isinstance(more, (End, Failed, PromptLogprobs)):
            return items, more
        else:
            items.append(more)


def _check_media_request(spec: GenerateSpec, speculation: SpeculativeConfig) -> None:
    """Refuse, by field, what a prompt with images cannot have: what replays or scores the prompt token
    by token (an image's positions hold no tokens), and a draft model (it would read them as tokens)."""
    if spec.record_schedule:
        raise InvalidFieldError("record_schedule", "record_schedule: a schedule replays token ids, and this "
                                                   "prompt's images have none")
    if spec.prompt_logprobs is not None:
        raise InvalidFieldError("echo", "the prompt's logprobs (echo with logprobs): an image's positions have "
                                        "no tokens to score")
    if speculation.enabled and speculation.drafter == "model":
        raise InvalidFieldError("speculative.drafter", "speculative.drafter='model': the draft model cannot see "
                                                       "this prompt's images (use ngram or none)")


def _text_drafts(drafter: Drafter) -> Drafter:
    """``drafter`` cut at the first image key it proposes (a prompt-lookup drafter copies what followed
    a match, which may be an image's positions): drafts are token ids only."""
    def drafts(history: list[int], k: int) -> list[int]:
        out = []
        for token in drafter(history, k):
            if token < 0:
                break
            out.append(token)
        return out
    return drafts


class _StreamTiming:
    """A generation's time to first token and time per output token, as a streaming client sees
    them but taken at the head, when each message is handed to gRPC: the figures hold whatever
    the client does with the messages (``bench`` times a client that reads them only at the end)."""

    def __init__(self, metrics) -> None:
        self._metrics = metrics
        self._first_at: float | None = None
        self._first_tokens = 0

    def piece(self, task: Task, tokens: int) -> None:
        """A message is about to leave with ``tokens`` tokens."""
        if self._first_at is not None:
            return
        self._first_at = time.monotonic()
        self._first_tokens = tokens
        self._metrics.time_to_first_token.observe(self._first_at - task.enqueued_at)

    def end(self, completion: int) -> None:
        after_first = completion - self._first_tokens
        if self._first_at is not None and after_first > 0:
            self._metrics.time_per_output_token.observe((time.monotonic() - self._first_at) / after_first)


class Generator:
    """Runs generations through the chain below the head."""

    def __init__(self, stage: Stage, drafters: Drafters | None = None) -> None:
        """``drafters``: loaded beforehand (``load_drafters``, at the stage's start, so a bad draft
        model fails the start, not the first request)."""
        runtime = stage.require_runtime()
        if not stage.config.include_embeddings:
            raise InvalidRequestError(f"Generate is served by the head stage only; {stage.config.stage_id} is not stage 0")
        self.stage = stage
        self.runtime = runtime
        self.max_context = runtime.cells_per_lane
        cfg = stage.config
        self.drafters = drafters if drafters is not None else load_drafters(stage)
        metrics = stage.metrics

        def on_speculation(drafted: int, accepted: int) -> None:
            metrics.spec_drafted.inc(drafted)
            metrics.spec_accepted.inc(accepted)
        self.scheduler = Scheduler(
            SchedulerLimits(
                lane_count=cfg.lane_count, kv_pool_tokens=runtime.n_ctx, max_context=runtime.cells_per_lane,
                n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch, max_inflight=min(cfg.max_inflight, cfg.lane_count),
                max_queue=cfg.admission_queue, max_queue_wait_s=cfg.admission_wait_s,
                step_timeout_s=stage.timeouts.step_s, recovery_wait_s=cfg.recovery_wait_s,
                stream_interval_s=cfg.stream_interval_ms / 1e3, window_depth=cfg.verify_window_depth,
                prefill_chunks=cfg.prefill_chunks_in_flight,
            ),
            chain_ready=lambda: stage.ready,
            # The previous step's tokens go to their handlers once this step's frame has left.
            step=lambda request, timeout: stage.process(request, timeout, on_sent=self.scheduler.flush_events),
            send=lambda request, timeout: stage.start_step(request, timeout, on_sent=self.scheduler.flush_events),
            drop=lambda session_id: stage.drop_session(session_id, stage.timeouts.drop_s),
            release=stage.end_sessions,
            is_eog=runtime.tokenizer.is_eog,
            stage_id=cfg.stage_id,
            on_recovery=stage.metrics.session_recoveries.inc,
            on_speculation=on_speculation,
            on_stale=metrics.spec_stale.inc,
            lone=self._lone(stage, runtime),
            batch_count=self._batch_count(stage),
            **self._prefix_cache(stage, runtime),
        )
        template = runtime.tokenizer.metadata("tokenizer.chat_template")
        self._chat = (
            Jinja2ChatFormatter(
                template=template,
                eos_token=runtime.tokenizer.token_text(runtime.tokenizer.eos_token),
                bos_token=runtime.tokenizer.token_text(runtime.tokenizer.bos_token),
            )
            if template
            else None
        )

    @staticmethod
    def _batch_count(stage: Stage) -> BatchCount:
        """The measured count of batches in flight (``inflight``): the stage count as the head's share
        of the model's layers says (an even split's), the ring as that many links like the first."""
        cfg = stage.config
        stages = max(1, round(stage.model_layers / max(1, cfg.layer_end - cfg.layer_start))) \
            if stage.model_layers else 1
        return BatchCount(cap=min(cfg.max_inflight, cfg.lane_count), stages=stages,
                          shared_cores=cfg.compute_lock_path is not None,
                          ring_s=lambda: stage.downstream_rtt().median_s * stages / 2)

    @staticmethod
    def _lone(stage: Stage, runtime: StageRuntime):
        """The head's lone greedy generation in C (``Stage.process_lone``), where the head's steps
        run in C; else None (every step through ``Stage.process``)."""
        if stage.native_head is None or not stage.config.lone_steps:
            return None
        tokenizer = runtime.tokenizer
        eog = array.array("i", [t for t in range(tokenizer.n_vocab) if tokenizer.is_eog(t)]).tobytes()

        def lone(request: Step, timeout: float, on_token, limit: int, bell) -> Outputs:
            return stage.process_lone(request, timeout, on_token=on_token, limit=limit, eog=eog, bell=bell)
        return lone

    @staticmethod
    def _prefix_cache(stage: Stage, runtime: StageRuntime) -> dict[str, object]:
        """Resident prefixes, at most ``cache_idle_slots`` (unset: one per lane); none for models
        whose state cannot be cut back to a prefix (recurrent) or when the slots are 0."""
        slots = stage.config.lane_count if stage.config.cache_idle_slots is None else stage.config.cache_idle_slots
        if not runtime.keeps_prefixes or slots <= 0:
            return {}
        metrics = stage.metrics

        def on_prefix(kind: str, tokens: int) -> None:
            if kind == "hit":
                metrics.prefix_cache_hits.inc()
                metrics.prefix_cache_tokens_reused.inc(tokens)
            else:
                metrics.prefix_cache_misses.inc()

        return dict(
            retire=lambda session_id: stage.drop_session(session_id, stage.timeouts.drop_s, keep_prefix=True),
            prefixes=PrefixCache(slots), on_prefix=on_prefix,
        )

    def prompt_tokens(self, spec: GenerateSpec) -> list[int]:
        return self.prompt(spec).tokens

    def prompt(self, spec: GenerateSpec) -> MediaPrompt:
        """The prompt's tokens, its images encoded where its markers are (``MediaPrompt``: an image's
        positions hold its keys, negative, never token ids)."""
        projector = self.runtime.projector
        if spec.media and projector is None:
            raise InvalidFieldError("media", f"this request carries {len(spec.media)} images, but this head takes "
                                             f"none (stage {self.stage.config.stage_id} has no projector_path)")
        if spec.prompt is not None:
            text, add_special = spec.prompt, True
        else:
            if self._chat is None:
                raise InvalidRequestError("messages were given but the model has no chat template "
                                          "(tokenizer.chat_template)")
            messages = list(spec.chat_messages) or [{"role": r, "content": c} for r, c in spec.messages]
            try:
                rendered = self._chat(messages=messages, tools=list(spec.tools) or None)
            except (jinja2.TemplateError, ValueError, TypeError) as exc:  # the template's raise_exception, or its own
                raise InvalidRequestError(f"the model's chat template cannot render these messages: {exc}") from None
            text, add_special = rendered.prompt, not rendered.added_special
        if not spec.media:
            return MediaPrompt(self.runtime.tokenizer.tokenize(text, add_special=add_special, parse_special=True), ())
        if projector.marker != MEDIA_PART:
            text = text.replace(MEDIA_PART, projector.marker)
        encoded = projector.prompt(text, list(spec.media), add_special=add_special, max_positions=self.max_context)
        for span in encoded.media:
            self.stage.metrics.image_encode_seconds.observe(span.encode_s)
        return encoded

    def generate(self, spec: GenerateSpec, *, remaining_s: Callable[[], float | None],
                 is_active: Callable[[], bool] = lambda: True) -> Iterator[Piece | Finish]:
        """Submit the generation to the scheduler and turn its tokens into text pieces."""
        (task,) = self.start(spec)
        yield from self.pieces(task, spec, remaining_s=remaining_s, is_active=is_active)

    def start(self, spec: GenerateSpec, n: int = 1) -> list[Task]:
        """Check ``spec`` and submit ``n`` choices of it, as n sessions in the same iteration batches.

        The first prefills the prompt; the others start as copies of its KV on every stage (a
        model whose state can be copied; else each prefills it). With a seed, choice i samples with
        seed + i, so the n choices are reproducible and differ from each other. The caller reads
        each with :meth:`pieces`, and cancels every one it does not read to its end."""
        encoded = self.prompt(spec)
        prompt = encoded.tokens
        if not prompt:
            raise InvalidRequestError("prompt tokenises to no tokens")
        if len(prompt) >= self.max_context:
            images = f" ({sum(len(m.key) for m in encoded.media)} of them for {len(encoded.media)} images)" \
                if encoded.media else ""
            raise InvalidFieldError(
                "media" if encoded.media else "prompt",
                f"prompt has {len(prompt)} tokens{images}; a session holds at most {self.max_context} "
                f"({self.runtime.session_limit_hint})"
            )
        if not 1 <= n <= self.stage.config.lane_count:
            raise InvalidFieldError("n", f"n={n} choices need as many lanes at once: between 1 and this "
                                         f"pipeline's lane_count={self.stage.config.lane_count}")
        speculation = self.stage.config.speculative
        if spec.speculative is not None:
            speculation = spec.speculative.over(speculation)
        if speculation.enabled and not self.runtime.cuttable:
            raise InvalidRequestError(f"speculative.drafter={speculation.drafter!r}: this model's state cannot be "
                                      f"cut back (recurrent layers), so rejected drafts could not be removed")
        if encoded.media:
            _check_media_request(spec, speculation)
        max_tokens = spec.max_tokens
        if n > 1 and spec.max_tokens_fit:
            # each choice holds its prompt, its answer and the drafts a last step may carry past them
            drafts = speculation.k if speculation.enabled else 0
            max_tokens = min(max_tokens, self.runtime.n_ctx // n - len(prompt) - drafts)
            if max_tokens < 1:
                raise InvalidFieldError("n", f"n={n} choices of a {len(prompt)}-token prompt do not fit this "
                                             f"pipeline's {self.runtime.n_ctx} KV cells at once: lower n")
        sampling = spec.sampling
        bad = [t for t, _ in sampling.logit_bias if not 0 <= t < self.runtime.n_vocab]
        if bad:
            raise InvalidFieldError("logit_bias", f"logit_bias names token {bad[0]}, outside this model's "
                                                  f"vocabulary [0, {self.runtime.n_vocab})")
        if sampling.grammar:
            # refused here, before any stage computes; it constrains the generated tokens only
            llama_cpp.llama_sampler_free(parse_grammar(self.runtime.vocab, sampling.grammar))
            sampling = dataclasses.replace(sampling, grammar_start=len(prompt))
        tasks = []
        for i in range(n):
            seeded = sampling if sampling.seed == RANDOM_SEED or i == 0 else \
                dataclasses.replace(sampling, seed=(sampling.seed + i) % RANDOM_SEED)
            # the choices share a prompt: its logprobs come with the first
            task = Task(session_id=uuid.uuid4().hex, prompt=prompt, sampling=seeded, max_tokens=max_tokens,
                        top_logprobs=spec.top_logprobs, prompt_logprobs=spec.prompt_logprobs if i == 0 else None,
                        stream_interval_s=None if spec.stream_interval_ms is None else spec.stream_interval_ms / 1e3,
                        media=encoded.media)
            if speculation.enabled:
                task.drafter = self.drafters.for_spec(speculation)
                if encoded.media:
                    task.drafter = _text_drafts(task.drafter)
                task.draft_budget = DraftBudget(speculation.k, speculation.adaptive)
                task.window_depth = spec.speculative.window_depth if spec.speculative is not None else None
            if spec.record_schedule:
                task.schedule = self._recorder(task, speculation)
            tasks.append(task)
        self.scheduler.submit(tasks[0], tasks[1:], share_prompt=self.runtime.cuttable)
        return tasks

    def _recorder(self, task: Task, speculation: SpeculativeConfig) -> ScheduleRecorder:
        """An empty schedule for ``task``: what a replay needs besides the steps (the context the
        head's runtime made, the sampling settings, the prompt and the limits a generation ends at)."""
        cfg = self.stage.config
        drafting = dataclasses.asdict(speculation)
        drafting.pop("model_path", None)
        return ScheduleRecorder(Schedule(
            model=Path(cfg.model_path).name, context=context_of(cfg, self.runtime.n_ctx),
            sampling=sampling_of(task.sampling), prompt=list(task.prompt), max_tokens=task.max_tokens,
            max_context=self.max_context, speculative=drafting if speculation.enabled else {}))

    def pieces(self, task: Task, spec: GenerateSpec, *, remaining_s: Callable[[], float | None],
               is_active: Callable[[], bool] = lambda: True) -> Iterator[Piece | Finish | PromptLogprobs]:
        """One submitted task's tokens as text pieces, then its Finish; cancels the task at the end.
        A task asked for its prompt's logprobs yields them first."""
        slog = log.bind(stage_id=self.stage.config.stage_id, session_id=task.session_id)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        scanner = StopScanner(spec.stop)
        completion = 0
        pending_ids: list[int] = []
        pending_lps: list[TokenLogprob] = []
        reason = FINISH_LENGTH
        timing = _StreamTiming(self.stage.metrics)
        event = None  # the next event, when one came behind a run of tokens
        try:
            while True:
                if event is None:
                    try:
                        event = task.events.get(timeout=_POLL_S)
                    except queue.Empty:
                        remaining = remaining_s()
                        if not is_active() or (remaining is not None and remaining <= 0):
                            slog.info("generation abandoned by the client", completion_tokens=completion)
                            return
                        continue
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, End):
                    reason = event.reason
                    break
                if isinstance(event, PromptLogprobs):
                    yield event
                    event = None
                    continue
                # Several at once under stream_interval_ms (the scheduler held them), or tokens that
                # came while the last message was being sent: one message.
                items, event = _waiting_tokens(task, event)
                text = ""
                for token in items:
                    completion += 1
                    if isinstance(token, Sampled):
                        pending_lps.append(token.logprob)
                        token = token.token
                    pending_ids.append(token)
                    text += scanner.feed(decoder.decode(self.runtime.tokenizer.token_bytes(token)))
                    if scanner.stopped:
                        break
                if scanner.stopped:
                    reason = FINISH_STOP
                    if text:
                        timing.piece(task, len(pending_ids))
                        yield Piece(text, pending_ids, pending_lps)
                    pending_ids, pending_lps = [], []
                    break
                if text:
                    timing.piece(task, len(pending_ids))
                    yield Piece(text, pending_ids, pending_lps)
                    pending_ids, pending_lps = [], []
            if not scanner.stopped:
                tail = scanner.feed(decoder.decode(b"", final=True))
                if not scanner.stopped:
                    tail += scanner.flush()  # no stop string can complete any more
                if tail or pending_ids:
                    timing.piece(task, len(pending_ids))
                    yield Piece(tail, pending_ids, pending_lps)
            timing.end(completion)
            yield Finish(reason, len(task.prompt), completion, task.session_id, task.cached_tokens,
                         task.schedule.finish(reason, wait_s=self.stage.timeouts.step_s)
                         if task.schedule is not None else "", stop_sequence=scanner.matched)
        finally:
            task.cancel()  # the scheduler frees the session on every stage

    def close(self) -> None:
        self.scheduler.close()
        self.drafters.close()
