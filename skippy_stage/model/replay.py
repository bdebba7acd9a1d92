"""``skippy-stage replay``: run a recorded schedule on the unsplit model and hold the pipeline to it.

The reference is llama-cpp-python's ``Llama`` on the whole model, loaded as the stages load and
with the head's context (``loader.reference_llama_like`` with the schedule's settings: the KV cells
the head's runtime made, the lanes, ``kv_unified``, the batch sizes, threads, attention and cache
types). Each recorded step is one ``llama_decode`` of the same tokens at the same positions with
the same output rows, after the same rewind — so llama.cpp's kernels see the batch shapes the
pipeline's stages saw, whatever timing chose them. Every row the final stage sampled must have
bit-identical logits (its digest, ``digest.logit_digest``), and sampling those rows as the final
stage does must give the same tokens; from the samples, the tokens the head must have sent follow
(each step's samples; none from a stale window; up to an end-of-generation token, ``max_tokens``
or the session's cells), and they must be the ones it sent. The first step that differs is named.

The final stage's bookkeeping for a session is restated here rather than imported (its history by
position, the sampler chain built at the first sample and kept, a rebuilt chain skipping the draws
before it, a verify window sampled row by row up to the first rejected draft, a chained window
sampled only if it continues the last sample): a checker that ran the code it checks would agree
with any bug in it. A step that shared its batch with other sessions ran in a larger batch than
the replay gives it; where that changes the kernels its logits may differ (noted in the report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import loader
from skippy_stage.model.digest import digest_hex, logit_digest
from skippy_stage.model.sampling import SamplerChain, SamplingParams
from skippy_stage.model.schedule import ROWS_ALL, ROWS_LAST, SAMPLE_LAST, SAMPLE_VERIFY, Schedule, ScheduleStep
from skippy_stage.model.slicing import read_model_info

SEQ = 0  # the replay's one sequence


@dataclass(frozen=True)
class Mismatch:
    step: int
    what: str


@dataclass
class ReplayReport:
    model: str
    steps: int = 0  # steps replayed
    rows: int = 0  # sampled rows whose logits were compared
    tokens: int = 0  # completion tokens checked
    stale: int = 0  # windows the final stage did not sample (stale)
    mismatch: Mismatch | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.mismatch is None

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "steps": self.steps, "rows": self.rows, "tokens": self.tokens,
                "stale": self.stale, "exact": self.exact, "notes": self.notes,
                "mismatch": None if self.mismatch is None else {"step": self.mismatch.step,
                                                                "what": self.mismatch.what}}


def format_report(r: ReplayReport) -> str:
    lines = [f"replayed {r.steps} steps on {r.model}: {r.rows} sampled rows, {r.tokens} completion tokens, "
             f"{r.stale} stale windows"]
    lines.extend(f"  note: {note}" for note in r.notes)
    if r.mismatch is None:
        lines.append("  verdict: exact (every sampled row's logits bit-identical, the same samples and tokens)")
    else:
        lines.append(f"  step {r.mismatch.step} differs: {r.mismatch.what}")
        lines.append("  verdict: NOT exact")
    return "\n".join(lines)


def replay_config(schedule: Schedule, model_path: str | Path, *, n_threads: int | None = None) -> StageConfig:
    """The whole model as one stage with the head's recorded settings (what the reference loads)."""
    context = dict(schedule.context)
    context.pop("wire_dtype", None)  # (a lossy wire dtype shows up as differing logits)
    if n_threads is not None:
        context["n_threads"] = n_threads
    try:
        cfg = StageConfig(model_path=str(model_path), stage_id="replay", stage_index=0, layer_start=0,
                          layer_end=read_model_info(model_path).block_count, **context)
    except TypeError as exc:
        raise ConfigError(f"schedule: its context names a setting this build does not know: {exc}") from None
    return cfg


class _FinalStage:
    """One session as the final stage keeps it (see the module docstring), on the reference's context."""

    def __init__(self, llm: llama_cpp.Llama, params: SamplingParams) -> None:
        self.llm = llm
        self.params = params
        self.vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.n_vocab = llm.n_vocab()
        self.mem = llama_cpp.llama_get_memory(llm.ctx)
        self.n_tokens = 0
        self.history: list[int] = []  # history[i]: the token at position i (a sample sits at its position)
        self.chain: SamplerChain | None = None
        self.accepted = 0

    def reset(self) -> None:
        """A new session (a recovery's): an empty lane, no history, a sampler built at its first sample."""
        llama_cpp.llama_memory_seq_rm(self.mem, SEQ, -1, -1)
        self.n_tokens = 0
        self.history = []
        self.close()

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()
            self.chain = None

    def rewind(self, keep: int) -> None:
        if keep >= self.n_tokens:
            return
        llama_cpp.llama_memory_seq_rm(self.mem, SEQ, keep, -1)
        self.n_tokens = keep
        del self.history[keep + 1 :]

    def decode(self, batch: llama_cpp.llama_batch, step: ScheduleStep) -> None:
        n = len(step.tokens)
        for i, token in enumerate(step.tokens):
            batch.token[i] = int(token)
            batch.pos[i] = step.start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = SEQ
            batch.logits[i] = 1 if step.rows == ROWS_ALL or (step.rows == ROWS_LAST and i == n - 1) else 0
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.llm.ctx, batch)
        if rc != 0:
            raise ConfigError(f"llama_decode returned {rc} replaying step {step.index} ({n} tokens at {step.start})")
        self.n_tokens += n

    def row(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, i), shape=(self.n_vocab,))

    def continues(self, step: ScheduleStep) -> bool:
        """A chained window is sampled only if its first token is the last sample, at its position."""
        p0 = step.start
        return len(self.history) == p0 + 1 and self.history[p0] == step.tokens[0]

    def results(self, step: ScheduleStep) -> tuple[list[int], list[int]]:
        """The samples of ``step`` just decoded and the digests of their rows, as the final stage takes them."""
        p0, tokens = step.start, step.tokens
        if step.sample == SAMPLE_VERIFY:
            del self.history[p0:]
            self.history.append(int(tokens[0]))
            self._sampler(step.draws_before)
            samples, digests = [], []
            for i in range(len(tokens)):
                digests.append(logit_digest(self.row(i)))
                token = self._sample(i)
                samples.append(token)
                if i + 1 < len(tokens) and token != int(tokens[i + 1]):
                    break
            self.history.extend(samples)
            self.accepted = len(self.history)
            return samples, digests
        del self.history[p0:]
        self.history.extend(int(t) for t in tokens)
        if step.sample != SAMPLE_LAST:
            return [], []
        last = len(tokens) - 1  # a batch index (llama.cpp maps it to its output row)
        digest = logit_digest(self.row(last))
        self._sampler(step.draws_before)
        token = self._sample(last)
        self.history.append(token)
        self.accepted = len(self.history)
        return [token], [digest]

    def _sampler(self, draws: int) -> SamplerChain:
        if self.chain is None:
            chain = SamplerChain(self.params, self.n_vocab, self.vocab)
            for token in self.history[self.params.grammar_start :]:
                chain.accept_generated(token)
            chain.skip_draws(draws)
            self.chain = chain
            self.accepted = max(0, len(self.history) - self.params.repeat_last_n)
        for token in self.history[min(self.accepted, len(self.history)) :]:
            self.chain.accept(token)
        self.accepted = len(self.history)
        return self.chain

    def _sample(self, i: int) -> int:
        token = self.chain.sample(self.llm.ctx, i)
        return self._end_token() if token is None else token

    def _end_token(self) -> int:
        for token in (llama_cpp.llama_vocab_eos(self.vocab), llama_cpp.llama_vocab_eot(self.vocab)):
            if 0 <= token < self.n_vocab:
                return int(token)
        return next(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))


def replay(schedule: Schedule, model_path: str | Path, *, n_threads: int | None = None) -> ReplayReport:
    """Run ``schedule``'s steps on the unsplit ``model_path`` (see the module docstring)."""
    report = ReplayReport(model=str(model_path))
    if Path(model_path).name != schedule.model:
        report.notes.append(f"the schedule was recorded on {schedule.model!r}")
    if schedule.context.get("wire_dtype", "f32") != "f32":
        report.notes.append(f"hidden states travelled as {schedule.context['wire_dtype']}: a lossy wire dtype "
                            f"is not the unsplit model")
    shared = [s.index for s in schedule.steps if s.batch_rows > len(s.tokens)]
    if shared:
        report.notes.append(f"{len(shared)} steps shared their batch with other sessions (first: step {shared[0]})")
    cfg = replay_config(schedule, model_path, n_threads=n_threads)
    llm = loader.reference_llama_like(cfg)
    final = _FinalStage(llm, schedule.sampling_params())
    batch = llama_cpp.llama_batch_init(max(cfg.n_batch, max((len(s.tokens) for s in schedule.steps), default=1)), 0, 1)
    try:
        report.mismatch = _run(schedule, final, batch, report)
        if report.mismatch is None:
            report.mismatch = _check_completion(schedule, final, report)
    finally:
        llama_cpp.llama_batch_free(batch)
        final.close()
        llm.close()
    return report


def _run(schedule: Schedule, final: _FinalStage, batch: llama_cpp.llama_batch,
         report: ReplayReport) -> Mismatch | None:
    session = None
    for step in schedule.steps:
        if step.failed:
            continue  # it did not get through; the session that follows starts again
        if step.session != session:
            session = step.session
            final.reset()
        if step.rewind:
            final.rewind(step.start)
        if step.start != final.n_tokens:
            return Mismatch(step.index, f"feeds positions from {step.start}, but the session holds {final.n_tokens} "
                                        f"tokens: no stage could have run it")
        chained = step.continues and step.sample == SAMPLE_VERIFY
        live = not chained or final.continues(step)
        final.decode(batch, step)
        report.steps += 1
        if not live:
            report.stale += 1  # its rows are in the KV (a later rewind drops them); its history is not
            if step.samples:
                return Mismatch(step.index, f"the final stage sampled {step.samples} from a window that does not "
                                            f"continue the last sample (stale: it samples nothing)")
            continue
        samples, digests = final.results(step)
        for i, (got, digest) in enumerate(zip(samples, digests)):
            report.rows += 1
            if i >= len(step.digests) or i >= len(step.samples):
                return Mismatch(step.index, f"the replay samples row {i} (position {step.start + i}); the pipeline "
                                            f"reported {len(step.samples)} samples")
            if digest_hex(digest) != step.digests[i]:
                return Mismatch(step.index, f"logits of row {i} (position {step.start + i}) differ: digest "
                                            f"{step.digests[i]} in the pipeline, {digest_hex(digest)} unsplit")
            if got != step.samples[i]:
                return Mismatch(step.index, f"row {i} (position {step.start + i}) sampled {step.samples[i]} in the "
                                            f"pipeline, {got} unsplit, from identical logits")
        if len(samples) != len(step.samples):
            return Mismatch(step.index, f"the pipeline reported {len(step.samples)} samples, the replay takes "
                                        f"{len(samples)}")
    return None


def _check_completion(schedule: Schedule, final: _FinalStage, report: ReplayReport) -> Mismatch | None:
    """The tokens the head must have sent, step by step, against those it did (see the module docstring)."""
    completion: list[int] = []
    done = False
    for step in schedule.steps:
        expected: list[int] = []
        for token in [] if step.failed else step.samples:
            if done:
                break
            if final.is_eog(token):
                done = True
                break
            expected.append(token)
            position = len(schedule.prompt) + len(completion) + len(expected) - 1
            if len(completion) + len(expected) >= schedule.max_tokens or position + 1 >= schedule.max_context:
                done = True
        if expected != step.emitted:
            return Mismatch(step.index, f"the head sent {step.emitted} from this step; its samples give {expected}"
                                        + (" (the head dropped it as stale)" if step.stale else ""))
        completion.extend(expected)
    report.tokens = len(completion)
    if completion != schedule.completion:
        return Mismatch(len(schedule.steps), f"the completion sent ({len(schedule.completion)} tokens) is not the "
                                             f"steps' ({len(completion)} tokens)")
    return None
