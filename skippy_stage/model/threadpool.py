"""A persistent ggml CPU thread pool for every context that decodes, where llama.cpp was built
without OpenMP.

Why: such a build (GGML_OPENMP=OFF; macOS builds usually are: Apple's clang ships no OpenMP)
starts a *disposable* pool — new threads, joined at the end — for every graph a context runs
without one attached, and a stage runs several graphs per decode (the capture splits it).
Measured with SmolLM2 on a 2-vCPU Xeon (``skippy-stage floor``-style driver, 2 threads):
the unsplit model 0.91x, the 2- and 3-stage splits 0.38x / 0.35x of the same build with a pool
attached. With OpenMP, ggml runs graphs on OpenMP's own threads and never reads an attached
pool's, so none is made.

``poll``: how long the pool's idle threads spin after a graph before they sleep (ggml's level:
0 not at all, each unit ~128 Ki pause instructions; llama.cpp's own default 50). Co-located
stages get 0 from their launcher (``config.shared_host_openmp``: a stage that finished must not
spin on the cores the next stage decodes on — the same reason as their OpenMP spin count); a
stage alone on its host keeps llama.cpp's default. ``SKIPPY_GGML_POLL`` sets it.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Mapping

import llama_cpp

from skippy_stage.config import GGML_POLL_ENV as POLL_ENV
from skippy_stage.errors import ConfigError
from skippy_stage.model import llama_ffi

POLL_DEFAULT = 50  # ggml_threadpool_params_default's, what llama.cpp's tools use
POLL_MAX = 100  # ggml: "0 - no polling, 100 - aggressive polling"
_MAX_N_THREADS = 512  # ggml.h GGML_MAX_N_THREADS: the length of the params' cpumask


class _Params(ctypes.Structure):
    """ggml.h ``struct ggml_threadpool_params``."""

    _fields_ = [
        ("cpumask", ctypes.c_bool * _MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


@functools.lru_cache(maxsize=1)
def openmp_build() -> bool:
    """Whether this llama.cpp runs its CPU graphs on OpenMP (its CPU backend's features say so)."""
    llama_ffi.init_backend()  # a GGML_BACKEND_DL build lists its CPU backend's features once loaded
    return b"OPENMP = 1" in llama_cpp.llama_print_system_info()


def poll_level(environ: Mapping[str, str]) -> int:
    """The poll level ``environ`` asks for (``SKIPPY_GGML_POLL``), else llama.cpp's default."""
    raw = environ.get(POLL_ENV)
    if raw is None or raw == "":
        return POLL_DEFAULT
    try:
        level = int(raw)
    except ValueError:
        level = -1
    if not 0 <= level <= POLL_MAX:
        raise ConfigError(f"{POLL_ENV}={raw!r} must be an integer in [0, {POLL_MAX}]")
    return level


class _Api:
    """The pool's functions: ggml-base's, the CPU backend's (through ggml's registry) and libllama's."""

    def __init__(self) -> None:
        params_p = ctypes.POINTER(_Params)
        self.params_init = llama_ffi.bind_base("ggml_threadpool_params_init", [params_p, ctypes.c_int], None)
        self.new = llama_ffi.cpu_backend_function("ggml_threadpool_new", ctypes.c_void_p, params_p)
        self.free = llama_ffi.cpu_backend_function("ggml_threadpool_free", None, ctypes.c_void_p)
        self.attach = llama_ffi.bind_llama("llama_attach_threadpool", [ctypes.c_void_p] * 3, None)


@functools.lru_cache(maxsize=1)
def _api() -> _Api:
    return _Api()


class ThreadPool:
    """``n_threads`` ggml threads (the thread that calls llama_decode is the first of them)."""

    def __init__(self, n_threads: int, poll: int) -> None:
        self._api = api = _api()
        params = _Params()
        api.params_init(ctypes.byref(params), n_threads)
        params.poll = poll
        self.n_threads, self.poll = n_threads, poll
        self._lock = threading.Lock()
        self._pool = api.new(ctypes.byref(params))
        if not self._pool:
            raise RuntimeError(f"ggml_threadpool_new refused a pool of {n_threads} threads")

    def attach(self, ctx) -> None:
        """Run ``ctx``'s graphs (single-token and batch alike) on this pool; it must outlive
        every decode of ``ctx``."""
        with self._lock:
            if not self._pool:
                raise RuntimeError("the thread pool was freed")
            self._api.attach(ctx, self._pool, self._pool)

    def free(self) -> None:
        """Join the pool's threads. Only once no context decodes on it any more."""
        with self._lock:
            if self._pool:
                self._api.free(self._pool)
                self._pool = None


def for_context(ctx, n_threads: int, environ: Mapping[str, str]) -> ThreadPool | None:
    """A pool attached to ``ctx`` where this llama.cpp needs one (see the module's docstring),
    sized for the context's largest thread count; None with OpenMP."""
    if openmp_build():
        return None
    pool = ThreadPool(n_threads, poll_level(environ))
    pool.attach(ctx)
    return pool


def for_llama(llm: llama_cpp.Llama, environ: Mapping[str, str]) -> ThreadPool | None:
    """``for_context`` for llama-cpp-python's own ``Llama`` (the reference model): the pool is
    joined once ``llm`` is collected (after that nothing decodes on its context)."""
    threads = max(int(llm.context_params.n_threads), int(llm.context_params.n_threads_batch))
    pool = for_context(llm.ctx, threads, environ)
    if pool is not None:
        weakref.finalize(llm, pool.free)
    return pool
