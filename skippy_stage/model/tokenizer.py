"""The loaded model's tokenizer and text metadata: what the head turns text into and back.

Only the head tokenises (the stages below see token ids); it lives beside the runtime that
owns the model pointer and is valid for as long as that runtime is open.
"""

from __future__ import annotations

import ctypes

import llama_cpp


class Tokenizer:
    def __init__(self, model: llama_cpp.llama_model_p) -> None:
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)

    @property
    def n_vocab(self) -> int:
        return int(llama_cpp.llama_vocab_n_tokens(self._vocab))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama_cpp.llama_token * capacity)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The token's text as bytes (maybe part of a character); ``special``: control tokens as their
        text (``<|im_end|>``) rather than nothing. ``token`` must be in [0, n_vocab): llama.cpp does
        not check it."""
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value of the loaded stage file, as llama.cpp reads it."""
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """The token's text; "" for none (a vocabulary without BOS says -1, and llama.cpp's lookup of an id
        outside the vocabulary throws through C, aborting the process)."""
        if not 0 <= token < llama_cpp.llama_vocab_n_tokens(self._vocab):
            return ""
        return llama_cpp.llama_vocab_get_text(self._vocab, token).decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self._vocab))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
