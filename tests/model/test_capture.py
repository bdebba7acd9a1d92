"""The hidden-state capture: answered in C, it computes exactly what the Python one did.

llama.cpp asks the eval callback about every graph node; the compiled capture
(``skippy_stage/_capture*.so``, built by ``pip install``) answers without entering Python.
Its rows must be bit-identical to the Python capture's, including batches that llama.cpp
cuts into several micro-batches (rows then arrive out of batch order).
"""

from __future__ import annotations

import numpy as np
import pytest
import structlog.testing
from support.chain import split_configs

from skippy_stage.model import capture
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.runtime import StageRuntime


def test_the_compiled_capture_is_built_with_the_package():
    assert capture.native_library_path() is not None, "pip install should have compiled skippy_stage/_capture"


@pytest.fixture(scope="module")
def head_configs(smollm2, slice_cache):
    """The head of 0:10/10:20/20:30 with micro-batches of 4, two lanes apart (equal split)."""
    return split_configs(smollm2, [(0, 10), (10, 20), (20, 30)], slice_cache, n_ubatch=4, lane_count=2,
                         kv_unified=False)[0]


def hidden_states(config, *, native: bool, monkeypatch) -> dict[str, np.ndarray]:
    if not native:
        monkeypatch.setattr(capture, "native_library_path", lambda: None)
    runtime = StageRuntime(config)
    try:
        assert runtime._capture.kind == ("native" if native else "python")
        a = runtime.tokenizer.tokenize("The capital of France is a city of")
        b = runtime.tokenizer.tokenize("def fibonacci(n):")
        results = runtime.run_batch([BatchEntry("a", np.arange(len(a)), token_ids=a),
                                     BatchEntry("b", np.arange(len(b)), token_ids=b)])
        step = runtime.run_batch([BatchEntry("a", [len(a)], token_ids=[a[-1]]),
                                  BatchEntry("b", [len(b)], token_ids=[b[-1]])])
        return {**{r.session_id: r.hidden for r in results}, **{f"{r.session_id}+1": r.hidden for r in step}}
    finally:
        runtime.close()
        monkeypatch.undo()


def test_native_and_python_captures_give_bit_identical_rows(head_configs, monkeypatch):
    native = hidden_states(head_configs, native=True, monkeypatch=monkeypatch)
    python = hidden_states(head_configs, native=False, monkeypatch=monkeypatch)

    assert native.keys() == python.keys()
    for key in native:
        assert native[key].shape == python[key].shape
        assert np.array_equal(native[key], python[key]), key
        assert np.isfinite(native[key]).all()


def test_a_missing_compiled_capture_is_said_in_the_log(monkeypatch):
    monkeypatch.setattr(capture, "native_library_path", lambda: None)
    with structlog.testing.capture_logs() as logs:
        made = capture.make_capture("l_out-9", 576, 8)

    assert made.kind == "python"
    assert any(e["log_level"] == "warning" and "compiled capture missing" in e["event"] for e in logs)
