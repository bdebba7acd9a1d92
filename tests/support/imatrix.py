"""An importance matrix computed as llama.cpp's ``llama-imatrix`` computes one, for the fixture models.

``tools/imatrix/imatrix.cpp`` sets the context's eval callback and, for every matrix multiplication
whose weight is a model tensor, adds each input column's squared activations to a per-tensor sum and
the number of input rows to a count. The same here, through ``llama_context_params.cb_eval``:

- asked about a node (``ask=true``), say yes to a ``MUL_MAT`` whose weight (``src[0]``) is named
  ``blk.*`` (the output head only with ``--process-output``, which is off by default, so never here)
  and whose activations (``src[1]``) are float32 rows, at least 16 of them (the tool skips smaller
  batches); a ``MUL_MAT_ID`` (an expert matrix of a MoE model) is refused, the fixtures here being dense;
- told the node was computed (``ask=false``), read ``src[1]`` with ``ggml_backend_tensor_get`` and add,
  per 2-D matrix of the weight, ``x[j]**2`` over the rows in float32 (the tool's ``std::vector<float>``)
  and ``ggml_nrows(src1) / n_mat`` to the count.

The text is evaluated in chunks of ``chunk_size`` tokens, each from an empty cache with every row an
output (the tool computes perplexity, so the last layer keeps all rows). The result is written as the
tool writes it: ``<weight>.in_sum2`` (``ne = [n_per_row, n_mat]``) and ``<weight>.counts``
(``ne = [1, n_mat]``) in float32, sorted by name, with ``general.type = imatrix``, ``imatrix.datasets``,
``imatrix.chunk_count`` and ``imatrix.chunk_size``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp
import numpy as np

from skippy_stage.model import llama_ffi

__all__ = ["Collected", "collect", "compute_imatrix", "text_tokens", "write_imatrix"]

_GGML_MAX_DIMS, _GGML_MAX_SRC, _GGML_MAX_OP_PARAMS, _GGML_MAX_NAME = 4, 10, 64, 64
_MIN_ROWS = 16  # imatrix.cpp: "why are small batches ignored (<16 tokens)?"


class _Tensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml.h, up to its name (the fields read here)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
    ]


_ggml_op_name = llama_ffi.bind_base("ggml_op_name", [ctypes.c_int], ctypes.c_char_p)


def _weight_name(name: bytes) -> str:
    """imatrix.cpp's filter_tensor_name: ``CUDA0#blk.0.attn_k.weight#0`` -> ``blk.0.attn_k.weight``."""
    text = name.decode("utf-8", "replace")
    return text.split("#")[1] if "#" in text else text


@dataclass
class Collected:
    """Per weight: the summed squared activations (``n_mat`` rows of ``n_per_row``) and the counts."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    n_tokens: int = 0
    n_chunks: int = 0


class _Collector:
    def __init__(self) -> None:
        self.result = Collected({}, {})
        self.error: str | None = None
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        try:
            t = _Tensor.from_address(tensor)
            op = _ggml_op_name(t.op)
            if op not in (b"MUL_MAT", b"MUL_MAT_ID") or not t.src[0] or not t.src[1]:
                return False
            src0, src1 = _Tensor.from_address(t.src[0]), _Tensor.from_address(t.src[1])
            if ask:
                if op == b"MUL_MAT_ID":
                    return True  # the tool collects every one; refused below, loudly
                return (src1.ne[1] >= _MIN_ROWS and src1.type == llama_ffi.GGML_TYPE_F32
                        and _weight_name(src0.name).startswith("blk."))
            if op == b"MUL_MAT_ID":
                self.error = f"{_weight_name(src0.name)}: MUL_MAT_ID (expert matrices) is not collected here"
                return False
            self._add(t, src0, src1)
        except Exception as exc:  # noqa: BLE001 - an exception must not unwind through C frames
            self.error = repr(exc)
            return False
        return True

    def _add(self, t: _Tensor, src0: _Tensor, src1: _Tensor) -> None:
        name = _weight_name(src0.name)
        ne0 = src1.ne[0]
        n_mat = src0.ne[2] * src0.ne[3]
        raw = np.empty(llama_ffi.ggml_nbytes(t.src[1]), dtype=np.uint8)
        llama_ffi.ggml_backend_tensor_get(t.src[1], raw.ctypes.data, 0, raw.size)
        assert src1.nb[0] == 4, f"{name}: activations are not contiguous float32 rows"
        x = np.lib.stride_tricks.as_strided(raw.view(np.float32), shape=tuple(reversed(src1.ne)),
                                            strides=tuple(reversed(src1.nb)), writeable=False)
        sums = self.result.sums.setdefault(name, np.zeros((n_mat, ne0), dtype=np.float32))
        counts = self.result.counts.setdefault(name, np.zeros(1, dtype=np.int64))
        if sums.shape != (n_mat, ne0):
            raise ValueError(f"{name}: inconsistent size ({sums.shape} vs {(n_mat, ne0)})")
        for i3 in range(src1.ne[3]):
            for i2 in range(src1.ne[2]):
                acc = sums[(i3 % src0.ne[3]) * src0.ne[2] + (i2 % src0.ne[2])]
                for row in x[i3, i2]:  # row by row in float32, as the tool adds them
                    acc += row * row
        if not np.isfinite(sums).all():
            raise ValueError(f"non-finite values detected in {name}")
        counts += src1.ne[1] * src1.ne[2] * src1.ne[3] // n_mat  # ggml_nrows(src1) / n_mat


def text_tokens(text: str, n_vocab: int) -> list[int]:
    """The fixture models' vocabulary is ``tok_0`` .. ``tok_{n_vocab-1}`` and no tokenizer: a
    character is the token of its code point (ASCII text into a 128-token vocabulary)."""
    tokens = [ord(c) for c in text]
    if any(t >= n_vocab for t in tokens):
        raise ValueError(f"text has characters outside the {n_vocab}-token vocabulary")
    return tokens


def collect(model: str | Path, tokens: list[int], chunk_size: int, n_threads: int = 2) -> Collected:
    """Evaluate ``tokens`` in whole chunks of ``chunk_size`` (a trailing part is dropped, as the tool
    drops it), every row an output, and collect each weight's squared activations."""
    if chunk_size < _MIN_ROWS:
        raise ValueError(f"chunk_size={chunk_size}: llama-imatrix skips batches of fewer than {_MIN_ROWS} rows")
    n_chunks = len(tokens) // chunk_size
    if n_chunks == 0:
        raise ValueError(f"{len(tokens)} tokens make no chunk of {chunk_size}")
    llama_ffi.init_backend()
    collector = _Collector()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    loaded = llama_cpp.llama_model_load_from_file(str(model).encode(), model_params)
    if not loaded:
        raise RuntimeError(f"llama.cpp could not load {model}")
    ctx = batch = None
    try:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = chunk_size
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        params.cb_eval = collector.callback
        params.cb_eval_user_data = None
        ctx = llama_cpp.llama_init_from_model(loaded, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {model}")
        batch = llama_cpp.llama_batch_init(chunk_size, 0, 1)
        for c in range(n_chunks):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            for i, token in enumerate(tokens[c * chunk_size : (c + 1) * chunk_size]):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = chunk_size
            rc = llama_cpp.llama_decode(ctx, batch)
            if collector.error is not None:
                raise RuntimeError(f"imatrix collection failed: {collector.error}")
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(loaded)
    collector.result.n_tokens, collector.result.n_chunks = n_chunks * chunk_size, n_chunks
    return collector.result


def write_imatrix(collected: Collected, dest: str | Path, datasets: list[str], chunk_size: int) -> Path:
    """``collected`` as llama-imatrix's GGUF: sums and counts per weight, in name order."""
    writer = gguf.GGUFWriter(str(dest), arch="imatrix")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)  # gguf-py adds one; the tool writes none
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", datasets)
    writer.add_uint32("imatrix.chunk_count", collected.n_chunks)
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(collected.sums):
        sums, counts = collected.sums[name], collected.counts[name]
        writer.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))  # numpy (n_mat, n_per_row)
        writer.add_tensor(f"{name}.counts", counts.astype(np.float32).reshape(len(counts), 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest)


def compute_imatrix(model: str | Path, text: str, dest: str | Path, chunk_size: int = 32) -> Path:
    """``llama-imatrix -m model -f text -c chunk_size`` for a fixture model: the imatrix GGUF at ``dest``."""
    n_vocab = len(gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
    collected = collect(model, text_tokens(text, n_vocab), chunk_size)
    return write_imatrix(collected, dest, ["fixture text"], chunk_size)
