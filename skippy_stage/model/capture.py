"""The hidden-state capture of a non-final stage: llama.cpp's eval callback, and its buffer.

llama.cpp's scheduler asks the eval callback about *every* graph node (472 questions per
decode for a 13-layer slice). Answered in Python, each is a ctypes crossing plus ~1.4 us
of interpreter: about 1 ms per token for a 3-stage split, measured. :class:`NativeCapture`
answers in C (``native/capture.c``, built with the package); :class:`PythonCapture` is the
same logic in Python, used only when the compiled library is missing (a source checkout
that was never built), and says so in the log.

Both answer "yes" only for the boundary node ``l_out-{n_layers-1}``, copy its rows into a
float32 buffer in compute order, count rows per micro-batch, and answer "stop" so the
graph ends at the boundary.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
import structlog

from skippy_stage.errors import RuntimeFailure
from skippy_stage.model import llama_ffi

log = structlog.get_logger("skippy_stage.capture")

_ERRORS = {1: "boundary tensor is not float32 rows of width {width} (type {type}, width {bad_width})",
           2: "boundary tensor has more rows than the buffer holds ({capacity})",
           3: "more micro-batches than the counts buffer holds ({counts})"}


class _CaptureState(ctypes.Structure):
    """``struct skippy_capture`` of native/capture.c, field for field."""

    _fields_ = [
        ("get_name", ctypes.c_void_p),
        ("nbytes", ctypes.c_void_p),
        ("tensor_get", ctypes.c_void_p),
        ("target", ctypes.c_char_p),
        ("dst", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("capacity_rows", ctypes.c_int64),
        ("counts", ctypes.c_void_p),
        ("capacity_counts", ctypes.c_int32),
        ("n_counts", ctypes.c_int32),
        ("rows", ctypes.c_int64),
        ("error", ctypes.c_int32),
        ("bad_type", ctypes.c_int32),
        ("bad_width", ctypes.c_int64),
    ]


def native_library_path() -> Path | None:
    found = sorted(Path(__file__).parent.glob("_capture*.so"))
    return found[0] if found else None


class Capture:
    """Rows of the boundary node, in compute order, for one llama_decode at a time."""

    kind = "abstract"

    def __init__(self, target: str, width: int, capacity_rows: int) -> None:
        self.target = target
        self.width = width
        self.buffer = np.zeros((capacity_rows, width), dtype=np.float32)

    @property
    def callback(self) -> object:
        """What to set as ``llama_context_params.cb_eval``."""
        raise NotImplementedError

    @property
    def user_data(self) -> int | None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    @property
    def counts(self) -> list[int]:
        raise NotImplementedError

    @property
    def error(self) -> str | None:
        raise NotImplementedError


class NativeCapture(Capture):
    kind = "native"

    def __init__(self, target: str, width: int, capacity_rows: int, library: Path) -> None:
        super().__init__(target, width, capacity_rows)
        lib = ctypes.CDLL(str(library))
        if lib.skippy_capture_abi_version() != 1:
            raise RuntimeError(f"{library} has capture ABI {lib.skippy_capture_abi_version()}, expected 1")
        # Everything the C side points at is owned here, for as long as llama.cpp may call it.
        self._lib = lib
        self._target = target.encode()
        self._counts = np.zeros(capacity_rows, dtype=np.int32)  # at most one micro-batch per row
        self._state = _CaptureState(
            get_name=ctypes.cast(llama_ffi.ggml_get_name, ctypes.c_void_p),
            nbytes=ctypes.cast(llama_ffi.ggml_nbytes, ctypes.c_void_p),
            tensor_get=ctypes.cast(llama_ffi.ggml_backend_tensor_get, ctypes.c_void_p),
            target=self._target,
            dst=self.buffer.ctypes.data,
            width=width,
            capacity_rows=capacity_rows,
            counts=self._counts.ctypes.data,
            capacity_counts=capacity_rows,
        )
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(
            ctypes.cast(lib.skippy_capture_eval, ctypes.c_void_p).value)

    @property
    def callback(self) -> object:
        return self._callback

    @property
    def user_data(self) -> int:
        return ctypes.addressof(self._state)

    def reset(self) -> None:
        self._state.n_counts, self._state.rows, self._state.error = 0, 0, 0

    @property
    def counts(self) -> list[int]:
        return self._counts[: self._state.n_counts].tolist()

    @property
    def error(self) -> str | None:
        code = self._state.error
        if code == 0:
            return None
        return _ERRORS.get(code, "error {code}").format(
            width=self.width, type=self._state.bad_type, bad_width=self._state.bad_width,
            capacity=self.buffer.shape[0], counts=self._counts.shape[0], code=code)


class PythonCapture(Capture):
    kind = "python"

    def __init__(self, target: str, width: int, capacity_rows: int) -> None:
        super().__init__(target, width, capacity_rows)
        self._target = target.encode()
        self._rows = 0
        self._counts: list[int] = []
        self._error: str | None = None
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    @property
    def callback(self) -> object:
        return self._callback

    @property
    def user_data(self) -> None:
        return None

    def reset(self) -> None:
        self._rows, self._counts, self._error = 0, [], None

    @property
    def counts(self) -> list[int]:
        return list(self._counts)

    @property
    def error(self) -> str | None:
        return self._error

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        if ask:
            return llama_ffi.ggml_get_name(tensor) == self._target
        try:
            ggml_type, width, rows = llama_ffi.tensor_shape(tensor)
            if ggml_type != llama_ffi.GGML_TYPE_F32 or width != self.width:
                self._error = _ERRORS[1].format(width=self.width, type=ggml_type, bad_width=width)
                return False
            if self._rows + rows > self.buffer.shape[0]:
                self._error = _ERRORS[2].format(capacity=self.buffer.shape[0])
                return False
            dst = self.buffer[self._rows : self._rows + rows]
            llama_ffi.ggml_backend_tensor_get(tensor, dst.ctypes.data, 0, llama_ffi.ggml_nbytes(tensor))
            self._rows += rows
            self._counts.append(rows)
        except Exception as exc:  # noqa: BLE001 - an exception must not unwind through C frames
            self._error = repr(exc)
        return False  # stop the graph: nothing after the boundary is needed here


def make_capture(target: str, width: int, capacity_rows: int) -> Capture:
    library = native_library_path()
    if library is not None:
        return NativeCapture(target, width, capacity_rows, library)
    log.warning("compiled capture missing: each graph node costs a Python call (reinstall skippy-stage "
                "with a C compiler to build skippy_stage/_capture)", looked_in=str(Path(__file__).parent))
    return PythonCapture(target, width, capacity_rows)


class LayerTap:
    """Copies of the residual stream after chosen layers, while the graph runs on.

    Only ``skippy-stage verify`` uses it: it reads the unsplit model's hidden state at
    each stage boundary to say *where* a split stops being exact. One Python call per
    graph node is fine there, never on a serving path.
    """

    def __init__(self, layers: list[int], width: int) -> None:
        self.width = width
        self._names = {f"l_out-{il}".encode(): il for il in layers}
        self._rows: dict[int, list[np.ndarray]] = {il: [] for il in layers}
        self._error: str | None = None
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)

    @property
    def callback(self) -> object:
        return self._callback

    user_data = None

    def take(self) -> dict[int, np.ndarray]:
        """The rows seen since the last take, per layer, in compute order."""
        if self._error is not None:
            error, self._error = self._error, None
            for rows in self._rows.values():
                rows.clear()
            raise RuntimeFailure(f"layer tap failed: {error}")
        out = {il: np.concatenate(rows) if rows else np.zeros((0, self.width), np.float32)
               for il, rows in self._rows.items()}
        for rows in self._rows.values():
            rows.clear()
        return out

    def _on_eval(self, tensor: int, ask: bool, _user: int) -> bool:
        layer = self._names.get(llama_ffi.ggml_get_name(tensor))
        if ask:
            return layer is not None
        try:
            ggml_type, width, rows = llama_ffi.tensor_shape(tensor)
            if ggml_type != llama_ffi.GGML_TYPE_F32 or width != self.width:
                self._error = f"l_out-{layer} is type {ggml_type} width {width}, not f32 rows of {self.width}"
                return True
            dst = np.empty((rows, width), dtype=np.float32)
            llama_ffi.ggml_backend_tensor_get(tensor, dst.ctypes.data, 0, llama_ffi.ggml_nbytes(tensor))
            self._rows[layer].append(dst)
        except Exception as exc:  # noqa: BLE001 - an exception must not unwind through C frames
            self._error = repr(exc)
        return True  # keep computing: the tap only watches
