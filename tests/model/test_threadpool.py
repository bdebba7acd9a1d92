"""Where llama.cpp was built without OpenMP, every context that decodes runs on a ggml thread
pool of its own (``model.threadpool``), not on a pool ggml starts and joins for every graph.

CI's llama.cpp is an OpenMP build: there the pool is never made, and the tests below prove the
pool's plumbing (its parameters' layout, attaching it, freeing it) by attaching one to the real
model anyway — OpenMP then computes, reading the pool's state. The slow test at the end builds
llama-cpp-python without OpenMP from its source on PyPI and runs a split on it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import llama_cpp
import pytest

from skippy_stage.config import GGML_POLL_ENV, SHARED_HOST_GGML_POLL, shared_host_openmp
from skippy_stage.errors import ConfigError
from skippy_stage.model import threadpool
from skippy_stage.model.loader import reference_llama

PROMPT = "The capital of France is"
TOKENS = 24


def greedy(llm: llama_cpp.Llama, n: int) -> list[int]:
    out = []
    for token in llm.generate(llm.tokenize(PROMPT.encode()), temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            return out
    return out


def test_the_build_says_whether_it_computes_on_openmp_and_an_openmp_build_gets_no_pool(smollm2):
    """Read from llama.cpp's feature list, checked here against what the process really loaded:
    an OpenMP build's CPU backend brings libgomp with it."""
    llm = reference_llama(smollm2, n_ctx=256, n_threads=2, verbose=False)
    try:
        mapped = Path("/proc/self/maps").read_text()
        assert threadpool.openmp_build() == ("libgomp" in mapped)
        if threadpool.openmp_build():
            assert threadpool.for_context(llm.ctx, 2, {}) is None, "OpenMP never reads an attached pool's threads"
    finally:
        llm.close()


def test_the_pool_parameters_are_laid_out_as_ggml_writes_them():
    """ggml's own initializer fills our ``_Params`` (bytes set to 0xAB first): each field reads
    back what ggml.c writes there, so a field at another offset than ggml.h's reads 0xAB bytes or
    a neighbour's value. Every build, OpenMP or not, has the initializer."""
    params = threadpool._Params()
    ctypes.memset(ctypes.byref(params), 0xAB, ctypes.sizeof(params))
    threadpool._api().params_init(ctypes.byref(params), 3)
    assert (params.n_threads, params.prio, params.poll, params.strict_cpu, params.paused) == (
        3, 0, threadpool.POLL_DEFAULT, False, False)
    assert not any(params.cpumask)


def test_a_pool_is_freed_once_and_refuses_attaching_after():
    pool = threadpool.ThreadPool(2, threadpool.POLL_DEFAULT)
    pool.free()
    pool.free()  # freeing twice is harmless
    with pytest.raises(RuntimeError, match="freed"):
        pool.attach(None)


def test_a_model_decodes_the_same_tokens_on_a_ggml_pool_attached_to_its_context(smollm2):
    """The pool's threads run the graphs (they exist once it is made) and give the tokens of
    ggml's disposable per-graph threads. On an OpenMP build OpenMP runs every graph and no ggml
    pool thread ever would: nothing to check in this process (the slow test below builds one)."""
    if threadpool.openmp_build():
        pytest.skip("OpenMP computes every graph in this build: a ggml pool's threads never run")
    plain = reference_llama(smollm2, n_ctx=256, n_threads=2, verbose=False)
    try:
        threadpool._api().attach(plain.ctx, None, None)  # detached: ggml's disposable threads
        expected = greedy(plain, TOKENS)
    finally:
        plain.close()
    pooled = reference_llama(smollm2, n_ctx=256, n_threads=2, verbose=False)
    threads = len(os.listdir("/proc/self/task"))
    pool = threadpool.ThreadPool(2, threadpool.POLL_DEFAULT)
    try:
        assert len(os.listdir("/proc/self/task")) == threads + 1, "the pool's worker (the caller is the other)"
        pool.attach(pooled.ctx)
        assert greedy(pooled, TOKENS) == expected
    finally:
        pooled.close()
        pool.free()


def test_co_located_stages_poll_not_at_all_and_a_stage_alone_keeps_llama_cpps_default():
    assert shared_host_openmp({})[GGML_POLL_ENV] == SHARED_HOST_GGML_POLL == "0"
    assert GGML_POLL_ENV not in shared_host_openmp({GGML_POLL_ENV: "7"}), "an operator's value wins"
    assert threadpool.poll_level({}) == threadpool.POLL_DEFAULT == 50
    assert threadpool.poll_level({GGML_POLL_ENV: "0"}) == 0
    assert threadpool.poll_level({GGML_POLL_ENV: "100"}) == 100


@pytest.mark.parametrize("raw", ["-1", "101", "lots", "1.5"])
def test_a_poll_level_out_of_range_is_refused_naming_the_variable_and_the_value(raw):
    with pytest.raises(ConfigError) as raised:
        threadpool.poll_level({GGML_POLL_ENV: raw})
    assert GGML_POLL_ENV in str(raised.value) and repr(raw) in str(raised.value)


# A 2-stage split and the unsplit reference on the build under test, greedy: the same tokens, and
# a pool on every context that decodes.
_SPLIT_ON_THIS_BUILD = textwrap.dedent("""
    import json, sys, tempfile
    import numpy as np
    from skippy_stage.model import threadpool
    from skippy_stage.model.chain import Chain, Step, chain_configs
    from skippy_stage.model.loader import reference_llama
    model, n = sys.argv[1], int(sys.argv[2])
    llm = reference_llama(model, n_ctx=256, n_threads=2, verbose=False)
    prompt = llm.tokenize(b"The capital of France is")
    reference = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        reference.append(token)
        if len(reference) == n:
            break
    with tempfile.TemporaryDirectory() as tmp:
        chain = Chain(chain_configs(model, [(0, 15), (15, 30)], tmp, n_threads=2, ctx_size=256))
        split, start, step = [], 0, list(prompt)
        for _ in range(n):
            (result,) = chain.step([Step("s", start, step)])
            split.append(result.token)
            start, step = start + len(step), [result.token]
        pools = [stage._pool is not None for stage in chain.stages]
        chain.close()
    print(json.dumps({"openmp": threadpool.openmp_build(), "pools": pools, "reference": reference, "split": split}))
""")


@pytest.mark.slow
def test_a_llama_cpp_built_without_openmp_runs_a_split_on_ggml_pools(smollm2, tmp_path):
    """Builds llama-cpp-python (the pinned version, from PyPI's source) with GGML_OPENMP=OFF, ~5 min
    on 2 cores; SKIPPY_NO_OPENMP_WHEEL names an already built wheel instead."""
    target = tmp_path / "site"
    wheel = os.environ.get("SKIPPY_NO_OPENMP_WHEEL")
    if not wheel:
        built = tmp_path / "wheel"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                        "-w", str(built), f"llama-cpp-python=={llama_cpp.__version__}"],
                       check=True, env={**os.environ, "CMAKE_ARGS": "-DGGML_OPENMP=OFF"}, timeout=3600)
        wheel = str(next(built.glob("llama_cpp_python-*.whl")))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), wheel],
                   check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(Path(__file__).parents[2])])}
    run = subprocess.run([sys.executable, "-c", _SPLIT_ON_THIS_BUILD, str(smollm2), str(TOKENS)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["openmp"] is False, "the build under test must be the one without OpenMP"
    assert out["pools"] == [True, True], "every stage's context decodes on a pool of its own"
    assert out["split"] == out["reference"]
