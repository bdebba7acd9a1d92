"""llama-cpp-python's own multimodal path on the unsplit model: what a split with images is held to.

``MTMDChatHandler``'s libmtmd context on a ``Llama`` loaded as the stages load
(``loader.reference_llama_like``), evaluating a prompt the way the handler's ``__call__`` does:
text chunks through ``Llama.eval``, each image through ``mtmd_helper_eval_chunk_single``; then
greedy tokens one ``eval`` at a time. The exactness tests compare a split's logits with these
bit for bit; ``bench`` times them against the split's.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _logger as llama_logger

from skippy_stage.config import StageConfig
from skippy_stage.model.loader import reference_llama_like


class MultimodalReference:
    """The unsplit model with ``cfg``'s context and ``projector``, in this process."""

    def __init__(self, cfg: StageConfig, projector: str | Path, *, logits_all: bool) -> None:
        """``logits_all``: every text row an output (as a chain asked for ``all_rows``), or each batch's
        last only (as a head's prompt chunks and generation steps)."""
        import llama_cpp.mtmd_cpp as mtmd
        from llama_cpp.llama_chat_format import MTMDChatHandler

        self.mtmd = mtmd
        # libmtmd logs every chunk to stderr by default; llama-cpp-python's logger keeps errors only
        mtmd.mtmd_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))
        self.llm = reference_llama_like(cfg, logits_all=logits_all)
        self.handler = MTMDChatHandler(clip_model_path=str(projector), verbose=False)
        self.handler._init_mtmd_context(self.llm)
        self.encode_s: list[float] = []  # each image's encode, in the last ``greedy`` (libmtmd's tower)

    def greedy(self, prompt: str, images: list[bytes], n_tokens: int) -> tuple[int, list[np.ndarray], list[int]]:
        """The prompt's length in positions, each step's last row of logits and the greedy tokens."""
        self.prefill(prompt, images)
        length = self.llm.n_tokens
        rows = [self._last_row()]
        tokens = [int(np.argmax(rows[-1]))]
        while len(tokens) < n_tokens:
            self.llm.eval([tokens[-1]])
            rows.append(self._last_row())
            tokens.append(int(np.argmax(rows[-1])))
        return length, rows, tokens

    def prefill(self, prompt: str, images: list[bytes]) -> None:
        """The prompt and its images evaluated from an empty context, chunk by chunk as the handler does."""
        mtmd, llm, ctx = self.mtmd, self.llm, self.handler.mtmd_ctx
        bitmaps = [self.handler._create_bitmap_from_bytes(image) for image in images]
        text = mtmd.mtmd_input_text()
        data = prompt.encode()
        text.text, text.text_len, text.add_special, text.parse_special = data, len(data), True, True
        chunks = mtmd.mtmd_input_chunks_init()
        self.encode_s = []
        try:
            rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps),
                                    len(bitmaps))
            if rc != 0:
                raise ValueError(f"mtmd_tokenize failed ({rc})")
            llm.reset()
            llm._ctx.kv_cache_clear()
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    llm.eval([tokens[j] for j in range(n.value)])
                    continue
                started = time.perf_counter()  # the encode alone, as the head's metric times it
                if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                    raise ValueError("mtmd_encode_chunk failed")
                self.encode_s.append(time.perf_counter() - started)
                past = llama_cpp.llama_pos(0)
                # encodes again (the handler's own call, which the reference must make), then decodes
                if mtmd.mtmd_helper_eval_chunk_single(ctx, llm._ctx.ctx, chunk, llm.n_tokens, 0, llm.n_batch, False,
                                                      ctypes.byref(past)) != 0:
                    raise ValueError("mtmd_helper_eval_chunk_single failed")
                llm.n_tokens = past.value
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _last_row(self) -> np.ndarray:
        """The last decode's last row of logits (``Llama.scores`` keeps none without logits_all)."""
        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).copy()

    def render(self, chat: list[dict]) -> str:
        """``chat`` as llama-cpp-python's multimodal handler renders it (each image part its marker), the
        parts joined into one string: SmolLM2's template concatenates a message's content as a string."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        marker = self.mtmd.mtmd_default_marker().decode()
        flat = [{**m, "content": "".join(p["text"] for p in self.handler._get_template_messages([m], marker)[0]["content"])}
                if isinstance(m["content"], list) else m for m in chat]
        # (-1 where the vocabulary has none: no text, as the head renders it)
        eos, bos = (self.llm.detokenize([t]).decode() if t >= 0 else "" for t in (self.llm.token_eos(),
                                                                                 self.llm.token_bos()))
        formatter = Jinja2ChatFormatter(template=self.llm.metadata["tokenizer.chat_template"], eos_token=eos,
                                        bos_token=bos)
        return formatter(messages=flat).prompt

    def text(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode("utf-8", errors="ignore")

    def close(self) -> None:
        if self.handler.mtmd_ctx is not None:
            self.mtmd.mtmd_free(self.handler.mtmd_ctx)  # before the model it was loaded beside
            self.handler.mtmd_ctx = None
        self.llm.close()
