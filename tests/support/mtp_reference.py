"""One-process reference for native MTP drafting: the whole model, a main and an MTP context.

What the final stage of a pipeline will do with a model's next-n layers, done the way
llama.cpp's own driver does it (``common/speculative.cpp``, ``common_speculative_impl_draft_mtp``
with one head, and the server loop around it), through the pinned bindings:

- the model is loaded with ``llama_model_params.load_mtp = True`` (and ``use_extra_bufts =
  False``, as every reference here loads);
- the main context (``LLAMA_CONTEXT_TYPE_DEFAULT``) owns the trunk's KV (and, for qwen35, its
  recurrent state, with ``n_rs_seq = 1`` so one rejected draft row can be rolled back); it is
  told ``llama_set_embeddings_nextn(main, True, masked=False)``, so every decode leaves one
  ``h_nextn`` row per batch token (``llama_get_embeddings_nextn_ith(main, i)``, ``i`` the batch
  index): the trunk's hidden state there after the final norm;
- the MTP context (``LLAMA_CONTEXT_TYPE_MTP``, ``llama_set_embeddings_nextn(mtp, True,
  masked=True)``) owns the KV of the next-n block only. Its batches (``llama_batch_ext``, run
  by ``llama_process``) pair the token at position ``p`` with the main context's ``h`` of
  position ``p - 1`` (``llama_batch_ext_set_embd_token``; zeros before position 0);
- after each main decode the MTP context decodes the same tokens at the same positions
  ("catch-up"), so its KV holds every position the main context holds;
- to draft, the MTP context's KV is first cut back to the main context's (``seq_rm`` from the
  main context's ``pos_max + 1``), then the last sampled token goes in at the next position
  with the ``h`` row of the position before it; the argmax of its logits is the draft;
- the draft is verified in the main context by one batch ``[last, draft]`` with logits for
  both rows: the greedy token of row 0 is committed; if it equals the draft, row 1's greedy
  token is committed too, otherwise the draft's position is removed from the main context.

Both decodes here (``mtp_decode`` and ``greedy_decode``) send the main context the same batch
shapes: the prompt in one batch, then ``[last, next]`` pairs with both rows as outputs, since
kernels can differ between batch sizes. Greedy's second row is a filler it never reads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from skippy_stage.model.loader import set_fields

N_CTX = 256
N_BATCH = 64
SEQ = 0


class MtpUnavailable(RuntimeError):
    """The model cannot draft with MTP layers: it has none, or they were not loaded."""


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]  # the committed tokens after the prompt
    n_drafted: int = 0
    n_accepted: int = 0
    pos_max: tuple[int, int] | None = None  # last position in the (main, MTP) KV at the end
    drafts: tuple[int, ...] = ()  # the MTP head's draft at each step (before an oracle's replaces it)


@llama_cpp.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


class MtpModel:
    """The whole model loaded once, with or without its next-n layers."""

    def __init__(self, path: str | Path, *, load_mtp: bool = True, n_threads: int = 2) -> None:
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        set_fields(params, n_gpu_layers=0, use_extra_bufts=False, load_mtp=load_mtp)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"{path}: llama.cpp could not load the model")
        self.load_mtp = load_mtp
        self.n_threads = n_threads
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)

    @property
    def n_layer_nextn(self) -> int:
        return int(llama_cpp.llama_model_n_layer_nextn(self.model))

    def close(self) -> None:
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> MtpModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _params(self, ctx_type: int) -> llama_cpp.llama_context_params:
        params = llama_cpp.llama_context_default_params()
        return set_fields(params, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_seq_max=1, n_rs_seq=1,
                          n_threads=self.n_threads, n_threads_batch=self.n_threads, ctx_type=ctx_type)

    def main_context(self) -> int:
        ctx = llama_cpp.llama_init_from_model(self.model, self._params(llama_cpp.LLAMA_CONTEXT_TYPE_DEFAULT))
        if not ctx:
            raise RuntimeError("llama.cpp could not create the main context")
        return ctx

    def mtp_context(self) -> int:
        """A draft context over the next-n layers; MtpUnavailable where there are none.

        Checked before llama.cpp is asked: a model that has next-n layers but was loaded
        without them (``load_mtp = False``) still reports ``n_layer_nextn > 0``, and an MTP
        context on it aborts the process (``GGML_ASSERT(layer.nextn.eh_proj)`` when the graph
        is reserved). With no next-n layers llama.cpp itself returns NULL.
        """
        if self.n_layer_nextn == 0:
            raise MtpUnavailable("the model has no next-n (MTP) layers")
        if not self.load_mtp:
            raise MtpUnavailable("the model was loaded without its next-n layers (load_mtp = False)")
        return self.mtp_context_unchecked()

    def mtp_context_unchecked(self) -> int:
        """llama.cpp's own answer, for a model with no next-n layers: NULL becomes MtpUnavailable."""
        ctx = llama_cpp.llama_init_from_model(self.model, self._params(llama_cpp.LLAMA_CONTEXT_TYPE_MTP))
        if not ctx:
            raise MtpUnavailable("llama.cpp refused an MTP context for this model (NULL)")
        return ctx


class _Main:
    """The main context and the two batch shapes it is sent."""

    def __init__(self, model: MtpModel) -> None:
        self.model = model
        self.ctx = model.main_context()
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, False)
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def decode(self, tokens: Sequence[int], pos0: int, *, all_logits: bool) -> None:
        if not 0 < len(tokens) <= N_BATCH:
            raise ValueError(f"{len(tokens)} tokens for a batch of {N_BATCH}")  # llama.cpp would abort
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = t, pos0 + i, 1, SEQ
            b.logits[i] = all_logits or i == len(tokens) - 1
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode (main) returned {rc}")

    def greedy(self, i: int) -> int:
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.model.n_vocab,))
        return int(np.argmax(row))

    def h(self, i: int) -> np.ndarray:
        """The ``h_nextn`` row of batch index ``i`` of the last decode, copied."""
        ptr = llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"no next-n embedding for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).copy()

    def pos_max(self) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.ctx), SEQ))

    def remove_from(self, pos: int) -> None:
        if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), SEQ, pos, -1):
            raise RuntimeError(f"the main context could not remove positions from {pos}")


class _Drafter:
    """The MTP context: kept in step with the main one, asked for one draft at a time."""

    def __init__(self, model: MtpModel) -> None:
        self.model = model
        self.ctx = model.mtp_context()
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, True)
        self.batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self.pending_h = np.zeros(model.n_embd, dtype=np.float32)  # h of the position before the next token

    def close(self) -> None:
        llama_cpp.llama_batch_ext_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def _process(self, entries: Sequence[tuple[int, int, np.ndarray]], output_last: bool) -> None:
        """Decode ``(token, pos, h)`` entries in the MTP context."""
        llama_cpp.llama_batch_ext_clear(self.batch)
        keep = []
        for token, pos, h in entries:
            idx = llama_cpp.llama_batch_ext_add_token(self.batch, SEQ, token)
            if idx < 0:
                raise RuntimeError(f"llama_batch_ext_add_token returned {idx}")
            pos_arr = (llama_cpp.llama_pos * 4)(pos, 0, 0, 0)
            row = np.ascontiguousarray(h, dtype=np.float32)
            keep.append(row)
            embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[0])
            if not llama_cpp.llama_batch_ext_set_pos(self.batch, idx, pos_arr):
                raise RuntimeError("llama_batch_ext_set_pos failed")
            if not llama_cpp.llama_batch_ext_set_embd_token(self.batch, idx, embd):
                raise RuntimeError("llama_batch_ext_set_embd_token failed")
        if output_last:
            llama_cpp.llama_batch_ext_set_output_logits(self.batch, len(entries) - 1, True)
        rc = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_process (MTP) returned {rc}")

    def catch_up(self, main: _Main, tokens: Sequence[int], pos0: int) -> list[np.ndarray]:
        """After the main context decoded ``tokens`` from ``pos0``: the same in the MTP context.

        Returns the main context's h rows of that batch (row i for ``tokens[i]``).
        """
        hs = [main.h(i) for i in range(len(tokens))]
        entries = [(t, pos0 + i, self.pending_h if i == 0 else hs[i - 1]) for i, t in enumerate(tokens)]
        self._process(entries, output_last=False)
        return hs

    def draft(self, main: _Main, last: int, pos: int) -> int:
        """The MTP head's greedy guess for the token after ``last`` (at ``pos``)."""
        self.trim(main)  # a rejected draft's catch-up row is past the main context's KV
        self._process([(last, pos, self.pending_h)], output_last=True)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, 0), shape=(self.model.n_vocab,))
        guess = int(np.argmax(row))
        self.trim(main)  # the catch-up after the verify batch writes this position again
        return guess

    def trim(self, main: _Main) -> None:
        """Cut the MTP context's KV back to the positions the main context holds."""
        if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), SEQ, main.pos_max() + 1, -1):
            raise RuntimeError("the MTP context could not trim its KV")


def greedy_decode(model: MtpModel, prompt: Sequence[int], n_tokens: int) -> DecodeResult:
    """Plain greedy decoding in the batch shapes of ``mtp_decode``: ``[last, filler]`` per step."""
    main = _Main(model)
    try:
        main.decode(prompt, 0, all_logits=False)
        out = [main.greedy(len(prompt) - 1)]
        pos = len(prompt)
        while len(out) < n_tokens:
            main.decode([out[-1], out[-1]], pos, all_logits=True)
            out.append(main.greedy(0))
            main.remove_from(pos + 1)
            pos += 1
        return DecodeResult(out)
    finally:
        main.close()


def mtp_decode(model: MtpModel, prompt: Sequence[int], n_tokens: int,
               *, oracle: Sequence[int] | None = None) -> DecodeResult:
    """Greedy decoding with one MTP draft per step, verified in the main context.

    With ``oracle`` (the tokens greedy decoding gives), the MTP context still drafts and is
    kept in step as always, but the token proposed for verification is the oracle's: random
    weights almost never draft right, and this is how the accepting branch gets exercised.
    """
    drafter = _Drafter(model)  # raises MtpUnavailable before a main context exists
    main = _Main(model)
    try:
        main.decode(prompt, 0, all_logits=False)
        hs = drafter.catch_up(main, prompt, 0)
        drafter.pending_h = hs[-1]
        out = [main.greedy(len(prompt) - 1)]
        pos = len(prompt)  # where out[-1] goes
        n_drafted = n_accepted = 0
        drafts: list[int] = []
        while len(out) < n_tokens:
            draft = drafter.draft(main, out[-1], pos)
            drafts.append(draft)
            if oracle is not None:
                draft = oracle[len(out)] if len(out) < len(oracle) else draft
            n_drafted += 1
            main.decode([out[-1], draft], pos, all_logits=True)
            hs = drafter.catch_up(main, [out[-1], draft], pos)
            first = main.greedy(0)
            if first == draft:
                n_accepted += 1
                out += [draft, main.greedy(1)]
                drafter.pending_h = hs[1]
                pos += 2
            else:
                out.append(first)
                main.remove_from(pos + 1)
                drafter.pending_h = hs[0]
                pos += 1
        drafter.trim(main)  # as before the next draft: a rejected row's catch-up goes
        mtp_pos_max = int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(drafter.ctx), SEQ))
        return DecodeResult(out[:n_tokens], n_drafted, n_accepted, (main.pos_max(), mtp_pos_max), tuple(drafts))
    finally:
        main.close()
        drafter.close()
