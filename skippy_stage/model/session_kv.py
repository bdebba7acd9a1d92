"""A session's KV in llama.cpp beyond a batch: a lane cut back, copied or reset for the lane table,
exported as a page and imported from one, retired as a resident prefix, trimmed, dropped.

``SessionKv`` is a part of ``StageRuntime`` (``runtime``), which loads the context it works on;
every call that touches the context holds the runtime's ``_compute`` lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import structlog

from skippy_stage.config import StageConfig
from skippy_stage.errors import (
    CapacityError,
    InvalidRequestError,
    RuntimeFailure,
    SessionStateError,
    UnknownSessionError,
)
from skippy_stage.model.kv_page import KV_PAGE_VERSION, KvPage, KvPageDesc
from skippy_stage.model.lanes import Admission, DropResult, LaneTable, SessionOwner
from skippy_stage.model.mrope import MropeLanes
from skippy_stage.model.slicing import MANIFEST_SUFFIX


class SessionKv:
    """The session operations of ``StageRuntime`` other than running a batch."""

    # Loaded by StageRuntime.__init__.
    config: StageConfig
    log: structlog.stdlib.BoundLogger
    lanes: LaneTable
    load_path: Path
    n_ctx: int
    n_vocab: int
    cells_per_lane: int
    cuttable: bool
    _compute: threading.Lock
    _ctx: llama_cpp.llama_context_p
    _mem: llama_cpp.llama_memory_t
    _swa_window: int
    _mrope: MropeLanes | None  # an M-RoPE model: each lane's images (``mrope``)
    _digest: str | None
    # Kept by BatchRunner, which also supplies ``_forget``.
    _samplers: dict
    _history: dict[str, list[int]]
    _resident_history: dict[str, list[int]]

    def _reset_lane(self, lane: int) -> bool:
        if self._mrope is not None:
            self._mrope.forget(lane)
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, lane, -1, -1))

    def _trim_lane(self, lane: int, keep: int) -> bool:
        """Cut a lane back to ``keep`` tokens, or say it cannot be: a sliding-window cache (unless
        ``swa_full``) holds only the last window of positions, and the cells a cut leaves in front
        of ``keep`` may be gone already, which llama.cpp's seq_rm would not report; and an M-RoPE
        image's rows share one model position, so no cut falls strictly inside one."""
        cut = keep if self._mrope is None else self._mrope.model_position(lane, keep)
        if cut is None:
            return False
        if self._swa_window and not self.config.swa_full:
            if int(llama_cpp.llama_memory_seq_pos_min(self._mem, lane)) > max(0, cut - self._swa_window):
                return False
        ok = bool(llama_cpp.llama_memory_seq_rm(self._mem, lane, cut, -1))
        if ok and self._mrope is not None:
            self._mrope.cut(lane, keep)
        return ok

    def _fork_lane(self, source: int, lane: int, keep: int) -> bool:
        """Copy a lane's first ``keep`` tokens' KV into an empty one. Across separate lanes (streams)
        llama.cpp copies only whole streams (it asserts on a partial copy, aborting the process), and
        does so before the next decode: so copy all, then cut the copy back."""
        held = int(llama_cpp.llama_memory_seq_pos_max(self._mem, source)) + 1
        llama_cpp.llama_memory_seq_cp(self._mem, source, lane, -1, -1)
        if self._mrope is not None:
            self._mrope.copy(source, lane)
            return self._trim_lane(lane, keep)  # rows and positions apart: the cut knows where ``keep`` is
        return keep >= held or self._trim_lane(lane, keep)

    def model_digest(self) -> str:
        """sha256 of the stage file: from the slice cache's manifest when there is one, else read
        once (a whole-model stage) and remembered."""
        if self._digest is None:
            manifest = self.load_path.with_name(self.load_path.name + MANIFEST_SUFFIX)
            try:
                self._digest = str(json.loads(manifest.read_text())["sha256"])
            except (OSError, ValueError, KeyError):
                h = hashlib.sha256()
                with self.load_path.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
                self._digest = h.hexdigest()
        return self._digest

    def page_descriptor(self, n_tokens: int, batches: int = 0) -> KvPageDesc:
        cfg = self.config
        return KvPageDesc(KV_PAGE_VERSION, self.model_digest(), cfg.layer_start, cfg.layer_end, n_tokens,
                          cfg.cache_type_k, cfg.cache_type_v, self.n_ctx, batches)

    def export_session(self, session_id: str, max_bytes: int, *, tokens: int | None = None,
                       batches: int | None = None, release: bool = False) -> KvPage:
        """A live session's KV on this stage, as a page another stage of the same layers imports.

        ``tokens``: the count the caller expects it to hold (refused otherwise, so a page never
        silently misses a frame). ``release``: free the lane in the same critical section, so no
        frame can land between the copy and the release (the session moved). A resident prefix
        of that id is exported when no live session has it."""
        with self._compute:
            bound = self.lanes.lane_of(session_id)
            resident = bound is None and (bound := self.lanes.resident_lane(session_id)) is not None
            if bound is None:
                raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on stage {self.config.stage_id}")
            if tokens is not None and bound.n_tokens != tokens:
                raise SessionStateError(f"session_id={session_id!r} holds {bound.n_tokens} tokens on stage "
                                        f"{self.config.stage_id}, not the wait_for_tokens={tokens} asked for")
            images = () if self._mrope is None else self._mrope.layout(bound.lane, bound.n_tokens)
            if images is None:
                raise SessionStateError(f"session_id={session_id!r} holds part of an image on stage "
                                        f"{self.config.stage_id} (its rows share one model position): a KV page "
                                        f"holds whole images")
            if batches is not None and not resident and bound.batches != batches:
                raise SessionStateError(f"session_id={session_id!r} was fed {bound.batches} batches on stage "
                                        f"{self.config.stage_id}, not the wait_for_batches={batches} asked for")
            size = int(llama_cpp.llama_state_seq_get_size(self._ctx, bound.lane))
            if size > max_bytes:
                raise CapacityError(f"session_id={session_id!r}: its KV page is {size} bytes on stage "
                                    f"{self.config.stage_id}, more than max_message_bytes={max_bytes}")
            buf = (ctypes.c_uint8 * size)()
            written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, bound.lane))
            if written == 0:
                raise RuntimeFailure(f"llama.cpp exported no KV state for session_id={session_id!r}")
            # The final stage's history may end with the token it sampled last, not yet fed: the
            # page holds what the KV holds, and the step that feeds that token adds it back.
            held = self._resident_history if resident else self._history
            history = tuple(held.get(session_id, ())[: bound.n_tokens])
            if release:
                self.lanes.drop(session_id)
                self._forget(session_id)
        if release:
            self.log.info("session exported and released", session_id=session_id, lane=bound.lane,
                          tokens=bound.n_tokens, page_bytes=written)
        return KvPage(self.page_descriptor(bound.n_tokens, bound.batches), bytes(buf)[:written], history, images)

    def import_session(self, session_id: str, page: KvPage, *, resident: bool = False) -> int:
        """Bind ``session_id`` to a lane holding ``page``'s KV; refuses a page cut from anything else,
        naming the field. Returns the tokens the session now holds. ``resident``: keep it as a
        resident prefix of that id instead (a finished session's KV, moved)."""
        want = self.page_descriptor(page.descriptor.n_tokens)
        got = page.descriptor
        for name in ("version", "model_digest", "layer_start", "layer_end", "cache_type_k", "cache_type_v"):
            if getattr(got, name) != getattr(want, name):
                raise InvalidRequestError(f"page.descriptor.{name}={getattr(got, name)!r} does not match stage "
                                          f"{self.config.stage_id}'s {name}={getattr(want, name)!r}")
        if got.n_tokens <= 0:
            raise InvalidRequestError(f"page.descriptor.n_tokens={got.n_tokens} must be positive")
        if not self.cuttable:
            # llama.cpp's recurrent state reader asserts on a malformed page (aborting the process)
            raise InvalidRequestError(f"page: stage {self.config.stage_id} holds a recurrent model, whose KV "
                                      f"pages are not imported")
        if got.n_tokens > self.cells_per_lane:
            raise InvalidRequestError(f"page.descriptor.n_tokens={got.n_tokens} is more than a lane's "
                                      f"{self.cells_per_lane} KV cells on stage {self.config.stage_id}")
        if self.config.include_output and len(page.token_ids) != got.n_tokens:
            raise InvalidRequestError(f"page.token_ids has {len(page.token_ids)} tokens for "
                                      f"page.descriptor.n_tokens={got.n_tokens}: the final stage's sampler needs them")
        if page.token_ids and len(page.token_ids) != got.n_tokens:
            raise InvalidRequestError(f"page.token_ids has {len(page.token_ids)} tokens for "
                                      f"page.descriptor.n_tokens={got.n_tokens}")
        bad = [t for t in page.token_ids if not 0 <= t < self.n_vocab]
        if bad:
            raise InvalidRequestError(f"page.token_ids holds {bad[0]}, outside [0, {self.n_vocab})")
        if page.images and self._mrope is None:
            raise InvalidRequestError(f"page.images: stage {self.config.stage_id}'s model has no M-RoPE positions")
        with self._compute:
            if self.lanes.lane_of(session_id) is not None:
                raise SessionStateError(f"session_id={session_id!r} is already bound on stage {self.config.stage_id}")
            lanes, new = self.lanes.admit([Admission(session_id, 0, got.n_tokens)])
            lane = lanes[session_id]
            try:  # the rows after its images sit that much lower (``mrope``)
                positions = got.n_tokens if self._mrope is None else self._mrope.restore(
                    lane, page.images, got.n_tokens, "page.images")
            except InvalidRequestError:
                self.lanes.release(new)
                raise
            buf = (ctypes.c_uint8 * len(page.data)).from_buffer_copy(page.data)
            read = int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(page.data), lane))
            # What llama.cpp restored must be exactly the page's tokens at positions 0..n-1.
            if (read != len(page.data) or int(llama_cpp.llama_memory_seq_pos_min(self._mem, lane)) != 0
                    or int(llama_cpp.llama_memory_seq_pos_max(self._mem, lane)) != positions - 1):
                self.lanes.release(new)  # resets the lane
                raise InvalidRequestError(f"page.data ({len(page.data)} bytes) is not a KV state of "
                                          f"page.descriptor.n_tokens={got.n_tokens} positions that llama.cpp "
                                          f"accepts on stage {self.config.stage_id}")
            self.lanes.advance(session_id, got.n_tokens, batches=got.batches)
            if page.token_ids:
                self._history[session_id] = list(page.token_ids)
        self.log.info("session imported", session_id=session_id, lane=lanes[session_id], tokens=got.n_tokens,
                      page_bytes=len(page.data), resident=resident)
        if resident:
            self.retire_session(session_id)
        return got.n_tokens

    def retire_session(self, session_id: str) -> DropResult:
        """End a session, keeping its KV as a resident prefix a later session may take (a plain
        drop for models that keep none, or when ``cache_idle_slots`` is 0)."""
        with self._compute:
            return self._retire_locked(session_id)

    def _retire_locked(self, session_id: str) -> DropResult:
        result = self.lanes.retire(session_id)
        history = self._history.pop(session_id, None)
        self._forget(session_id)
        resident = self.lanes.resident_prefixes()
        if session_id in resident and history is not None:
            self._resident_history[session_id] = history
        for gone in set(self._resident_history) - resident:
            del self._resident_history[gone]
        self.log.info("session retired", session_id=session_id, lane=result.lane, tokens=result.n_tokens,
                      resident=session_id in resident)
        return result

    def trim_session(self, session_id: str, n_tokens: int) -> int:
        """Cut a session back to its first ``n_tokens`` (speculative rollback, an edited chat);
        returns the tokens it held before."""
        with self._compute:
            before = self.lanes.trim(session_id, n_tokens)
            history = self._history.get(session_id)
            if history is not None:
                del history[n_tokens:]
            state = self._samplers.pop(session_id, None)  # rebuilt from the cut history when next used
            if state is not None:
                state.chain.close()
        return before

    def drop_session(self, session_id: str) -> DropResult:
        """Free a session, or a resident prefix of that id."""
        with self._compute:
            result = self.lanes.drop(session_id)
            self._forget(session_id)
            self._resident_history.pop(session_id, None)
        self.log.info("session dropped", session_id=session_id, lane=result.lane, tokens=result.n_tokens,
                      reset_ms=round(result.reset_seconds * 1e3, 3), discarded=result.discarded)
        return result

    def retire_owned(self, session_ids: Sequence[str], owner: SessionOwner | None) -> list[str]:
        """Retire (``retire_session``) those of ``session_ids`` that ``owner`` still owns; the ones
        retired. Under the compute lock throughout, so none changes hands between the check and
        the retirement."""
        retired = []
        with self._compute:
            if getattr(self, "_ctx", None) is None:
                return retired
            for session_id in session_ids:
                if self.lanes.owns(session_id, owner):
                    self._retire_locked(session_id)
                    retired.append(session_id)
        return retired

    def drop_owned(self, session_ids: Sequence[str], owner: SessionOwner | None, *,
                   residents: bool = False) -> list[str]:
        """Free those of ``session_ids`` that ``owner`` still owns (its connection closed, or it let
        them go in band), and with ``residents`` resident prefixes of those ids; the ones freed."""
        freed = []
        with self._compute:
            if getattr(self, "_ctx", None) is None:
                return freed  # closed: nothing is held any more
            for session_id in session_ids:
                result = self.lanes.drop_owned(session_id, owner, residents=residents)
                if result is not None:
                    self._forget(session_id)
                    self._resident_history.pop(session_id, None)
                    freed.append(session_id)
        if freed:
            self.log.info("sessions released from above freed", sessions=len(freed), session_ids=freed[:16])
        return freed
