"""A final stage's multi-token-prediction (MTP, "next-n") drafter: the model's own draft head.

Models such as DeepSeek-V3, GLM-4.5 and Qwen3.5 carry next-n blocks after their trunk, trained
to guess the token after the next one. The pinned llama.cpp runs them in a second context of
type ``LLAMA_CONTEXT_TYPE_MTP`` over the same model (loaded with ``load_mtp``), the way its own
speculative driver does (``common/speculative.cpp``):

- the main context, told ``llama_set_embeddings_nextn(main, True, masked=False)``, leaves one
  row ``h`` per batch token after each decode (the trunk's output after the final norm;
  ``llama_get_embeddings_nextn_ith``, by batch index), for hidden-state input as for tokens;
- the MTP context holds the next-n block's KV. Its entry at position ``p`` is the token at ``p``
  paired with ``h`` of position ``p - 1`` (zeros before position 0). After every main decode it
  decodes the same tokens at the same positions ("catch-up"), so its KV holds what the main
  context's holds;
- a draft is one MTP decode of (the token just sampled, at the position it will take, with ``h``
  of the row it was sampled from); the argmax of its logits is the guess. Its row is cut again
  right away: the catch-up of the step that verifies it writes that position.

``MtpDrafter`` keeps per lane the positions the MTP KV holds (always ``[0, held)``), the ``h``
row of position ``held - 1`` (the next catch-up's first entry needs it), and the rows of the
last decode, so a rewind or trim into that decode finds its ``h`` again. A lane whose state
cannot be known (its KV imported from a page, a resident prefix cut behind its last decode, a
failed MTP decode) is *stale*: it takes no catch-up and gives no drafts until it is reset, so a
draft never comes from KV that does not match the session. Every call is made under the
runtime's compute lock.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog
from llama_cpp import llama_cpp_ext

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, RuntimeFailure
from skippy_stage.model import loader

log = structlog.get_logger("skippy_stage.mtp")

# Next-n blocks the pinned MTP graphs take: two or more load, then abort the process when the MTP
# context builds its graph (``GGML_ASSERT n_layer_nextn == 1`` in qwen35 / deepseek2).
SUPPORTED_NEXTN = 1
_F32P = ctypes.POINTER(ctypes.c_float)


def check_model(model: llama_cpp.llama_model_p, path: Path, *, cuttable: bool) -> int:
    """The model's next-n block count, or ConfigError saying why ``native_mtp_enabled`` cannot run."""
    nextn = int(llama_cpp.llama_model_n_layer_nextn(model))
    if nextn == 0:
        raise ConfigError(f"native_mtp_enabled=true: {path} has no multi-token-prediction layers "
                          f"(nextn_predict_layers)")
    if nextn != SUPPORTED_NEXTN:
        raise ConfigError(f"native_mtp_enabled=true: {path} has {nextn} multi-token-prediction layers; the pinned "
                          f"llama.cpp drafts with exactly {SUPPORTED_NEXTN} (it aborts on more)")
    if not cuttable:
        raise ConfigError(f"native_mtp_enabled=true: {path} holds recurrent layers, whose state cannot be cut "
                          f"back after a rejected draft (no speculative decoding)")
    return nextn


@dataclass
class _Lane:
    held: int = 0  # the MTP KV holds positions [0, held)
    # h of position held - 1 (zeros at 0): the next catch-up's first entry, and a draft's input.
    pending: np.ndarray | None = None
    # The last main decode's h rows and the position of its first row (a rewind into it finds h again).
    rows: np.ndarray | None = None
    rows_start: int = 0
    stale: bool = False

    def h_before(self, position: int, n_embd: int) -> np.ndarray | None:
        """h of ``position - 1``, if known."""
        if position == 0:
            return np.zeros(n_embd, dtype=np.float32)
        if position == self.held and self.pending is not None:
            return self.pending
        if self.rows is not None and self.rows_start <= position - 1 < self.rows_start + len(self.rows):
            return self.rows[position - 1 - self.rows_start]
        return None


@dataclass
class CatchUp:
    """One lane's share of a catch-up: its tokens at ``positions`` and the main context's h rows for them."""

    lane: int
    positions: np.ndarray
    tokens: np.ndarray
    h_rows: np.ndarray  # (n, n_embd), row i the h of positions[i]


class MtpDrafter:
    """The MTP context of one final-stage runtime and the per-lane state that keeps it in step."""

    def __init__(self, model: llama_cpp.llama_model_p, config: StageConfig, n_ctx: int, *, n_embd: int,
                 n_vocab: int) -> None:
        cfg = config
        self.stage_id = cfg.stage_id
        self.n_embd = n_embd
        self.n_vocab = n_vocab
        self.n_batch = cfg.n_batch
        # The main context's shape (cells, lanes, batch sizes, cache types), for the next-n block alone.
        self.params = loader.context_params(cfg, n_ctx, None)
        loader.set_fields(self.params, ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP)
        self._ctx = llama_cpp.llama_init_from_model(model, self.params)
        if not self._ctx:
            raise RuntimeFailure(f"stage {cfg.stage_id}: llama.cpp refused the MTP context (ctx_size={n_ctx}, "
                                 f"lane_count={cfg.lane_count})")
        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, True)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        if not self._batch:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
            raise RuntimeFailure(f"stage {cfg.stage_id}: llama.cpp could not allocate an MTP batch")
        self._pos = (llama_cpp.llama_pos * 4)()
        self._lanes: dict[int, _Lane] = {}
        self.n_drafts = 0

    @property
    def ctx(self) -> llama_cpp.llama_context_p:
        return self._ctx

    def close(self) -> None:
        if self._batch:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None

    def _lane(self, lane: int) -> _Lane:
        return self._lanes.setdefault(lane, _Lane())

    def held(self, lane: int) -> int:
        """Positions the MTP KV of ``lane`` holds (``[0, held)``); -1 for a stale lane."""
        state = self._lane(lane)
        return -1 if state.stale else state.held

    # -- lane lifecycle (the lane table's reset / trim / fork) -------------------------------

    def reset(self, lane: int) -> bool:
        """A fresh lane: empty MTP KV, h of position -1 is zeros."""
        self._lanes[lane] = _Lane()
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, lane, -1, -1))

    def trim(self, lane: int, keep: int) -> None:
        """Cut ``lane`` back to its first ``keep`` positions; stale if h of ``keep - 1`` is gone."""
        state = self._lane(lane)
        if state.stale or keep >= state.held:
            return
        h = state.h_before(keep, self.n_embd)
        llama_cpp.llama_memory_seq_rm(self._mem, lane, keep, -1)
        if h is None:
            self.mark_stale(lane, f"cut to {keep} positions, behind the last decode's rows")
            return
        state.held, state.pending = keep, h

    def fork(self, source: int, lane: int, keep: int) -> None:
        """``lane`` starts as a copy of ``source``'s first ``keep`` positions (after the main KV's copy)."""
        src = self._lane(source)
        self._lanes[lane] = _Lane(held=src.held, pending=src.pending, rows=src.rows, rows_start=src.rows_start,
                                  stale=src.stale)
        llama_cpp.llama_memory_seq_rm(self._mem, lane, -1, -1)
        if src.stale:
            return
        llama_cpp.llama_memory_seq_cp(self._mem, source, lane, -1, -1)
        self.trim(lane, keep)

    def mark_stale(self, lane: int, why: str) -> None:
        """No catch-up and no drafts for ``lane`` until it is reset (its MTP KV dropped)."""
        state = self._lane(lane)
        if not state.stale:
            log.info("MTP drafting off for a lane until it is reset", stage_id=self.stage_id, lane=lane, why=why)
        llama_cpp.llama_memory_seq_rm(self._mem, lane, -1, -1)
        self._lanes[lane] = _Lane(stale=True)

    # -- decoding ------------------------------------------------------------------------

    def catch_up(self, parts: Sequence[CatchUp]) -> None:
        """After a main decode: the same tokens at the same positions in the MTP context, each with h
        of the position before it, in one MTP decode over every lane. A lane that does not continue
        where its MTP KV ends (or ends behind it without the h to resume from) turns stale."""
        todo: list[tuple[CatchUp, np.ndarray]] = []
        for part in parts:
            state = self._lane(part.lane)
            if state.stale:
                continue
            p0 = int(part.positions[0])
            first = state.h_before(p0, self.n_embd) if p0 <= state.held else None
            if first is None:
                self.mark_stale(part.lane, f"positions start at {p0}, its MTP KV holds {state.held}")
                continue
            if p0 < state.held:
                llama_cpp.llama_memory_seq_rm(self._mem, part.lane, p0, -1)
            h_in = np.empty((part.positions.shape[0], self.n_embd), dtype=np.float32)
            h_in[0] = first
            h_in[1:] = part.h_rows[:-1]
            todo.append((part, h_in))
        if not todo:
            return
        try:
            self._process([(p.lane, p.tokens, p.positions, h_in) for p, h_in in todo], outputs=False)
        except RuntimeFailure as exc:
            for part, _ in todo:
                self.mark_stale(part.lane, str(exc))
            log.warning("MTP catch-up failed: drafting off for its lanes", stage_id=self.stage_id, error=str(exc))
            return
        for part, _ in todo:
            state = self._lane(part.lane)
            state.held = int(part.positions[-1]) + 1
            state.rows, state.rows_start = part.h_rows, int(part.positions[0])
            state.pending = part.h_rows[-1]

    def draft(self, requests: Sequence[tuple[int, int, int]]) -> list[int | None]:
        """Greedy drafts for ``(lane, token, position)``: the token after ``token``, which is to sit at
        ``position``, with h of ``position - 1``. None for a stale lane or one whose h is unknown. The
        drafted rows are cut again at once (the verifying step's catch-up writes those positions)."""
        out: list[int | None] = [None] * len(requests)
        todo: list[tuple[int, int, int, int, np.ndarray]] = []
        for i, (lane, token, position) in enumerate(requests):
            state = self._lane(lane)
            if state.stale:
                continue
            # A rejected draft's catch-up row sits past the kept positions: cut it first.
            self.trim(lane, position)
            h = None if state.stale or position != state.held else state.h_before(position, self.n_embd)
            if h is not None:
                todo.append((i, lane, token, position, h))
        if not todo:
            return out
        try:
            self._process([(lane, np.array([token]), np.array([position]), h[None, :])
                           for _, lane, token, position, h in todo], outputs=True)
        except RuntimeFailure as exc:
            for _, lane, _, _, _ in todo:
                self.mark_stale(lane, str(exc))
            log.warning("MTP draft failed: drafting off for its lanes", stage_id=self.stage_id, error=str(exc))
            return out
        for row, (i, lane, _, position, _) in enumerate(todo):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
            if ptr:
                out[i] = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))
            llama_cpp.llama_memory_seq_rm(self._mem, lane, position, -1)
        self.n_drafts += sum(d is not None for d in out)
        return out

    def _process(self, groups: Sequence[tuple[int, np.ndarray, np.ndarray, np.ndarray]], *, outputs: bool) -> None:
        """One MTP decode of ``(lane, tokens, positions, h rows)`` groups; ``outputs``: logits for each
        group's last row (batch index = row order)."""
        total = sum(int(g[1].shape[0]) for g in groups)
        if total > self.n_batch:
            raise RuntimeFailure(f"an MTP batch of {total} rows is more than n_batch={self.n_batch}")
        h_all = np.ascontiguousarray(np.concatenate([g[3] for g in groups]), dtype=np.float32)  # alive until decoded
        base = h_all.ctypes.data
        stride = self.n_embd * 4
        llama_cpp.llama_batch_ext_clear(self._batch)
        row = 0
        for lane, tokens, positions, _ in groups:
            for t, p in zip(tokens.tolist(), positions.tolist()):
                idx = llama_cpp.llama_batch_ext_add_token(self._batch, lane, int(t))
                if idx < 0:
                    raise RuntimeFailure(f"llama_batch_ext_add_token returned {idx}")
                self._pos[0] = int(p)
                embd = llama_cpp.llama_embd(ctypes.cast(base + row * stride, _F32P), 1, self.n_embd)
                if not llama_cpp.llama_batch_ext_set_pos(self._batch, idx, self._pos) or \
                        not llama_cpp.llama_batch_ext_set_embd_token(self._batch, idx, embd):
                    raise RuntimeFailure("llama.cpp refused an MTP batch entry")
                row += 1
            if outputs:
                llama_cpp.llama_batch_ext_set_output_logits(self._batch, row - 1, True)
        rc = llama_cpp.llama_process(self._ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise RuntimeFailure(f"llama_process (MTP) returned {rc} on a batch of {total} rows")
