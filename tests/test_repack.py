"""``repack: true``: a pipeline then completes exactly what stock llama-cpp-python completes.

Stock ``llama_cpp.Llama`` loads with llama.cpp's default ``use_extra_bufts`` (on): on an AVX2
CPU its Q4_0/Q4_K weights are repacked into the CPU_REPACK buffer type, whose kernels round
otherwise than the plain ones (Gemma-3-270M Q4_K_M: other greedy text on some prompts than with
repack off, the stages' default). llama.cpp decides the repack tensor by tensor (its type and
shape), and a stage file keeps every tensor as it is, so each stage repacks its layers exactly
as the whole model repacks them: with ``repack: true`` the split equals stock ``Llama``, whether
the stages are started from their configs or by ``up --set repack=true``.

On a CPU with AMX the repack crashes llama.cpp, stock ``Llama`` included (issue #20824), and
stages refuse ``repack: true`` there (tests/model/test_loader.py): nothing to compare.
"""

from __future__ import annotations

import llama_cpp
import pytest
from support.chain import EQUIVALENCE_PROMPTS
from support.pipeline import PROMPTS, grpc_generate, reference_texts
from support.up import running_up

from skippy_stage.model import host

pytestmark = pytest.mark.skipif(
    host.host_info().amx, reason=f"AMX CPU: stock Llama crashes and stages refuse repack=true ({host.AMX_REPACK_CRASH})")

# Every prompt of the equivalence tests, and the pipeline tests' too.
ALL_PROMPTS = list(dict.fromkeys(EQUIVALENCE_PROMPTS + PROMPTS))
# Long enough for repacking to show in the text: on an AMD EPYC (AVX-512), 2 of these 5 prompts'
# greedy completions differ with repack on from repack off within 64 tokens (1 of 5 within 32).
MAX_TOKENS = 64
# 5 and 11: splits off Gemma-3's 6-layer window period, each stage repacking its own layers.
GEMMA3_SPLIT = [(0, 5), (5, 11), (11, 18)]


def stock_texts(model, prompts: list[str], max_tokens: int) -> list[str]:
    """``create_completion`` of llama-cpp-python's ``Llama`` as it comes: no loader policy applied."""
    llm = llama_cpp.Llama(str(model), n_ctx=2048, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is True  # llama.cpp's default: repack on
        return [llm.create_completion(p, max_tokens=max_tokens, temperature=0)["choices"][0]["text"] for p in prompts]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def gemma3_stock(gemma3) -> list[str]:
    texts = stock_texts(gemma3, ALL_PROMPTS, MAX_TOKENS)
    repack_off = reference_texts(gemma3, ALL_PROMPTS, MAX_TOKENS)
    print(f"stock Llama vs repack off: {sum(a != b for a, b in zip(texts, repack_off))} of {len(ALL_PROMPTS)} "
          "prompts complete otherwise")
    return texts


def test_gemma3_pipeline_with_repack_on_completes_exactly_what_stock_llama_completes(gemma3, gemma3_stock,
                                                                                      start_pipeline):
    pipeline = start_pipeline(gemma3, GEMMA3_SPLIT, repack=True)
    try:
        for prompt, text in zip(ALL_PROMPTS, gemma3_stock):
            assert grpc_generate(pipeline.head_endpoint, prompt, MAX_TOKENS)[0] == text, prompt
    finally:
        pipeline.stop()


def test_up_with_set_repack_true_completes_exactly_what_stock_llama_completes(gemma3, gemma3_stock, slice_cache):
    layers = ",".join(f"{a}:{b}" for a, b in GEMMA3_SPLIT)
    with running_up("--model", str(gemma3), "--layers", layers, "--ctx-size", "8192", "--set", "repack=true",
                    cache=slice_cache) as (endpoint, _):
        for prompt, text in zip(ALL_PROMPTS, gemma3_stock):
            assert grpc_generate(endpoint, prompt, MAX_TOKENS)[0] == text, prompt
