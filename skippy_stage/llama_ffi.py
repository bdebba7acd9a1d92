"""The few ggml symbols llama-cpp-python does not bind, and process-wide llama.cpp setup.

Hidden states leave a stage through the backend scheduler's eval callback, which hands us
raw ``ggml_tensor`` pointers; reading them needs ``ggml_get_name``, ``ggml_nbytes`` and
``ggml_backend_tensor_get`` from libggml-base, which ships next to llama_cpp's own libs.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp
from llama_cpp import _logger as llama_logger

GGML_TYPE_F32 = 0

_lib_dir = Path(llama_cpp.__file__).parent / "lib"
_ggml_base = ctypes.CDLL(str(_lib_dir / "libggml-base.so"))

ggml_get_name = _ggml_base.ggml_get_name
ggml_get_name.argtypes = [ctypes.c_void_p]
ggml_get_name.restype = ctypes.c_char_p

ggml_nbytes = _ggml_base.ggml_nbytes
ggml_nbytes.argtypes = [ctypes.c_void_p]
ggml_nbytes.restype = ctypes.c_size_t

ggml_backend_tensor_get = _ggml_base.ggml_backend_tensor_get
ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
ggml_backend_tensor_get.restype = None


class _TensorHead(ctypes.Structure):
    """The stable leading fields of ``struct ggml_tensor`` (type, buffer, ne[4])."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


def tensor_shape(tensor: int) -> tuple[int, int, int]:
    """``(ggml type, ne0, ne1)`` of a tensor pointer handed to the eval callback."""
    head = _TensorHead.from_address(tensor)
    return head.type, head.ne[0], head.ne[1]


_init_lock = threading.Lock()
_initialised = False


def init_backend() -> None:
    """Initialise llama.cpp once per process and keep its log quiet but for errors."""
    global _initialised
    with _init_lock:
        if _initialised:
            return
        llama_logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        _initialised = True
