"""The head's generation loop: tokenise, prefill, sample step by step, stream text.

Only stage 0 has the tokenizer and the chat template; every step of a generation is one
batch that travels down the whole chain (``Stage.process``) and comes back with the
sampled token. Text leaves as valid UTF-8 pieces, held back while it could still be the
start of a stop string, so what a client reads equals what llama-cpp-python's
``create_completion`` returns for the same prompt and settings.
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import structlog
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from skippy_stage.errors import InvalidRequestError, SkippyError
from skippy_stage.messages import GenerateSpec, sampling_to_pb
from skippy_stage.stage import Stage
from skippy_stage.v1 import stage_pb2 as pb

log = structlog.get_logger("skippy_stage.head")

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Piece:
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Finish:
    reason: str
    prompt_tokens: int
    completion_tokens: int
    session_id: str


class _StopScanner:
    """Releases generated text, holding back what might still become a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.released = 0
        self.stopped = False

    def feed(self, new_text: str) -> str:
        self.text += new_text
        hits = [self.text.find(s) for s in self.stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            end = min(hits)
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


class Generator:
    """Runs generations through the chain below the head."""

    def __init__(self, stage: Stage) -> None:
        runtime = stage.require_runtime()
        if not stage.config.include_embeddings:
            raise InvalidRequestError(f"Generate is served by the head stage only; {stage.config.stage_id} is not stage 0")
        self.stage = stage
        self.runtime = runtime
        self.max_context = runtime.cells_per_lane
        template = runtime.metadata("tokenizer.chat_template")
        self._chat = (
            Jinja2ChatFormatter(
                template=template,
                eos_token=runtime.token_text(runtime.eos_token),
                bos_token=runtime.token_text(runtime.bos_token),
            )
            if template
            else None
        )

    def prompt_tokens(self, spec: GenerateSpec) -> list[int]:
        if spec.prompt is not None:
            return self.runtime.tokenize(spec.prompt, add_special=True, parse_special=True)
        if self._chat is None:
            raise InvalidRequestError("messages were given but the model has no chat template (tokenizer.chat_template)")
        rendered = self._chat(messages=[{"role": r, "content": c} for r, c in spec.messages])
        return self.runtime.tokenize(rendered.prompt, add_special=not rendered.added_special, parse_special=True)

    def generate(self, spec: GenerateSpec, *, remaining_s: Callable[[], float | None],
                 is_active: Callable[[], bool] = lambda: True) -> Iterator[Piece | Finish]:
        prompt = self.prompt_tokens(spec)
        if not prompt:
            raise InvalidRequestError("prompt tokenises to no tokens")
        if len(prompt) >= self.max_context:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; a session holds at most {self.max_context} (ctx_size / lane_count)"
            )
        session_id = uuid.uuid4().hex
        slog = log.bind(stage_id=self.stage.config.stage_id, session_id=session_id)
        sampling = sampling_to_pb(spec.sampling)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        scanner = _StopScanner(spec.stop)
        n_batch = self.stage.config.n_batch
        completion: list[int] = []
        pending_ids: list[int] = []
        reason = FINISH_LENGTH
        try:
            token = None
            for start in range(0, len(prompt), n_batch):
                chunk = prompt[start : start + n_batch]
                last = start + len(chunk) >= len(prompt)
                token = self._step(session_id, start, chunk, last, sampling, remaining_s)
            while True:
                if not is_active():
                    slog.info("generation cancelled by the client", completion_tokens=len(completion))
                    return
                if self.runtime.is_eog(token):
                    reason = FINISH_STOP
                    break
                completion.append(token)
                pending_ids.append(token)
                text = scanner.feed(decoder.decode(self.runtime.token_bytes(token)))
                if scanner.stopped:
                    reason = FINISH_STOP
                    if text:
                        yield Piece(text, pending_ids)
                    pending_ids = []
                    break
                if text:
                    yield Piece(text, pending_ids)
                    pending_ids = []
                position = len(prompt) + len(completion) - 1
                if len(completion) >= spec.max_tokens or position + 1 >= self.max_context:
                    break
                token = self._step(session_id, position, [token], True, sampling, remaining_s)
            if not scanner.stopped:
                tail = scanner.feed(decoder.decode(b"", final=True))
                if not scanner.stopped:
                    tail += scanner.flush()  # no stop string can complete any more
                if tail or pending_ids:
                    yield Piece(tail, pending_ids)
            yield Finish(reason, len(prompt), len(completion), session_id)
            slog.info("generation finished", reason=reason, prompt_tokens=len(prompt), completion_tokens=len(completion))
        finally:
            self._release(session_id, remaining_s, slog)

    def _step(self, session_id: str, start: int, tokens: list[int], sample: bool,
              sampling: pb.SamplingParams, remaining_s: Callable[[], float | None]) -> int | None:
        entry = pb.BatchEntry(
            session_id=session_id,
            phase=pb.PHASE_DECODE if start > 0 and len(tokens) == 1 else pb.PHASE_PREFILL,
            positions=np.arange(start, start + len(tokens)).tolist(),
            token_ids=tokens,
            sample_last=sample,
            sampling=sampling,
        )
        remaining = remaining_s()
        step_budget = self.stage.timeouts.step_s if remaining is None else min(remaining, self.stage.timeouts.step_s)
        response = self.stage.process(pb.IterationBatchRequest(request_id=session_id, entries=[entry]), step_budget)
        if not sample:
            return None
        out = response.outputs[0]
        if not out.has_token:
            raise SkippyError(f"stage {response.final_stage_id} returned no token for session {session_id}")
        return out.token

    def _release(self, session_id: str, remaining_s: Callable[[], float | None], slog) -> None:
        """Free the session on every stage; a stage that is gone has freed it already."""
        try:
            self.stage.drop_session(session_id, min(remaining_s() or 5.0, 5.0))
        except SkippyError as exc:
            slog.info("session release incomplete", error=str(exc))
