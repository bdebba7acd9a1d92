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


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, restype: object) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_VOIDP, _SIZE = ctypes.c_void_p, ctypes.c_size_t
_ggml_base = _same_library_as_libllama("libggml-base")
ggml_get_name = _bind(_ggml_base, "ggml_get_name", [_VOIDP], ctypes.c_char_p)
ggml_nbytes = _bind(_ggml_base, "ggml_nbytes", [_VOIDP], _SIZE)
ggml_backend_tensor_get = _bind(_ggml_base, "ggml_backend_tensor_get", [_VOIDP, _VOIDP, _SIZE, _SIZE], None)
ggml_backend_dev_name = _bind(_ggml_base, "ggml_backend_dev_name", [_VOIDP], ctypes.c_char_p)
ggml_backend_dev_description = _bind(_ggml_base, "ggml_backend_dev_description", [_VOIDP], ctypes.c_char_p)
ggml_backend_dev_type = _bind(_ggml_base, "ggml_backend_dev_type", [_VOIDP], ctypes.c_int)
ggml_backend_dev_memory = _bind(_ggml_base, "ggml_backend_dev_memory",
                                [_VOIDP, ctypes.POINTER(_SIZE), ctypes.POINTER(_SIZE)], None)
ggml_backend_reg_get_proc_address = _bind(_ggml_base, "ggml_backend_reg_get_proc_address",
                                          [_VOIDP, ctypes.c_char_p], _VOIDP)

_ggml = _same_library_as_libllama("libggml")
ggml_backend_reg_count = _bind(_ggml, "ggml_backend_reg_count", [], _SIZE)
ggml_backend_dev_count = _bind(_ggml, "ggml_backend_dev_count", [], _SIZE)
ggml_backend_dev_get = _bind(_ggml, "ggml_backend_dev_get", [_SIZE], _VOIDP)
ggml_backend_load_all_from_path = _bind(_ggml, "ggml_backend_load_all_from_path", [ctypes.c_char_p], None)
ggml_backend_reg_by_name = _bind(_ggml, "ggml_backend_reg_by_name", [ctypes.c_char_p], _VOIDP)

# enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def bind_base(name: str, argtypes: list, restype: object) -> ctypes._CFuncPtr:
    """A libggml-base function llama-cpp-python does not bind."""
    return _bind(_ggml_base, name, argtypes, restype)


def bind_llama(name: str, argtypes: list, restype: object) -> ctypes._CFuncPtr:
    """A libllama function llama-cpp-python does not bind (a prototype of our own, not its)."""
    return _bind(ctypes.CDLL(llama_cpp.llama_cpp._lib._name), name, argtypes, restype)


def cpu_backend_function(name: str, restype: object, *argtypes: object) -> ctypes._CFuncPtr:
    """A function of the CPU backend by name, through ggml's registry: where the backend is a
    module loaded at run time (GGML_BACKEND_DL) no library of ours links it."""
    init_backend()
    reg = ggml_backend_reg_by_name(b"CPU")
    address = ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise RuntimeError(f"llama.cpp's CPU backend does not offer {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


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
