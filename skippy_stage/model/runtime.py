"""The llama.cpp runtime of one stage: load a layer range, run batches of session entries.

This module is the only owner of the llama.cpp model and context. Everything a client
sends is validated here, before any of it reaches llama.cpp, because llama.cpp answers
some bad input (more tokens than ``n_batch``, for one) by aborting the whole process.

How a layer range runs on stock llama.cpp (see DESIGN.md):

* the stage loads a sliced GGUF whose blocks are exactly its range (``slicing``);
* hidden states come in through a batch whose ``embd`` holds float rows, not token ids;
* hidden states go out through the scheduler's eval callback: we ask only for the node
  ``l_out-{n_layers-1}``, copy it, and answer "stop", so an inner stage never computes
  the output head. Rows arrive in compute order; ``ubatch.compute_order`` maps them back.

Locks: ``_compute`` serialises every llama.cpp call on the context; the lane table has its
own lock for bookkeeping (taken inside ``_compute`` when both are needed, never the other
way round). Neither is ever held across a network call: the runtime makes none.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog

from skippy_stage import tracing
from skippy_stage.config import MAX_SESSION_ID_LEN, StageConfig
from skippy_stage.errors import (
    CapacityError,
    ConfigError,
    InvalidRequestError,
    RuntimeFailure,
    SessionStateError,
    UnknownSessionError,
)
from skippy_stage.model import llama_ffi, loader, threadpool
from skippy_stage.model.capture import Capture, LayerTap, NativeCapture, make_capture
from skippy_stage.model.lanes import Admission, DropResult, LaneStats, LaneTable, SessionOwner
from skippy_stage.model.sampling import SamplerChain, SamplingParams, validated_once
from skippy_stage.model.slicing import MANIFEST_SUFFIX, read_model_info
from skippy_stage.model.stage_file import resolve_context_size, resolve_stage_file
from skippy_stage.model.tokenizer import Tokenizer
from skippy_stage.model.ubatch import compute_order, in_batch_order

log = structlog.get_logger("skippy_stage.runtime")



@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class BatchEntry:
    """One session's share of a batch.

    ``token_ids`` are required at stage 0; other stages take ``hidden`` rows (float32,
    ``(n, n_embd)``) and may carry the token ids too, so the final stage's sampler sees
    the history that repetition penalties need.
    """

    session_id: str
    positions: Sequence[int] | np.ndarray
    token_ids: Sequence[int] | np.ndarray | None = None
    hidden: np.ndarray | None = None
    want_logits: bool = False
    sample: bool = False
    sampling: SamplingParams | None = None
    # A new session that takes this resident prefix's lane, keeping its first positions[0] tokens.
    prefix_id: str | None = None
    # Speculative decoding: cut the session back to positions[0] before this batch (drafts
    # rejected last step); final stage: sample every row in order up to the first that rejects
    # the next row's token (``verify``), and compute every row as an output (``all_rows``, the
    # batch shape llama.cpp's logits_all gives).
    rewind: bool = False
    verify: bool = False
    all_rows: bool = False
    # Final stage: with each sample, its log-probability and this many most likely alternatives,
    # from the full-vocabulary logits before any sampler (None: none).
    top_logprobs: int | None = None
    # A new session that starts as a copy of this live session's first positions[0] tokens (n
    # choices of one prompt: the prompt prefilled once).
    fork_of: str | None = None
    # Final stage: each row's next token's log-probability (the next row's token; for the last row
    # ``next_token``) and this many alternatives: a prompt's logprobs. Every row is an output.
    prompt_logprobs: int | None = None
    next_token: int | None = None
    # Final stage: samples the session's sampler took before this step; a chain built now (after a
    # hand-off, a recovery, a trim) skips as many seeded draws, so it samples what it would have.
    draws_before: int = 0


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log-softmax of the row's raw logits, as
    llama-cpp-python's ``logits_to_logprobs``), and the most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """llama-cpp-python's ``Llama.logits_to_logprobs`` for one row (float32, the same steps)."""
    top = np.amax(logits)
    if not np.isfinite(top):
        top = 0.0
    shifted = np.subtract(logits, top, dtype=np.single)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted)))


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class EntryResult:
    session_id: str
    hidden: np.ndarray | None = None  # inner stages: one row per input token
    logits: np.ndarray | None = None  # final stage: the last token's logits, when asked
    token: int | None = None  # final stage: the sampled next token, when asked
    tokens: tuple[int, ...] | None = None  # final stage, verify: every row's sample up to the first rejection
    logprobs: tuple[TokenLogprob, ...] | None = None  # final stage, top_logprobs: one per sample
    # final stage, prompt_logprobs: one per row with a next token (positions[0] + 1 on)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class _Checked:
    entry: BatchEntry
    positions: np.ndarray
    tokens: np.ndarray | None

    @property
    def n(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class _SessionSampler:
    chain: SamplerChain
    accepted: int  # number of history tokens already fed to the chain


KV_PAGE_VERSION = 1


@dataclass(frozen=True)
class KvPageDesc:
    """What a KV page was cut from: an import checks each field against the importing stage."""

    version: int
    model_digest: str  # sha256 of the stage file
    layer_start: int
    layer_end: int
    n_tokens: int
    cache_type_k: str
    cache_type_v: str
    n_ctx: int  # cells of the context it came from (informational: the lane must hold n_tokens)
    batches: int = 0  # batches that fed the session (the importer's count goes on from it)


@dataclass(frozen=True)
class KvPage:
    """One session's KV for this stage's layers (``llama_state_seq_get_data``), and the tokens
    it holds (the final stage's sampler needs them for repetition penalties)."""

    descriptor: KvPageDesc
    data: bytes
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadReport:
    stage_file: Path
    slice_built: bool
    slice_seconds: float
    load_seconds: float


class StageRuntime:
    """One loaded layer range with its context, lanes and samplers."""

    def __init__(self, config: StageConfig, *, progress: bool | None = None,
                 tap_layers: Sequence[int] = ()) -> None:
        """``tap_layers`` (final stages only; ``skippy-stage verify``) records the residual
        stream after those layers while the graph runs on: see :meth:`take_taps`."""
        llama_ffi.init_backend()
        self.config = config
        self.log = log.bind(stage_id=config.stage_id, run_id=config.run_id)
        path, built, slice_seconds = resolve_stage_file(config, progress)
        self.load_path = path
        started = time.perf_counter()
        self._model = self._load_model(path)
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.tokenizer = Tokenizer(self._model)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.n_layers = int(llama_cpp.llama_model_n_layer(self._model))
        n_embd_inp = int(llama_cpp.llama_model_n_embd_inp(self._model))
        if not config.include_embeddings and n_embd_inp != self.n_embd:
            # llama.cpp would read hidden-state rows n_embd_inp wide from our n_embd-wide batch.
            raise ConfigError(f"stage {config.stage_id}: stage file {path} expects input rows {n_embd_inp} wide, "
                              f"but hidden states are n_embd={self.n_embd} wide")
        if self.n_layers != config.n_layers:
            raise ConfigError(
                f"stage {config.stage_id}: stage file {path} has {self.n_layers} layers, "
                f"config range {config.layer_start}:{config.layer_end} needs {config.n_layers}"
            )
        # Kept on self: llama.cpp calls its callback for as long as the context lives.
        self._capture = None if config.include_output else make_capture(
            f"l_out-{self.n_layers - 1}", self.n_embd, config.n_batch)
        if tap_layers and not config.include_output:
            raise ConfigError(f"stage {config.stage_id}: layer taps are for a final stage only")
        self._tap = LayerTap(list(tap_layers), self.n_embd) if tap_layers else None
        self.context_size = self._context_size()
        if self.context_size.capped:
            self.log.warning("context capped by host memory", reason=self.context_size.reason)
        self._ctx = self._new_context(self._capture or self._tap)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        if not self._mem:
            raise ConfigError(f"stage {config.stage_id}: {path} runs without KV memory (a non-causal model): "
                              f"a session could not carry its context from one step to the next")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self.cells_per_lane = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self._equal_split = not config.kv_unified
        self._alloc_batch()
        self._compute = threading.Lock()
        # A recurrent state cannot be cut back. And in a unified KV pool a resident prefix's cells sit
        # among the live sessions' and llama.cpp's vectorised attention sums round differently
        # (README, kv_unified): requests that never touch the prefix would stop matching the unsplit
        # model. So resident prefixes need separate lanes.
        cuttable = not (llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model))
        self.keeps_prefixes = cuttable and not config.kv_unified
        self.cuttable = cuttable  # a session can be cut back (trim, rewind): no recurrent layers
        self._swa_window = int(llama_cpp.llama_model_n_swa(self._model))
        self.lanes = LaneTable(
            lane_count=config.lane_count,
            cells_per_lane=self.cells_per_lane,
            kv_pool_tokens=self.n_ctx,
            cache_idle_slots=config.cache_idle_slots,
            reset=self._reset_lane,
            trim=self._trim_lane if cuttable else None,
            fork=self._fork_lane if cuttable else None,
            resident_slots=None if self.keeps_prefixes else 0,
            owner=f"stage {config.stage_id}",
            lane_limit_hint=self.session_limit_hint,
        )
        self._samplers: dict[str, _SessionSampler] = {}
        self._history: dict[str, list[int]] = {}
        self._resident_history: dict[str, list[int]] = {}
        self._digest: str | None = None  # by prefix id, for the sampler's penalties
        self.load_report = LoadReport(path, built, slice_seconds, time.perf_counter() - started)
        self.log.info(
            "stage loaded",
            stage_file=str(path),
            layers=f"{config.layer_start}:{config.layer_end}",
            slice_built=built,
            slice_s=round(slice_seconds, 3),
            load_s=round(self.load_report.load_seconds, 3),
            n_ctx=self.n_ctx,
            n_ctx_from=self.context_size.reason,
            cells_per_lane=self.cells_per_lane,
            kv_unified=config.kv_unified,
        )

    @property
    def vocab(self) -> llama_cpp.llama_vocab_p:
        return self._vocab

    @property
    def session_limit_hint(self) -> str:
        """Which setting bounds one session's tokens here, and how to raise it."""
        if self.config.kv_unified:
            return f"ctx_size={self.n_ctx} on stage {self.config.stage_id}; raise ctx_size"
        return (f"ctx_size / lane_count = {self.n_ctx} / {self.config.lane_count} on stage {self.config.stage_id}; "
                f"raise ctx_size, lower lane_count or set kv_unified=true")

    # -- loading ---------------------------------------------------------------------

    def _load_model(self, path: Path) -> llama_cpp.llama_model_p:
        cfg = self.config
        # Built (and checked against this host) before anything is loaded; kept on self
        # because params.devices points into it while llama.cpp loads.
        self.model_params = loader.model_params(cfg)
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), self.model_params.params)
        if not model:
            raise RuntimeFailure(f"stage {cfg.stage_id}: llama.cpp could not load {path}")
        return model

    def _context_size(self) -> loader.ContextSize:
        return resolve_context_size(self.config, read_model_info(self.load_path), range(self.n_layers))

    def _new_context(self, capture: Capture | LayerTap | None) -> llama_cpp.llama_context_p:
        cfg = self.config
        n_ctx = self.context_size.n_ctx
        self.context_params = loader.context_params(
            cfg, n_ctx, None if capture is None else capture.callback, None if capture is None else capture.user_data)
        ctx = llama_cpp.llama_init_from_model(self._model, self.context_params)
        if not ctx:
            raise RuntimeFailure(
                f"stage {cfg.stage_id}: llama.cpp refused the context (ctx_size={n_ctx}, "
                f"lane_count={cfg.lane_count}, cache types {cfg.cache_type_k}/{cfg.cache_type_v}, "
                f"flash_attn_type={cfg.flash_attn_type})"
            )
        try:
            self._pool = threadpool.for_context(ctx, max(cfg.n_threads, cfg.threads_batch), os.environ)
        except BaseException:
            llama_cpp.llama_free(ctx)
            raise
        return ctx

    def _alloc_batch(self) -> None:
        """A llama_batch whose arrays are numpy buffers we own, so filling it is vectorised.

        M-RoPE models (Qwen2-VL and kin) read four positions per row from a batch of hidden
        states (section-major: t, h, w, extra), where a token batch gives one and llama.cpp
        widens it as ``[p, p, p, 0]``; a stage fed hidden states must widen it the same way.
        """
        n, cfg = self.config.n_batch, self.config
        rope = int(llama_cpp.llama_model_rope_type(self._model))
        self._pos_sections = (4 if rope in (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE)
                              and not cfg.include_embeddings else 1)
        self._pos = np.zeros(n * self._pos_sections, dtype=np.int32)
        self._n_seq_id = np.ones(n, dtype=np.int32)
        self._seq = np.zeros(n, dtype=np.int32)
        self._seq_ptrs = (self._seq.ctypes.data + 4 * np.arange(n, dtype=np.uint64)).astype(np.uint64)
        self._out = np.zeros(n, dtype=np.int8)
        self._tokens = np.zeros(n, dtype=np.int32) if cfg.include_embeddings else None
        self._embd = None if cfg.include_embeddings else np.zeros((n, self.n_embd), dtype=np.float32)
        b = llama_cpp.llama_batch()
        b.n_tokens = 0
        i32p, f32p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
        b.token = self._tokens.ctypes.data_as(i32p) if self._tokens is not None else None
        b.embd = self._embd.ctypes.data_as(f32p) if self._embd is not None else None
        b.pos = self._pos.ctypes.data_as(i32p)
        b.n_seq_id = self._n_seq_id.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs.ctypes.data, ctypes.POINTER(i32p))
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    def native_frame_args(self) -> dict[str, object] | None:
        """What a stage's native frame path (``skippy_stage.stage.native_frames``) works on: this
        runtime's context, batch buffers, capture, locks and session state, shared rather than
        copied (one owner). None where that path cannot run: a head that is the whole model, several
        positions per row (M-RoPE), layer taps on the graph, a capture in Python."""
        cfg = self.config
        if (cfg.include_embeddings and cfg.include_output) or self._pos_sections != 1 or self._tap is not None:
            return None
        if not cfg.include_output and not isinstance(self._capture, NativeCapture):
            return None
        fn = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        return dict(
            ctx=self._ctx, mem=self._mem, decode=fn(llama_cpp.llama_decode),
            logits_ith=fn(llama_cpp.llama_get_logits_ith), seq_rm=fn(llama_cpp.llama_memory_seq_rm),
            batch=ctypes.addressof(self._batch), pos=self._pos.ctypes.data, seq=self._seq.ctypes.data,
            out=self._out.ctypes.data, embd=0 if self._embd is None else self._embd.ctypes.data,
            token=0 if self._tokens is None else self._tokens.ctypes.data,
            capture=0 if cfg.include_output else self._capture.user_data, n_embd=self.n_embd,
            n_vocab=self.n_vocab, n_batch=min(cfg.n_batch, cfg.n_ubatch), layer_start=cfg.layer_start,
            layer_end=cfg.layer_end, stage_index=cfg.stage_index, equal_split=self._equal_split,
            cells_per_lane=self.lanes.cells_per_lane, kv_pool_tokens=self.lanes.kv_pool_tokens, owner=self,
            compute_lock=self._compute, lanes_lock=self.lanes._lock, sessions=self.lanes._sessions,
            resident=self.lanes._resident, histories=self._history, samplers=self._samplers,
        )

    # -- validation (pure: no llama.cpp, no lane state) ------------------------------

    def _check(self, entries: Sequence[BatchEntry]) -> list[_Checked]:
        cfg = self.config
        if not entries:
            raise InvalidRequestError("entries is empty: a batch needs at least one entry")
        seen: set[str] = set()
        checked: list[_Checked] = []
        total = 0
        outputs = 0
        for i, e in enumerate(entries):
            where = f"entries[{i}]"
            if not isinstance(e.session_id, str) or not e.session_id or len(e.session_id) > MAX_SESSION_ID_LEN:
                raise InvalidRequestError(f"{where}.session_id={e.session_id!r} must be 1..{MAX_SESSION_ID_LEN} characters")
            if e.session_id in seen:
                raise InvalidRequestError(f"{where}.session_id={e.session_id!r} appears twice in one batch")
            seen.add(e.session_id)
            pos = np.asarray(e.positions)
            if pos.ndim != 1 or pos.shape[0] == 0 or pos.dtype.kind not in "iu":
                raise InvalidRequestError(f"{where}.positions must be a non-empty list of integers, got {pos.shape[0] if pos.ndim == 1 else pos.shape} values")
            n = pos.shape[0]
            total += n
            if total > cfg.n_batch:
                raise InvalidRequestError(f"batch has more than n_batch={cfg.n_batch} tokens ({where} brings the total to {total})")
            # Python ints from here: numpy scalars cost a dispatch per comparison.
            first, last = int(pos[0]), int(pos[-1])
            if first < 0 or last >= 2**31 - 1:
                k, bad = (0, first) if first < 0 else (n - 1, last)
                raise InvalidRequestError(f"{where}.positions[{k}]={bad} is out of range [0, 2^31-1)")
            if n > 1 and last - first != n - 1 or n > 2 and (np.diff(pos) != 1).any():
                k = int(np.nonzero(np.diff(pos) != 1)[0][0])
                raise InvalidRequestError(
                    f"{where}.positions are not contiguous: positions[{k}]={int(pos[k])} is followed by {int(pos[k + 1])}"
                )
            tokens = None
            if e.token_ids is not None:
                tokens = np.asarray(e.token_ids)
                if tokens.ndim != 1 or tokens.shape[0] != n or (tokens.size and tokens.dtype.kind not in "iu"):
                    raise InvalidRequestError(f"{where}.token_ids has {tokens.shape} values for {n} positions")
                if (not 0 <= int(tokens[0]) < self.n_vocab if n == 1 else
                        tokens.min() < 0 or tokens.max() >= self.n_vocab):
                    bad = np.nonzero((tokens < 0) | (tokens >= self.n_vocab))[0]
                    k = int(bad[0])
                    raise InvalidRequestError(f"{where}.token_ids[{k}]={int(tokens[k])} is out of range [0, {self.n_vocab})")
            if cfg.include_embeddings:
                if tokens is None:
                    raise InvalidRequestError(f"{where}.token_ids are required at stage {cfg.stage_id} (layer_start=0)")
                if e.hidden is not None:
                    raise InvalidRequestError(f"{where}.hidden is not accepted at stage {cfg.stage_id} (layer_start=0)")
            else:
                h = e.hidden
                if not isinstance(h, np.ndarray) or h.ndim != 2:
                    raise InvalidRequestError(f"{where}.hidden must be a 2-D float32 array (rows x n_embd={self.n_embd})")
                if h.shape[1] != self.n_embd:
                    raise InvalidRequestError(f"{where}.hidden width {h.shape[1]} != n_embd {self.n_embd}")
                if h.shape[0] != n:
                    raise InvalidRequestError(f"{where}.hidden has {h.shape[0]} rows for {n} positions")
                if h.dtype != np.float32:
                    raise InvalidRequestError(f"{where}.hidden dtype {h.dtype} is not float32")
                # A sum is finite only if every value is (NaN and inf propagate); an overflowing
                # sum of finite values falls through to the exact check.
                if not math.isfinite(float(h.sum())) and not np.isfinite(h).all():
                    row = int(np.nonzero(~np.isfinite(h).all(axis=1))[0][0])
                    raise InvalidRequestError(f"{where}.hidden row {row} holds non-finite values (NaN or inf)")
            if e.prefix_id is not None and (not isinstance(e.prefix_id, str) or not e.prefix_id
                                            or len(e.prefix_id) > MAX_SESSION_ID_LEN):
                raise InvalidRequestError(f"{where}.prefix_id={e.prefix_id!r} must be 1..{MAX_SESSION_ID_LEN} characters")
            if e.fork_of is not None:
                if not isinstance(e.fork_of, str) or not e.fork_of or len(e.fork_of) > MAX_SESSION_ID_LEN:
                    raise InvalidRequestError(f"{where}.fork_of={e.fork_of!r} must be 1..{MAX_SESSION_ID_LEN} characters")
                if e.prefix_id is not None or e.fork_of == e.session_id:
                    raise InvalidRequestError(f"{where}.fork_of={e.fork_of!r} must name another session, and not with "
                                              f"prefix_id")
            if (e.sample or e.want_logits) and not cfg.include_output:
                raise InvalidRequestError(f"{where} asks for logits or a sample, but stage {cfg.stage_id} is not the final stage")
            if e.sample and e.sampling is not None:
                bad = [t for t, _ in validated_once(e.sampling).logit_bias if not 0 <= t < self.n_vocab]
                if bad:
                    raise InvalidRequestError(f"{where}.sampling.logit_bias names token {bad[0]}, outside "
                                              f"[0, {self.n_vocab})")
            every_row = e.all_rows or e.verify or e.prompt_logprobs is not None
            outputs += n if every_row else int(e.sample or e.want_logits)
            if cfg.include_output and outputs > cfg.n_ubatch:
                # llama.cpp's output buffer grows to the largest batch's outputs x n_vocab floats
                raise InvalidRequestError(f"{where} brings the batch's output rows to {outputs}: at most "
                                          f"n_ubatch={cfg.n_ubatch} per batch (all_rows and verify output every row)")
            if e.rewind and not self.cuttable:
                raise InvalidRequestError(f"{where}.rewind: stage {cfg.stage_id} holds a recurrent model, whose state "
                                          f"cannot be cut back (no speculative decoding)")
            if e.top_logprobs is not None and (not e.sample or not 0 <= e.top_logprobs <= MAX_TOP_LOGPROBS):
                raise InvalidRequestError(f"{where}.top_logprobs={e.top_logprobs!r} must be in [0, {MAX_TOP_LOGPROBS}] "
                                          f"and needs sample_last")
            if e.prompt_logprobs is not None:
                if not cfg.include_output or not 0 <= e.prompt_logprobs <= MAX_TOP_LOGPROBS or tokens is None:
                    raise InvalidRequestError(f"{where}.prompt_logprobs={e.prompt_logprobs!r} must be in "
                                              f"[0, {MAX_TOP_LOGPROBS}], at the final stage, with the token_ids")
                if e.next_token is not None and not 0 <= e.next_token < self.n_vocab:
                    raise InvalidRequestError(f"{where}.next_token={e.next_token} is out of range [0, {self.n_vocab})")
            # Each sample adds one token (a verify step samples once per token it keeps), so a session
            # has sampled at most as often as it holds tokens: that bounds the skip a client asks for.
            if not 0 <= e.draws_before <= first:
                raise InvalidRequestError(f"{where}.draws_before={e.draws_before} must be in [0, "
                                          f"positions[0]={first}]: a session samples once per token")
            if e.verify and (not e.sample or tokens is None):
                raise InvalidRequestError(f"{where}.verify needs sample and the token_ids it verifies")
            checked.append(_Checked(e, pos.astype(np.int32), tokens))
        return checked

    # -- running ---------------------------------------------------------------------

    def run_batch(self, entries: Sequence[BatchEntry], owner: SessionOwner | None = None) -> list[EntryResult]:
        """Run one llama_decode over every entry; results come back in entry order.

        Raises InvalidRequestError / UnknownSessionError / SessionStateError /
        CapacityError before touching llama.cpp; the runtime stays usable after any of them.
        ``owner``: the connection the entries came over (``LaneTable.admit``).
        """
        tracing.mark("rb0")
        checked = self._check(entries)
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
                results = self._decode(checked, lanes)
            except BaseException:
                self._rollback(checked, lanes, new)
                raise
            for c in checked:
                self.lanes.advance(c.entry.session_id, c.n)
        tracing.mark("rb1")
        return results

    def _check_rewind(self, index: int, session_id: str, keep: int) -> None:
        """Refuse a rewind behind a sliding window's oldest kept cell (the cells before ``keep``
        that the session needs may be gone), naming the entry."""
        bound = self.lanes.lane_of(session_id)
        if bound is None or keep >= bound.n_tokens or not self._swa_window or self.config.swa_full:
            return
        if int(llama_cpp.llama_memory_seq_pos_min(self._mem, bound.lane)) > max(0, keep - self._swa_window):
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

    def _decode(self, checked: list[_Checked], lanes: dict[str, int]) -> list[EntryResult]:
        cfg = self.config
        order = sorted(range(len(checked)), key=lambda i: lanes[checked[i].entry.session_id])
        spans: dict[int, tuple[int, int]] = {}
        offset = 0
        for i in order:
            c = checked[i]
            end = offset + c.n
            self._pos[offset:end] = c.positions
            self._seq[offset:end] = lanes[c.entry.session_id]
            if self._tokens is not None:
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
        self._batch.n_tokens = offset
        if self._pos_sections == 4:
            self._pos[offset : 3 * offset] = np.tile(self._pos[:offset], 2)
            self._pos[3 * offset : 4 * offset] = 0
        if self._capture is not None:
            self._capture.reset()

        tracing.mark("d0")
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        tracing.mark("d1")
        if rc != 0:
            raise decode_error(rc, offset)
        if cfg.include_output:
            results = [self._verify_result(checked[i], spans[i][0]) if checked[i].entry.verify
                       else self._final_result(checked[i], spans[i][1] - 1) for i in range(len(checked))]
            return [dataclasses.replace(r, prompt_logprobs=self._prompt_logprobs(c, spans[i][0]))
                    if c.entry.prompt_logprobs is not None else r for i, (c, r) in enumerate(zip(checked, results))]
        return self._inner_results(checked, spans, offset)

    def _inner_results(self, checked: list[_Checked], spans: dict[int, tuple[int, int]], total: int) -> list[EntryResult]:
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

    def _final_result(self, c: _Checked, row: int) -> EntryResult:
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
        if e.sample:
            dist = self._log_softmax_row(row) if e.top_logprobs is not None else None
            token = self._sample(e.session_id, e.sampling or SamplingParams(), history, row,
                                 draws=e.draws_before)
            state = self._samplers[e.session_id]
            history.append(token)  # the chain accepted it while sampling
            state.accepted = len(history)
            if dist is not None:
                logprobs = (_token_logprob(dist, token, e.top_logprobs),)
        return EntryResult(e.session_id, logits=logits, token=token, logprobs=logprobs)

    def _prompt_logprobs(self, c: _Checked, first_row: int) -> tuple[TokenLogprob, ...]:
        """Each row's next token under that row's distribution (the token it is followed by)."""
        following = [int(t) for t in c.tokens[1:]]
        if c.entry.next_token is not None:
            following.append(int(c.entry.next_token))
        return tuple(_token_logprob(self._log_softmax_row(first_row + i), token, c.entry.prompt_logprobs)
                     for i, token in enumerate(following))

    def _log_softmax_row(self, row: int) -> np.ndarray:
        return log_softmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, row), shape=(self.n_vocab,)))

    def _verify_result(self, c: _Checked, first_row: int) -> EntryResult:
        """Sample each row in order with the session's chain; stop after the first sample that differs
        from the next row's token (the draft it checks). For a deterministic draft this *is* the
        speculative-sampling acceptance rule: the draft survives with the probability the chain gives
        it, and a rejection's sample is distributed as the chain's distribution without the draft."""
        e = c.entry
        p0 = int(c.positions[0])
        history = self._history.setdefault(e.session_id, [])
        del history[p0:]
        history.append(int(c.tokens[0]))
        state = self._sampler_for(e.session_id, e.sampling or SamplingParams(), history, e.draws_before)
        samples: list[int] = []
        logprobs: list[TokenLogprob] = []
        for i in range(c.n):
            dist = self._log_softmax_row(first_row + i) if e.top_logprobs is not None else None
            token = self._sample(e.session_id, e.sampling or SamplingParams(), history, first_row + i, state)
            samples.append(token)
            if dist is not None:
                logprobs.append(_token_logprob(dist, token, e.top_logprobs))
            if i + 1 < c.n and token != int(c.tokens[i + 1]):
                break
        # The real history: what was fed up to the last draft kept, then the samples' last, which the
        # next step feeds (and so replaces at its position, as for a plain sample).
        history.extend(samples)
        state.accepted = len(history)
        return EntryResult(e.session_id, token=samples[-1], tokens=tuple(samples),
                           logprobs=tuple(logprobs) if e.top_logprobs is not None else None)

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

    def _rollback(self, checked: list[_Checked], lanes: dict[str, int], new: list[str]) -> None:
        """Remove whatever a failed decode may have written, so the session can retry."""
        for c in checked:
            if c.entry.session_id not in new:
                llama_cpp.llama_memory_seq_rm(self._mem, lanes[c.entry.session_id], int(c.positions[0]), -1)
        self.lanes.release(new)
        for session_id in new:
            self._forget(session_id)

    # -- sessions --------------------------------------------------------------------

    def _reset_lane(self, lane: int) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, lane, -1, -1))

    def _trim_lane(self, lane: int, keep: int) -> bool:
        """Cut a lane back to ``keep`` tokens, or say it cannot be: a sliding-window cache (unless
        ``swa_full``) holds only the last window of positions, and the cells a cut leaves in front
        of ``keep`` may be gone already, which llama.cpp's seq_rm would not report."""
        if self._swa_window and not self.config.swa_full:
            if int(llama_cpp.llama_memory_seq_pos_min(self._mem, lane)) > max(0, keep - self._swa_window):
                return False
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, lane, keep, -1))

    def _fork_lane(self, source: int, lane: int, keep: int) -> bool:
        """Copy a lane's first ``keep`` tokens' KV into an empty one. Across separate lanes (streams)
        llama.cpp copies only whole streams (it asserts on a partial copy, aborting the process), and
        does so before the next decode: so copy all, then cut the copy back."""
        held = int(llama_cpp.llama_memory_seq_pos_max(self._mem, source)) + 1
        llama_cpp.llama_memory_seq_cp(self._mem, source, lane, -1, -1)
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
        return KvPage(self.page_descriptor(bound.n_tokens, bound.batches), bytes(buf)[:written], history)

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
        with self._compute:
            if self.lanes.lane_of(session_id) is not None:
                raise SessionStateError(f"session_id={session_id!r} is already bound on stage {self.config.stage_id}")
            lanes, new = self.lanes.admit([Admission(session_id, 0, got.n_tokens)])
            lane = lanes[session_id]
            buf = (ctypes.c_uint8 * len(page.data)).from_buffer_copy(page.data)
            read = int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(page.data), lane))
            # What llama.cpp restored must be exactly the page's tokens at positions 0..n-1.
            if (read != len(page.data) or int(llama_cpp.llama_memory_seq_pos_min(self._mem, lane)) != 0
                    or int(llama_cpp.llama_memory_seq_pos_max(self._mem, lane)) != got.n_tokens - 1):
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

    def drop_owned(self, session_ids: Sequence[str], owner: SessionOwner | None) -> list[str]:
        """Free those of ``session_ids`` that ``owner`` still owns (its connection closed); the
        ones freed."""
        freed = []
        with self._compute:
            if getattr(self, "_ctx", None) is None:
                return freed  # closed: nothing is held any more
            for session_id in session_ids:
                result = self.lanes.drop_owned(session_id, owner)
                if result is not None:
                    self._forget(session_id)
                    freed.append(session_id)
        if freed:
            self.log.info("sessions of a closed connection freed", sessions=len(freed), session_ids=freed[:16])
        return freed

    def _forget(self, session_id: str) -> None:
        state = self._samplers.pop(session_id, None)
        if state is not None:
            state.chain.close()
        self._history.pop(session_id, None)

    def take_taps(self) -> dict[int, np.ndarray]:
        """The rows the layer taps saw since the last call, per tapped layer (compute order)."""
        if self._tap is None:
            raise ConfigError(f"stage {self.config.stage_id} was loaded without layer taps")
        return self._tap.take()

    def stats(self) -> LaneStats:
        return self.lanes.stats()

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        with self._compute:
            for session_id in list(self._samplers):
                self._forget(session_id)
            if getattr(self, "_ctx", None):
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_pool", None) is not None:
                self._pool.free()  # after the context: nothing decodes on it now
                self._pool = None
            if getattr(self, "_model", None):
                llama_cpp.llama_model_free(self._model)
                self._model = None


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


def _token_logprob(dist: np.ndarray, token: int, n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if n:
        # llama-cpp-python's order: by log-probability, then the higher token id first on a tie
        threshold = dist[np.argpartition(dist, -n)[-n]]
        ids = np.nonzero(dist >= threshold)[0]
        best = ids[np.lexsort((-ids, -dist[ids]))][:n]
        top = tuple((int(t), float(dist[t])) for t in best)
    return TokenLogprob(int(token), float(dist[token]), top)
