"""Running a batch on the loaded context: one ``llama_decode`` over every entry, the hidden rows an
inner stage sends on, and a final stage's logits, samples and log-probabilities.

``BatchRunner`` is a part of ``StageRuntime`` (``runtime``), which loads what it runs on; it keeps
each session's sampler chain and token history. Every call holds the runtime's ``_compute`` lock
while it touches the context.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
import structlog
from llama_cpp import llama_cpp_ext

from skippy_stage import tracing
from skippy_stage.config import StageConfig
from skippy_stage.errors import CapacityError, InvalidRequestError, RuntimeFailure, SessionStateError
from skippy_stage.model.batch import NO_DRAFT, BatchEntry, CheckedEntry, EntryResult, check_batch
from skippy_stage.model.capture import Capture
from skippy_stage.model.compute_lock import ComputeLock
from skippy_stage.model.digest import logit_digest
from skippy_stage.model.lanes import Admission, LaneTable, SessionOwner
from skippy_stage.model.logprobs import TokenLogprob, log_softmax, token_logprob
from skippy_stage.model.mrope import MropeLanes
from skippy_stage.model.mtp import CatchUp, MtpDrafter
from skippy_stage.model.sampling import SamplerChain, SamplingParams
from skippy_stage.model.ubatch import compute_order, in_batch_order


@dataclass
class _SessionSampler:
    chain: SamplerChain
    accepted: int  # number of history tokens already fed to the chain


def decode_error(rc: int, n_tokens: int) -> CapacityError | RuntimeFailure:
    """What a failed llama_decode (return code ``rc``) means for the batch: 1 is llama.cpp's "no KV
    slot"; -1000 and -1001 are the native frame path's "no logits for an output row" and "the
    capture saw other micro-batches than one of the batch's rows"."""
    if rc == 1:
        return CapacityError(f"llama.cpp found no KV slot for a batch of {n_tokens} tokens")
    if rc == -1000:
        return RuntimeFailure(f"llama.cpp has no logits for an output row of a batch of {n_tokens} tokens")
    if rc == -1001:
        return RuntimeFailure(f"hidden-state capture disagrees with the predicted micro-batch of {n_tokens} rows")
    return RuntimeFailure(f"llama_decode failed with code {rc} on a batch of {n_tokens} tokens")


class BatchRunner:
    """``run_batch``, and the sampling state of the sessions it runs."""

    # Loaded by StageRuntime.__init__.
    config: StageConfig
    log: structlog.stdlib.BoundLogger
    lanes: LaneTable
    n_vocab: int
    n_embd: int
    cuttable: bool
    _compute: threading.Lock
    _host_lock: ComputeLock | None  # the host's, around each decode (``compute_lock``)
    _ctx: llama_cpp.llama_context_p
    _mem: llama_cpp.llama_memory_t
    _vocab: llama_cpp.llama_vocab_p
    _capture: Capture | None
    _equal_split: bool
    _swa_window: int
    # The batch buffers (``StageRuntime._alloc_batch``).
    _batch: llama_cpp.llama_batch
    _pos_sections: int
    _pos: np.ndarray
    _seq: np.ndarray
    _out: np.ndarray
    _tokens: np.ndarray | None
    _embd: np.ndarray | None
    # A head with a projector: a second batch over the same arrays, carrying image rows (``_media_embd``);
    # with its own four positions per row where they take M-RoPE positions (``_media_pos``).
    _media_batch: llama_cpp.llama_batch | None
    _media_embd: np.ndarray | None
    _media_pos: np.ndarray | None
    # An M-RoPE model: the images each lane's KV holds (``mrope``).
    _mrope: MropeLanes | None
    # A final stage with native_mtp_enabled: the MTP context kept in step after every decode (``mtp``).
    _mtp: MtpDrafter | None
    # Per session: its sampler chain and the tokens at its positions (a resident prefix's kept apart).
    _samplers: dict[str, _SessionSampler]
    _history: dict[str, list[int]]
    _resident_history: dict[str, list[int]]

    def run_batch(self, entries: Sequence[BatchEntry], owner: SessionOwner | None = None) -> list[EntryResult]:
        """Run one llama_decode over every entry; results come back in entry order.

        Raises InvalidRequestError / UnknownSessionError / SessionStateError /
        CapacityError before touching llama.cpp; the runtime stays usable after any of them.
        ``owner``: the connection the entries came over (``LaneTable.admit``).
        """
        tracing.mark("rb0")
        checked = check_batch(entries, self.config, n_vocab=self.n_vocab, n_embd=self.n_embd,
                              cuttable=self.cuttable, mrope=self._mrope is not None)
        if self._mtp is not None:
            for i, c in enumerate(checked):
                if c.tokens is None:
                    raise InvalidRequestError(f"entries[{i}].token_ids are required at stage {self.config.stage_id} "
                                              f"(native_mtp_enabled: its MTP layers take each position's token)")
        with self._compute:
            rewinds = [(i, c) for i, c in enumerate(checked) if c.entry.rewind]
            for i, c in rewinds:  # every one checked before any is applied
                self._check_rewind(i, c.entry.session_id, int(c.positions[0]))
            for _, c in rewinds:
                self._rewind(c.entry.session_id, int(c.positions[0]))
            lanes, new = self.lanes.admit([Admission(c.entry.session_id, int(c.positions[0]), c.n, c.entry.prefix_id,
                                                     c.entry.fork_of) for c in checked], owner)
            for c in checked:
                if c.entry.prefix_id is not None and c.entry.session_id in new:
                    kept = self._resident_history.pop(c.entry.prefix_id, [])
                    self._history[c.entry.session_id] = kept[: int(c.positions[0])]
                elif c.entry.fork_of is not None and c.entry.fork_of in self._history:
                    self._history[c.entry.session_id] = self._history[c.entry.fork_of][: int(c.positions[0])]
            try:
                sections = None if self._mrope is None else self._sections(checked, lanes)
            except BaseException:  # nothing reached llama.cpp: only this batch's new bindings are undone
                self._release_new(new)
                raise
            try:
                results = self._decode(checked, lanes, sections)
            except BaseException:
                self._rollback(checked, lanes, new)
                raise
            for i, c in enumerate(checked):
                self.lanes.advance(c.entry.session_id, c.n)
                if c.entry.image is not None:
                    self._mrope.fed(lanes[c.entry.session_id], int(c.positions[0]), c.entry.image,
                                    int(sections[i][0, 0]))
        tracing.mark("rb1")
        return results

    def _check_rewind(self, index: int, session_id: str, keep: int) -> None:
        """Refuse a rewind behind a sliding window's oldest kept cell (the cells before ``keep``
        that the session needs may be gone), or inside an M-RoPE image, naming the entry."""
        bound = self.lanes.lane_of(session_id)
        if bound is None or keep >= bound.n_tokens:
            return
        cut = keep if self._mrope is None else self._mrope.model_position(bound.lane, keep)
        if cut is None:
            raise SessionStateError(f"entries[{index}].rewind to positions[0]={keep}: session_id={session_id!r} on "
                                    f"stage {self.config.stage_id} holds an image's rows there (a cut inside one "
                                    f"has no model position)")
        if not self._swa_window or self.config.swa_full:
            return
        if int(llama_cpp.llama_memory_seq_pos_min(self._mem, bound.lane)) > max(0, cut - self._swa_window):
            raise SessionStateError(f"entries[{index}].rewind to positions[0]={keep}: session_id={session_id!r} on "
                                    f"stage {self.config.stage_id} no longer holds the sliding window's cells "
                                    f"before it (set swa_full: true to speculate this far back)")

    def _rewind(self, session_id: str, keep: int) -> None:
        """Drop a live session's KV (and sampling history) from ``keep`` on: the drafts the final
        stage rejected. The sampler keeps its state: it only ever accepted the tokens it sampled,
        which are the session's real history. A session that holds ``keep`` tokens or fewer (or is
        new) is left alone; admission then checks the position as for any entry."""
        bound = self.lanes.lane_of(session_id)
        if bound is None or keep >= bound.n_tokens:
            return
        self.lanes.trim(session_id, keep)
        history = self._history.get(session_id)
        if history is not None:
            del history[keep + 1 :]  # position ``keep``'s token is fed again by this batch

    def _sections(self, checked: list[CheckedEntry], lanes: dict[str, int]) -> list[np.ndarray | None] | None:
        """An M-RoPE model's positions of every entry (4 x n, ``mrope``; None for one whose rows are its
        positions), or None when every entry's are: checked against each lane's images before any
        decode."""
        sections = [self._mrope.sections(lanes[c.entry.session_id], int(c.positions[0]), c.n, c.entry.image,
                                         f"entries[{i}]") for i, c in enumerate(checked)]
        return None if all(s is None for s in sections) else sections

    def _decode(self, checked: list[CheckedEntry], lanes: dict[str, int],
                sections: list[np.ndarray | None] | None = None) -> list[EntryResult]:
        """One llama_decode; at a head with image rows among token entries, two (a llama_batch carries
        token ids or embedding rows, not both): the tokens', then the images'."""
        if self._media_batch is None or all(c.entry.hidden is None for c in checked):
            return self._decode_group(checked, lanes, sections, media=False)
        results: list[EntryResult | None] = [None] * len(checked)
        for media in (False, True):
            group = [i for i, c in enumerate(checked) if (c.entry.hidden is not None) == media]
            if group:
                for i, result in zip(group, self._decode_group([checked[i] for i in group], lanes,
                                                               None if sections is None else [sections[i] for i in group],
                                                               media=media)):
                    results[i] = result
        return results  # type: ignore[return-value]

    def _decode_group(self, checked: list[CheckedEntry], lanes: dict[str, int],
                      sections: list[np.ndarray | None] | None, *, media: bool) -> list[EntryResult]:
        cfg = self.config
        order = sorted(range(len(checked)), key=lambda i: lanes[checked[i].entry.session_id])
        spans: dict[int, tuple[int, int]] = {}
        # A head's image rows on an M-RoPE model take four positions each in a batch of their own.
        pos = self._media_pos if media and self._media_pos is not None else self._pos
        offset = 0
        for i in order:
            c = checked[i]
            end = offset + c.n
            pos[offset:end] = c.positions if sections is None or sections[i] is None else sections[i][0]
            self._seq[offset:end] = lanes[c.entry.session_id]
            if media:
                self._media_embd[offset:end] = c.entry.hidden
            elif self._tokens is not None:
                self._tokens[offset:end] = c.tokens
            else:
                self._embd[offset:end] = c.entry.hidden
            if cfg.include_output and (c.entry.all_rows or c.entry.verify or c.entry.prompt_logprobs is not None):
                self._out[offset:end] = 1
            elif cfg.include_output:
                self._out[offset:end] = 0
                self._out[end - 1] = 1 if (c.entry.sample or c.entry.want_logits) else 0
            else:
                self._out[offset:end] = 1
            spans[i] = (offset, end)
            offset = end
        if self._pos_sections == 4 or pos is not self._pos:
            pos[offset : 3 * offset] = np.tile(pos[:offset], 2)
            pos[3 * offset : 4 * offset] = 0
            for i in order if sections is not None else ():
                if sections[i] is not None:
                    first, last = spans[i]
                    pos[offset + first : offset + last] = sections[i][1]
                    pos[2 * offset + first : 2 * offset + last] = sections[i][2]
        if self._capture is not None:
            self._capture.reset()

        tracing.mark("d0")
        batch = self._media_batch if media else self._batch
        batch.n_tokens = offset
        if self._host_lock is None:
            rc = llama_cpp.llama_decode(self._ctx, batch)
        else:
            with self._host_lock:
                rc = llama_cpp.llama_decode(self._ctx, batch)
        tracing.mark("d1")
        if rc != 0:
            raise decode_error(rc, offset)
        if cfg.include_output:
            results = [self._verify_result(checked[i], spans[i][0]) if checked[i].entry.verify
                       else self._final_result(checked[i], spans[i][1] - 1) for i in range(len(checked))]
            results = [dataclasses.replace(r, prompt_logprobs=self._prompt_logprobs(c, spans[i][0]))
                       if c.entry.prompt_logprobs is not None else r for i, (c, r) in enumerate(zip(checked, results))]
            return results if self._mtp is None else self._mtp_step(checked, lanes, spans, offset, results)
        return self._inner_results(checked, spans, offset)

    def _mtp_step(self, checked: list[CheckedEntry], lanes: dict[str, int], spans: dict[int, tuple[int, int]],
                  total: int, results: list[EntryResult]) -> list[EntryResult]:
        """After a decode at an MTP final stage: the MTP context catches up on every entry's rows (the
        trunk's h of each, by batch index), then drafts the token after each entry's last sample: at the
        position after it, from the h of the row it was sampled from (a verify entry's last kept row)."""
        base = llama_cpp_ext.llama_get_embeddings_nextn_ith(self._ctx, 0)
        if not base or not llama_cpp_ext.llama_get_embeddings_nextn_ith(self._ctx, total - 1):
            for c in checked:
                self._mtp.mark_stale(lanes[c.entry.session_id], "the decode left no next-n rows")
            self.log.warning("no next-n rows after a decode: MTP drafting off for its lanes", rows=total)
            for r in results:
                if r.token is not None:
                    r.draft = NO_DRAFT
            return results
        h = np.ctypeslib.as_array(base, shape=(total, self.n_embd))
        # A stale verify window (nothing sampled) is rewound by the session's next step: the MTP layers
        # skip it, and their KV stays where that rewind goes.
        self._mtp.catch_up([CatchUp(lanes[c.entry.session_id], c.positions, c.tokens,
                                    h[spans[i][0] : spans[i][1]].copy()) for i, (c, r) in enumerate(zip(checked, results))
                            if r.tokens is None or r.tokens])
        asks: list[tuple[int, int, int]] = []
        which: list[int] = []
        for i, (c, r) in enumerate(zip(checked, results)):
            if r.token is None or (r.tokens is not None and not r.tokens):
                continue  # nothing sampled (or a stale verify window)
            position = int(c.positions[0]) + len(r.tokens) if r.tokens is not None else int(c.positions[-1]) + 1
            asks.append((lanes[c.entry.session_id], r.token, position))
            which.append(i)
        for i, draft in zip(which, self._mtp.draft(asks)):
            results[i].draft = NO_DRAFT if draft is None else draft
        return results

    def _inner_results(self, checked: list[CheckedEntry], spans: dict[int, tuple[int, int]], total: int) -> list[EntryResult]:
        n_ubatch = self.config.n_ubatch
        # One sequence (a single-stream decode) or a simple split: computed in batch order.
        ordered = not self._equal_split or len(checked) == 1 or in_batch_order(self._seq[:total].tolist())
        if ordered:
            predicted = [min(n_ubatch, total - start) for start in range(0, total, n_ubatch)]
        else:
            ubatches = compute_order(self._seq[:total].tolist(), n_ubatch, equal_split=True)
            predicted = [len(u) for u in ubatches]
        capture = self._capture
        if capture.error is not None or predicted != capture.counts:
            raise RuntimeFailure(
                f"hidden-state capture disagrees with the predicted micro-batches "
                f"(predicted rows {predicted}, captured {capture.counts}, error {capture.error})"
            )
        if ordered:
            rows = capture.buffer[:total].copy()
        else:
            rows = np.empty((total, self.n_embd), dtype=np.float32)
            rows[np.concatenate([np.asarray(u, dtype=np.int64) for u in ubatches])] = capture.buffer[:total]
        return [
            EntryResult(c.entry.session_id, hidden=rows[spans[i][0] : spans[i][1]])
            for i, c in enumerate(checked)
        ]

    def _final_result(self, c: CheckedEntry, row: int) -> EntryResult:
        e = c.entry
        # history[i] is the token at position i; a sampled token was put at its position
        # already, so the step that feeds it back replaces it instead of adding it twice.
        history = self._history.setdefault(e.session_id, [])
        if c.tokens is not None:
            del history[int(c.positions[0]) :]
            history.extend(int(t) for t in c.tokens)
        logits = None
        if e.want_logits:
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        token = None
        logprobs = None
        digests = None
        if e.sample:
            dist = self._log_softmax_row(row) if e.top_logprobs is not None else None
            if e.digest_logits:
                digests = (self._row_digest(row),)
            token = self._sample(e.session_id, e.sampling or SamplingParams(), history, row,
                                 draws=e.draws_before)
            state = self._samplers[e.session_id]
            history.append(token)  # the chain accepted it while sampling
            state.accepted = len(history)
            if dist is not None:
                logprobs = (token_logprob(dist, token, e.top_logprobs),)
        return EntryResult(e.session_id, logits=logits, token=token, logprobs=logprobs, logit_digests=digests)

    def _prompt_logprobs(self, c: CheckedEntry, first_row: int) -> tuple[TokenLogprob, ...]:
        """Each row's next token under that row's distribution (the token it is followed by)."""
        following = [int(t) for t in c.tokens[1:]]
        if c.entry.next_token is not None:
            following.append(int(c.entry.next_token))
        return tuple(token_logprob(self._log_softmax_row(first_row + i), token, c.entry.prompt_logprobs)
                     for i, token in enumerate(following))

    def _row_digest(self, row: int) -> int:
        """The digest of batch row ``row``'s logits (taken before a sampler reads them)."""
        return logit_digest(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, row), shape=(self.n_vocab,)))

    def _log_softmax_row(self, row: int) -> np.ndarray:
        return log_softmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, row), shape=(self.n_vocab,)))

    def _verify_result(self, c: CheckedEntry, first_row: int) -> EntryResult:
        """Sample each row in order with the session's chain; stop after the first sample that differs
        from the next row's token (the draft it checks). For a deterministic draft this *is* the
        speculative-sampling acceptance rule: the draft survives with the probability the chain gives
        it, and a rejection's sample is distributed as the chain's distribution without the draft."""
        e = c.entry
        p0 = int(c.positions[0])
        history = self._history.setdefault(e.session_id, [])
        if e.continues and not (len(history) == p0 + 1 and history[p0] == int(c.tokens[0])):
            # Stale: a window before it was cut short, or its first token is not the sample it guessed.
            # Its rows stay in the KV until the rewind that follows; the sampler sees none of it.
            return EntryResult(e.session_id, tokens=(), logit_digests=() if e.digest_logits else None)
        del history[p0:]
        history.append(int(c.tokens[0]))
        state = self._sampler_for(e.session_id, e.sampling or SamplingParams(), history, e.draws_before)
        samples: list[int] = []
        logprobs: list[TokenLogprob] = []
        digests: list[int] = []
        for i in range(c.n):
            dist = self._log_softmax_row(first_row + i) if e.top_logprobs is not None else None
            if e.digest_logits:
                digests.append(self._row_digest(first_row + i))
            token = self._sample(e.session_id, e.sampling or SamplingParams(), history, first_row + i, state)
            samples.append(token)
            if dist is not None:
                logprobs.append(token_logprob(dist, token, e.top_logprobs))
            if i + 1 < c.n and token != int(c.tokens[i + 1]):
                break
        # The real history: what was fed up to the last draft kept, then the samples' last, which the
        # next step feeds (and so replaces at its position, as for a plain sample).
        history.extend(samples)
        state.accepted = len(history)
        return EntryResult(e.session_id, token=samples[-1], tokens=tuple(samples),
                           logprobs=tuple(logprobs) if e.top_logprobs is not None else None,
                           logit_digests=tuple(digests) if e.digest_logits else None)

    def _sample(self, session_id: str, params: SamplingParams, history: list[int], row: int,
                state: _SessionSampler | None = None, *, draws: int = 0) -> int:
        """One sample of ``row``; a grammar's dead end (no token allowed) ends this session only: it
        samples the end-of-generation token, which the chain does not accept."""
        state = state or self._sampler_for(session_id, params, history, draws)
        token = state.chain.sample(self._ctx, row)
        if token is None:
            self.log.warning("grammar allows no token: the session ends", session_id=session_id)
            return self._end_token()
        return token

    def _end_token(self) -> int:
        """A token that ends a generation: EOS, else EOT, else the first end-of-generation token."""
        for token in (llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_eot(self._vocab)):
            if 0 <= token < self.n_vocab:
                return int(token)
        for token in range(self.n_vocab):
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                return token
        raise InvalidRequestError("sampling.grammar allows no token here and this model has no end-of-generation "
                                  "token to end the session with")

    def _sampler_for(self, session_id: str, params: SamplingParams, history: list[int],
                     draws: int = 0) -> _SessionSampler:
        state = self._samplers.get(session_id)
        if state is None or (state.chain.params is not params and state.chain.params != params):
            if state is not None:
                self._samplers.pop(session_id).chain.close()
            chain = SamplerChain(params, self.n_vocab, self._vocab)
            try:
                for token in history[params.grammar_start:]:  # a rebuilt chain: what was generated so far
                    chain.accept_generated(token)
                chain.skip_draws(draws)
            except BaseException:
                chain.close()
                raise
            state = _SessionSampler(chain, accepted=max(0, len(history) - params.repeat_last_n))
            self._samplers[session_id] = state
        for token in history[min(state.accepted, len(history)) :]:
            state.chain.accept(token)
        state.accepted = len(history)
        return state

    def _rollback(self, checked: list[CheckedEntry], lanes: dict[str, int], new: list[str]) -> None:
        """Remove whatever a failed decode may have written, so the session can retry. A session fed
        the slice of an M-RoPE image after the first loses the whole image (its rows share one model
        position): it is cut back to the image's start."""
        try:
            for c in checked:
                if c.entry.session_id not in new:
                    lane, start = lanes[c.entry.session_id], int(c.positions[0])
                    cut = start if self._mrope is None else self._mrope.model_position(lane, start)
                    if cut is None:
                        self._cut_to_image_start(c.entry.session_id, lane, start)
                    else:
                        llama_cpp.llama_memory_seq_rm(self._mem, lane, cut, -1)
        finally:
            self._release_new(new)

    def _cut_to_image_start(self, session_id: str, lane: int, start: int) -> None:
        """After a failed decode of an image's later slice: the session without the image (its earlier
        slices share the failed rows' model position), or without its lane where it cannot be cut."""
        keep = self._mrope.image_start(lane, start)
        try:
            self.lanes.trim(session_id, keep)
        except Exception:  # noqa: BLE001 - the decode's own error is what the caller hears
            self.log.warning("session dropped: its image could not be cut away after a failed decode",
                             session_id=session_id)
            self.lanes.drop(session_id)
            self._forget(session_id)
            return
        del self._history.get(session_id, [])[keep:]
        state = self._samplers.pop(session_id, None)  # rebuilt from the cut history when next used
        if state is not None:
            state.chain.close()

    def _release_new(self, new: list[str]) -> None:
        self.lanes.release(new)
        for session_id in new:
            self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        state = self._samplers.pop(session_id, None)
        if state is not None:
            state.chain.close()
        self._history.pop(session_id, None)
