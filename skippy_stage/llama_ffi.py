"""The few ggml symbols llama-cpp-python does not bind, and process-wide llama.cpp setup.

Hidden states leave a stage through the backend scheduler's eval callback, which hands us
raw ``ggml_tensor`` pointers; reading them needs ``ggml_get_name``, ``ggml_nbytes`` and
``ggml_backend_tensor_get`` from libggml-base, which ships next to llama_cpp's own libs.

Backend devices (for ``selected_device`` and ``skippy-stage info``) come from libggml's
registry. A portable build (``GGML_BACKEND_DL=ON``, as the container uses) registers no
backend until one is loaded from disk, so :func:`init_backend` loads them from llama_cpp's
library directory when the registry is empty.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import llama_cpp
from llama_cpp import _logger as llama_logger

GGML_TYPE_F32 = 0

_lib_dir = Path(llama_cpp.__file__).parent / "lib"


def _same_library_as_libllama(name: str) -> ctypes.CDLL:
    """Open the copy of ``name`` that libllama itself linked (by its soname, ``name.so.0``).

    A wheel cannot hold symlinks, so ``libggml.so`` and ``libggml.so.0`` are two files; opening
    the other one would give this process a second ggml with a registry of its own, and
    backends loaded into it would be invisible to llama.cpp.
    """
    for candidate in (f"{name}.so.0", f"{name}.so"):
        if (_lib_dir / candidate).exists():
            return ctypes.CDLL(str(_lib_dir / candidate))
    raise OSError(f"{name}.so not found in {_lib_dir}")


_ggml_base = _same_library_as_libllama("libggml-base")

ggml_get_name = _ggml_base.ggml_get_name
ggml_get_name.argtypes = [ctypes.c_void_p]
ggml_get_name.restype = ctypes.c_char_p

ggml_nbytes = _ggml_base.ggml_nbytes
ggml_nbytes.argtypes = [ctypes.c_void_p]
ggml_nbytes.restype = ctypes.c_size_t

ggml_backend_tensor_get = _ggml_base.ggml_backend_tensor_get
ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
ggml_backend_tensor_get.restype = None

ggml_backend_dev_name = _ggml_base.ggml_backend_dev_name
ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
ggml_backend_dev_name.restype = ctypes.c_char_p

ggml_backend_dev_description = _ggml_base.ggml_backend_dev_description
ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
ggml_backend_dev_description.restype = ctypes.c_char_p

ggml_backend_dev_type = _ggml_base.ggml_backend_dev_type
ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
ggml_backend_dev_type.restype = ctypes.c_int

ggml_backend_dev_memory = _ggml_base.ggml_backend_dev_memory
ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
ggml_backend_dev_memory.restype = None

_ggml = _same_library_as_libllama("libggml")

ggml_backend_reg_count = _ggml.ggml_backend_reg_count
ggml_backend_reg_count.argtypes = []
ggml_backend_reg_count.restype = ctypes.c_size_t

ggml_backend_dev_count = _ggml.ggml_backend_dev_count
ggml_backend_dev_count.argtypes = []
ggml_backend_dev_count.restype = ctypes.c_size_t

ggml_backend_dev_get = _ggml.ggml_backend_dev_get
ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
ggml_backend_dev_get.restype = ctypes.c_void_p

ggml_backend_load_all_from_path = _ggml.ggml_backend_load_all_from_path
ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
ggml_backend_load_all_from_path.restype = None

# enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class _TensorHead(ctypes.Structure):
    """The stable leading fields of ``struct ggml_tensor`` (type, buffer, ne[4])."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


def tensor_shape(tensor: int) -> tuple[int, int, int]:
    """``(ggml type, ne0, ne1)`` of a tensor pointer handed to the eval callback."""
    head = _TensorHead.from_address(tensor)
    return head.type, head.ne[0], head.ne[1]


def lib_dir() -> Path:
    """Where llama_cpp keeps libllama and the ggml libraries it loaded."""
    return _lib_dir


def backend_dirs() -> list[Path]:
    """Where a GGML_BACKEND_DL build's backend modules may be: beside libllama, or where
    llama-cpp-python's wheel installs ggml's runtime files (``<site-packages>/bin``)."""
    return [_lib_dir, _lib_dir.parent.parent / "bin"]


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
        if ggml_backend_reg_count() == 0:
            # A GGML_BACKEND_DL build: ggml scores each CPU variant (libggml-cpu-haswell.so,
            # ...) against this CPU and loads the best one.
            for where in backend_dirs():
                ggml_backend_load_all_from_path(str(where).encode())
                if ggml_backend_reg_count():
                    break
            else:
                raise RuntimeError(
                    f"no ggml backend could be loaded from {', '.join(map(str, backend_dirs()))}: a llama.cpp "
                    f"built with GGML_BACKEND_DL needs its backend modules (libggml-cpu-*.so) in one of them"
                )
        _initialised = True
