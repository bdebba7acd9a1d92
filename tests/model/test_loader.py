"""The loader: every seed setting reaches llama.cpp, and none is silently dropped.

llama-cpp-python's parameter structs are ctypes Structures, which accept any attribute
name; a field that was renamed upstream (``use_mmap`` became ``load_mode``) once made the
``mmap`` setting a silent no-op. Here each setting is read back from the struct the stage
hands to llama.cpp, and ``mmap`` is checked where it shows: the process's memory maps.
"""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from skippy_stage.config import PeerConfig, StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.model import host, loader
from skippy_stage.model.batch import BatchEntry
from skippy_stage.model.runtime import StageRuntime


def stage(model: Path, cache_dir: Path, **fields: object) -> StageConfig:
    """The head stage (layers 0:15) of a 2-stage split, its stage file in ``cache_dir`` of its own:
    no other test maps that file, so /proc/self/maps shows this stage's loading alone."""
    values = dict(model_path=str(model), stage_id="stage-0", stage_index=0, layer_start=0, layer_end=15,
                  downstream=PeerConfig("stage-1", 1, "127.0.0.1:9"), cache_dir=str(cache_dir), ctx_size=512,
                  lane_count=1, n_threads=2)
    values.update(fields)
    return StageConfig(**values)


def run_prompt(runtime: StageRuntime) -> None:
    tokens = runtime.tokenizer.tokenize("Hello world, this is a multi-token batch")
    [result] = runtime.run_batch([BatchEntry("s", np.arange(len(tokens)), token_ids=tokens)])
    assert result.hidden.shape == (len(tokens), runtime.n_embd) and np.isfinite(result.hidden).all()


def config(**fields: object) -> StageConfig:
    values = dict(model_path="/models/m.gguf", stage_id="stage-0", stage_index=0, layer_start=0, layer_end=10)
    values.update(fields)
    return StageConfig(**values)


def no_amx() -> host.HostInfo:
    info = host.host_info()
    return replace(info, features={**info.features, "AMX_INT8": "0"})


def with_amx() -> host.HostInfo:
    info = host.host_info()
    return replace(info, features={**info.features, "AMX_INT8": "1"}, cpu_flags=(*info.cpu_flags, "amx_int8"))


# -- the struct helper -----------------------------------------------------------------


def test_set_fields_refuses_a_field_the_struct_does_not_have():
    params = llama_cpp.llama_model_default_params()
    with pytest.raises(ConfigError) as info:
        loader.set_fields(params, use_mmap=False)
    assert "llama_model_params" in str(info.value) and "use_mmap" in str(info.value)
    assert not hasattr(params, "use_mmap")


def test_set_fields_sets_every_field_it_is_given():
    params = loader.set_fields(llama_cpp.llama_model_default_params(), check_tensors=True, no_host=True, main_gpu=3)
    assert (params.check_tensors, params.no_host, params.main_gpu) == (True, True, 3)


# -- each seed setting, read back from the struct llama.cpp receives ----------------------


@pytest.mark.parametrize(("mmap", "mlock", "direct_io", "mode"), [
    (None, False, False, llama_cpp.LLAMA_LOAD_MODE_AUTO),
    (None, True, False, llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK),
    (True, False, False, llama_cpp.LLAMA_LOAD_MODE_MMAP),
    (True, True, False, llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK),
    (False, False, False, llama_cpp.LLAMA_LOAD_MODE_NONE),
    (False, True, False, llama_cpp.LLAMA_LOAD_MODE_MLOCK),
    (None, False, True, llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO),
    (False, False, True, llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO),
])
def test_mmap_mlock_and_direct_io_become_llama_cpp_load_mode(mmap, mlock, direct_io, mode):
    params = loader.model_params(config(mmap=mmap, mlock=mlock, direct_io=direct_io), no_amx()).params
    assert params.load_mode == mode


def test_repack_is_off_by_default_and_reaches_use_extra_bufts():
    assert config().repack is False
    assert loader.model_params(config(), no_amx()).params.use_extra_bufts is False
    assert loader.model_params(config(repack=True), no_amx()).params.use_extra_bufts is True


@pytest.mark.parametrize(("field", "value", "struct_field", "expected"), [
    ("check_tensors", True, "check_tensors", True),
    ("no_host_buffer", True, "no_host", True),
    ("main_gpu", 1, "main_gpu", 1),
    ("n_gpu_layers", -1, "n_gpu_layers", 2**31 - 1),
    ("split_mode", "none", "split_mode", llama_cpp.LLAMA_SPLIT_MODE_NONE),
    ("split_mode", "layer", "split_mode", llama_cpp.LLAMA_SPLIT_MODE_LAYER),
    ("split_mode", "row", "split_mode", llama_cpp.LLAMA_SPLIT_MODE_ROW),
    ("split_mode", "tensor", "split_mode", llama_cpp.LLAMA_SPLIT_MODE_TENSOR),
    ("split_mode", "auto", "split_mode", llama_cpp.llama_model_default_params().split_mode),
])
def test_model_settings_reach_llama_model_params(field, value, struct_field, expected):
    params = loader.model_params(config(**{field: value}), no_amx()).params
    assert getattr(params, struct_field) == expected


@pytest.mark.parametrize(("field", "value", "struct_field"), [
    ("op_offload", False, "op_offload"),
    ("op_offload", True, "op_offload"),
    ("kv_unified", False, "kv_unified"),
    ("kv_offload", False, "offload_kqv"),
    ("swa_full", True, "swa_full"),
])
def test_context_settings_reach_llama_context_params(field, value, struct_field):
    params = loader.context_params(config(**{field: value}), 256, None)
    assert getattr(params, struct_field) == value


def test_op_offload_unset_keeps_llama_cpp_default():
    default = llama_cpp.llama_context_default_params().op_offload
    assert loader.context_params(config(), 256, None).op_offload == default


def test_selected_device_names_a_device_of_this_host():
    cpu = next(d.name for d in host.host_info().devices if d.type == "cpu")
    made = loader.model_params(config(selected_device=cpu), no_amx())
    assert made.params.devices  # a list was handed over...
    handles = ctypes.cast(made.params.devices, ctypes.POINTER(ctypes.c_void_p))
    assert handles[0] is None  # ...empty: the CPU is always used, so choosing it means no offload


def test_an_unknown_selected_device_is_refused_with_the_devices_present():
    with pytest.raises(ConfigError) as info:
        loader.model_params(config(selected_device="CUDA7"), no_amx())
    message = str(info.value)
    assert "selected_device='CUDA7'" in message
    for name in host.host_info().device_names():
        assert name in message


# -- AMX: refused up front, never left to crash --------------------------------------------


def test_repack_on_a_cpu_with_amx_is_refused_naming_the_crash_and_the_fix():
    with pytest.raises(ConfigError) as info:
        loader.model_params(config(repack=True), with_amx())
    message = str(info.value)
    assert "stage-0" in message and "repack=true" in message and "AMX_INT8" in message
    assert "#20824" in message and "repack=false" in message


def test_repack_on_this_host_follows_its_amx_report(smollm2, tmp_path):
    """On an AMX host the stage refuses to start; elsewhere it loads and decodes a batch."""
    cfg = stage(smollm2, tmp_path, repack=True)
    if host.host_info().amx:
        with pytest.raises(ConfigError, match="repack=true is refused"):
            StageRuntime(cfg)
        return
    runtime = StageRuntime(cfg)
    try:
        run_prompt(runtime)
    finally:
        runtime.close()


# -- mmap, where it shows -----------------------------------------------------------------


def mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize(("mmap", "expect_mapped"), [(True, True), (False, False), (None, True)])
def test_mmap_decides_whether_the_stage_file_is_memory_mapped(smollm2, tmp_path, mmap, expect_mapped):
    runtime = StageRuntime(stage(smollm2, tmp_path, mmap=mmap))
    try:
        assert mapped(runtime.load_path) is expect_mapped
        run_prompt(runtime)
    finally:
        runtime.close()
    assert not mapped(runtime.load_path)


def test_direct_io_loads_and_runs(smollm2, tmp_path):
    runtime = StageRuntime(stage(smollm2, tmp_path, mmap=False, direct_io=True))
    try:
        assert runtime.model_params.params.load_mode == llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO
        assert not mapped(runtime.load_path)
        run_prompt(runtime)
    finally:
        runtime.close()


# -- the reference the tests compare against ------------------------------------------------


def test_the_unsplit_reference_loads_as_the_stages_do(smollm2):
    llm = loader.reference_llama(smollm2, n_ctx=256, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is False
        assert llm.create_completion("Hello world", max_tokens=4, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    # Stock defaults are left as they were for everybody else.
    assert llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_the_reference_loads_with_repack_on_as_a_repack_stage_does_or_refuses_it_as_one(smollm2):
    """``repack=True``: stock llama-cpp-python's loading where it runs, refused before loading on AMX."""
    if host.host_info().amx:
        with pytest.raises(ConfigError, match="the reference model: repack=true is refused"):
            loader.reference_llama(smollm2, repack=True, n_ctx=256, verbose=False)
        return
    llm = loader.reference_llama(smollm2, repack=True, n_ctx=256, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is True
    finally:
        llm.close()


# -- context size --------------------------------------------------------------------------


def test_unset_ctx_size_is_the_models_training_context_when_memory_allows():
    size = loader.auto_context_size(8192, per_token=23_040, available=16 << 30)
    assert size.n_ctx == 8192 and "training context" in size.reason and not size.capped


def test_unset_ctx_size_is_capped_by_host_memory_and_says_so():
    size = loader.auto_context_size(131_072, per_token=1 << 20, available=8 << 30)  # 1 MiB a token
    assert size.n_ctx == 4096 and size.n_ctx % loader.AUTO_CTX_STEP == 0 and size.capped
    assert "capped" in size.reason and "131072" in size.reason and "ctx_size" in size.reason


def test_unset_ctx_size_refuses_a_host_that_cannot_hold_any_context():
    with pytest.raises(ConfigError, match="set ctx_size"):
        loader.auto_context_size(8192, per_token=1 << 20, available=100 << 20)


def test_separate_lanes_each_get_the_training_context_when_memory_allows():
    size = loader.auto_context_size(8192, per_token=23_040, available=16 << 30, lanes=4)
    assert size.n_ctx == 4 * 8192 and not size.capped
    assert "8192 tokens) per lane x 4 lanes" in size.reason


def test_separate_lanes_share_a_memory_cap_equally_and_say_so():
    size = loader.auto_context_size(131_072, per_token=1 << 20, available=8 << 30, lanes=4)  # 1 MiB a token
    assert size.n_ctx == 4 * 1024 and size.capped  # 4 GiB of KV: 1024 tokens for each lane
    assert "capped to 1024 per lane x 4 lanes" in size.reason and "ctx_size" in size.reason
    with pytest.raises(ConfigError, match="lower lane_count"):
        loader.auto_context_size(8192, per_token=1 << 20, available=1 << 30, lanes=4)


def test_a_stage_with_unset_ctx_size_gives_each_lane_the_training_context(smollm2, tmp_path):
    runtime = StageRuntime(stage(smollm2, tmp_path, ctx_size=None, lane_count=4))
    try:
        assert runtime.context_size.reason.startswith("the model's training context")
        assert runtime.n_ctx == 4 * 8192  # SmolLM2's training context, for each of the 4 lanes
        assert runtime.cells_per_lane == 8192  # separate lanes: a session holds the training context
        assert runtime.lanes.kv_pool_tokens == 4 * 8192
    finally:
        runtime.close()


def test_a_unified_stage_with_unset_ctx_size_shares_one_training_context(smollm2, tmp_path):
    runtime = StageRuntime(stage(smollm2, tmp_path, ctx_size=None, lane_count=4, kv_unified=True))
    try:
        assert runtime.n_ctx == 8192 and runtime.cells_per_lane == 8192  # one session may use all of it
    finally:
        runtime.close()


def test_every_configurable_cache_type_has_its_ggml_type_id():
    """config.CACHE_TYPES is the one list of cache types; the loader must know each one's id
    (llama-cpp-python names most of them, bf16 it does not)."""
    from skippy_stage.config import CACHE_TYPES

    assert set(loader.CACHE_TYPE_IDS) == set(CACHE_TYPES)
    for name, type_id in loader.CACHE_TYPE_IDS.items():
        named = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", None)
        assert named is None or named == type_id, name
