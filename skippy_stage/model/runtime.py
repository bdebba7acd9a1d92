"""The llama.cpp runtime of one stage: load a layer range and own the context that runs its batches.

``StageRuntime`` is the only owner of the llama.cpp model and context. It loads them here;
running a batch (``batch_runner``) and a session's KV beyond a batch (``session_kv``) are its
other parts, each in a module of its own. Everything a client sends is checked
(``batch.check_batch``) before any of it reaches llama.cpp, because llama.cpp answers some
bad input (more tokens than ``n_batch``, for one) by aborting the whole process.

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
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import structlog
from llama_cpp import llama_cpp_ext

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, RuntimeFailure
from skippy_stage.model import llama_ffi, loader, mtp, threadpool
from skippy_stage.model.batch import BatchEntry, EntryResult
from skippy_stage.model.batch_runner import BatchRunner, _SessionSampler, decode_error
from skippy_stage.model.capture import Capture, LayerTap, NativeCapture, make_capture
from skippy_stage.model.compute_lock import ComputeLock
from skippy_stage.model.kv_page import KvPage, KvPageDesc
from skippy_stage.model.lanes import LaneStats, LaneTable
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.model.mrope import MropeLanes
from skippy_stage.model.projector import Projector
from skippy_stage.model.session_kv import SessionKv
from skippy_stage.model.slicing import read_model_info
from skippy_stage.model.stage_file import resolve_context_size, resolve_stage_file
from skippy_stage.model.tokenizer import Tokenizer

# The batch and page types, and decode_error, are the runtime's vocabulary: its importers take them here too.
__all__ = ["BatchEntry", "EntryResult", "KvPage", "KvPageDesc", "LoadReport", "StageRuntime", "TokenLogprob",
           "decode_error"]

log = structlog.get_logger("skippy_stage.runtime")


@dataclass(frozen=True)
class LoadReport:
    stage_file: Path
    slice_built: bool
    slice_seconds: float
    load_seconds: float


class StageRuntime(BatchRunner, SessionKv):
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
        self.n_layers = int(llama_cpp.llama_model_n_layer(self._model))  # the trunk: next-n blocks not counted
        # A final stage's slice keeps the model's multi-token-prediction blocks after its trunk.
        self.n_layers_nextn = int(llama_cpp.llama_model_n_layer_nextn(self._model))
        if config.native_mtp_enabled:
            try:
                mtp.check_model(self._model, path, cuttable=not (llama_cpp.llama_model_is_recurrent(self._model)
                                                                 or llama_cpp.llama_model_is_hybrid(self._model)))
            except ConfigError as exc:
                llama_cpp.llama_model_free(self._model)
                self._model = None
                raise ConfigError(f"stage {config.stage_id}: {exc}") from None
        n_embd_inp = int(llama_cpp.llama_model_n_embd_inp(self._model))
        if not config.include_embeddings and n_embd_inp != self.n_embd:
            # llama.cpp would read hidden-state rows n_embd_inp wide from our n_embd-wide batch.
            raise ConfigError(f"stage {config.stage_id}: stage file {path} expects input rows {n_embd_inp} wide, "
                              f"but hidden states are n_embd={self.n_embd} wide")
        if self.n_layers + self.n_layers_nextn != config.n_layers:
            raise ConfigError(
                f"stage {config.stage_id}: stage file {path} has {self.n_layers + self.n_layers_nextn} layers, "
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
        self._mtp = self._new_drafter()
        self.projector = self._load_projector()
        self._compute = threading.Lock()
        # Taken inside ``_compute``, around the decode alone (``compute_lock``).
        self._host_lock = None if config.compute_lock_path is None else ComputeLock(
            config.compute_lock_path, stage_id=config.stage_id)
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
            reset=self._reset_lane if self._mtp is None else self._reset_lane_mtp,
            trim=(self._trim_lane if self._mtp is None else self._trim_lane_mtp) if cuttable else None,
            fork=(self._fork_lane if self._mtp is None else self._fork_lane_mtp) if cuttable else None,
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
    def closed(self) -> bool:
        """Whether :meth:`close` has freed the context. The native frame path reads it (by this
        name) under the compute lock before each decode, and declines the frame once it is true."""
        return getattr(self, "_ctx", None) is None

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

    def _load_projector(self) -> Projector | None:
        """libmtmd beside this head's model, set the way llama-cpp-python's multimodal handler sets it
        for a model loaded like this one (``projector``); None without ``projector_path``."""
        cfg = self.config
        if cfg.projector_path is None:
            return None
        try:
            return Projector(cfg.projector_path, self._model, n_embd=self.n_embd, n_threads=cfg.n_threads,
                             flash_attn=cfg.flash_attn_type == "enabled", marker=cfg.media_marker,
                             min_tokens=cfg.image_min_tokens, max_tokens=cfg.image_max_tokens, stage_id=cfg.stage_id)
        except ConfigError as exc:
            raise ConfigError(f"stage {cfg.stage_id}: {exc}") from None

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

    def _new_drafter(self) -> mtp.MtpDrafter | None:
        """With ``native_mtp_enabled``: the MTP context beside the main one, whose decodes now leave
        the trunk's last hidden row (after the final norm) for every batch token (``mtp``)."""
        if not self.config.native_mtp_enabled:
            return None
        if self._mrope is not None:
            raise ConfigError(f"stage {self.config.stage_id}: native_mtp_enabled on a model with M-RoPE positions: "
                              f"its MTP layers would not keep an image's 2-D positions")
        drafter = mtp.MtpDrafter(self._model, self.config, self.context_size.n_ctx, n_embd=self.n_embd,
                                 n_vocab=self.n_vocab)
        llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, False)  # unmasked: every row, by batch index
        return drafter

    # The lane table's hooks with the MTP context kept in step: a reused, cut or copied lane never
    # drafts from MTP KV that is not the session's.
    def _reset_lane_mtp(self, lane: int) -> bool:
        ok = self._reset_lane(lane)
        return self._mtp.reset(lane) and ok

    def _trim_lane_mtp(self, lane: int, keep: int) -> bool:
        ok = self._trim_lane(lane, keep)
        if ok:
            self._mtp.trim(lane, keep)
        return ok

    def _fork_lane_mtp(self, source: int, lane: int, keep: int) -> bool:
        ok = self._fork_lane(source, lane, keep)
        if ok:
            self._mtp.fork(source, lane, keep)
        return ok

    def _alloc_batch(self) -> None:
        """A llama_batch whose arrays are numpy buffers we own, so filling it is vectorised.

        M-RoPE models (Qwen2-VL and kin) read four positions per row from a batch of hidden
        states (section-major: t, h, w, extra), where a token batch gives one and llama.cpp
        widens it as ``[p, p, p, 0]``; a stage fed hidden states must widen it the same way, and a
        head's image rows take four of their own (``mrope``).
        """
        n, cfg = self.config.n_batch, self.config
        rope = int(llama_cpp.llama_model_rope_type(self._model))
        is_mrope = rope in (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE)
        # Where the images each lane's KV holds are, rows and model positions apart.
        self._mrope = MropeLanes() if is_mrope else None
        self._pos_sections = 4 if is_mrope and not cfg.include_embeddings else 1
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
        self._media_batch = self._media_embd = self._media_pos = None
        if cfg.include_embeddings and cfg.projector_path is not None:
            self._media_embd = np.zeros((n, self.n_embd), dtype=np.float32)
            m = llama_cpp.llama_batch()
            m.n_tokens, m.token, m.embd = 0, None, self._media_embd.ctypes.data_as(f32p)
            m.pos, m.n_seq_id, m.seq_id, m.logits = b.pos, b.n_seq_id, b.seq_id, b.logits
            if is_mrope:  # image rows on a grid: four positions each
                self._media_pos = np.zeros(4 * n, dtype=np.int32)
                m.pos = self._media_pos.ctypes.data_as(i32p)
            self._media_batch = m

    def native_frame_args(self) -> dict[str, object] | None:
        """What a stage's native frame path (``skippy_stage.stage.native_frames``) works on: this
        runtime's context, batch buffers, capture, locks and session state, shared rather than
        copied (one owner). None where that path cannot run: a head that is the whole model, several
        positions per row (M-RoPE), a head whose images take M-RoPE positions (its rows are then not
        its positions), layer taps on the graph, a capture in Python, MTP layers to keep in step after
        each decode (``native_mtp_enabled``)."""
        cfg = self.config
        if (cfg.include_embeddings and cfg.include_output) or self._pos_sections != 1 or self._tap is not None \
                or self._mtp is not None or (self._mrope is not None and self._media_batch is not None):
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
            compute_lock_fd=-1 if self._host_lock is None else self._host_lock.fd,
            compute_lock=self._compute, lanes_lock=self.lanes._lock, sessions=self.lanes._sessions,
            resident=self.lanes._resident, histories=self._history, samplers=self._samplers,
        )

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
            if getattr(self, "_mtp", None) is not None:
                self._mtp.close()  # before the model it drafts with
                self._mtp = None
            if getattr(self, "_ctx", None):
                llama_cpp.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_pool", None) is not None:
                self._pool.free()  # after the context: nothing decodes on it now
                self._pool = None
            if getattr(self, "projector", None) is not None:
                self.projector.close()  # before the model it was loaded beside
                self.projector = None
            if getattr(self, "_model", None):
                llama_cpp.llama_model_free(self._model)
                self._model = None
            if getattr(self, "_host_lock", None) is not None:
                self._host_lock.close()
