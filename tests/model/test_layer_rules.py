"""A slice keeps what llama.cpp derives from the absolute layer index, or refuses with why.

These read headers only (no weights): the fixture proofs in test_architectures.py show the
rewrites make splits exact; here each rule is pinned to the llama.cpp behaviour it answers.
"""

from __future__ import annotations

import pytest
from support.chain import split_configs

from skippy_stage.errors import ConfigError, UnsupportedModelError
from skippy_stage.model import layer_rules
from skippy_stage.model.stage_file import check_against_model


def header(arch: str, n: int, **keys: object) -> dict[str, object]:
    kv: dict[str, object] = {f"{arch}.block_count": n, f"{arch}.embedding_length": 256}
    kv.update({f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()})
    return kv


def test_leading_dense_blocks_are_counted_from_the_slice_start():
    kv = header("deepseek2", 8, leading_dense_block_count=3)
    assert layer_rules.slice_overrides(kv, "deepseek2", 0, 2, False)["deepseek2.leading_dense_block_count"] == ("uint32", 3)
    assert layer_rules.slice_overrides(kv, "deepseek2", 2, 5, False)["deepseek2.leading_dense_block_count"] == ("uint32", 1)
    assert layer_rules.slice_overrides(kv, "deepseek2", 5, 8, True)["deepseek2.leading_dense_block_count"] == ("uint32", 0)


def test_multi_token_prediction_blocks_stay_whole_in_the_final_stage():
    kv = header("glm4moe_like", 8, nextn_predict_layers=1)
    assert layer_rules.slice_overrides(kv, "glm4moe_like", 0, 4, False)["glm4moe_like.nextn_predict_layers"] == ("uint32", 0)
    assert "glm4moe_like.nextn_predict_layers" not in layer_rules.slice_overrides(kv, "glm4moe_like", 4, 8, True)
    with pytest.raises(ConfigError, match="multi-token-prediction blocks; they must all be in the final stage"):
        layer_rules.slice_overrides(kv, "glm4moe_like", 7, 8, True)


def test_sliding_window_layers_of_the_original_indices_are_written_out():
    kv = header("gemma3", 18, attention__sliding_window=512)
    kind, pattern = layer_rules.slice_overrides(kv, "gemma3", 5, 11, False)["gemma3.attention.sliding_window_pattern"]
    assert kind == "bools" and pattern == [False, True, True, True, True, True]


def test_a_stage_of_full_attention_layers_alone_is_refused_before_llama_cpp_asserts():
    kv = header("gemma3", 18, attention__sliding_window=512)
    with pytest.raises(ConfigError, match=r"layers 5:6 .* all full-attention layers; .*GGML_ASSERT is_swa_any"):
        layer_rules.slice_overrides(kv, "gemma3", 5, 6, False)


def test_the_real_gemma3_config_with_a_global_only_stage_is_refused_at_config_time(gemma3, slice_cache):
    configs = split_configs(gemma3, [(0, 5), (5, 6), (6, 18)], slice_cache)
    with pytest.raises(ConfigError, match="stage stage-1: layers 5:6 of this gemma3 model are all full-attention"):
        check_against_model(configs[1])
    check_against_model(configs[0])


def test_a_hybrid_stage_needs_both_attention_and_recurrent_layers():
    kv = header("jamba", 4, attention__head_count_kv=(2, 0, 2, 0), attention__head_count=(2, 0, 2, 0))
    with pytest.raises(ConfigError, match="layers 0:1 of this jamba model hold no recurrent layer"):
        layer_rules.slice_overrides(kv, "jamba", 0, 1, False)
    with pytest.raises(ConfigError, match="hold no attention layer"):
        layer_rules.slice_overrides(kv, "jamba", 1, 2, False)
    layer_rules.slice_overrides(kv, "jamba", 0, 2, False)


def test_recurrent_layers_of_an_interval_hybrid_are_written_out():
    kv = header("qwen3next", 8, full_attention_interval=4)
    kind, layers = layer_rules.slice_overrides(kv, "qwen3next", 2, 6, False)["qwen3next.attention.recurrent_layers"]
    assert kind == "bools" and layers == [True, False, True, True]  # layer 3 is full attention


def test_a_stage_starting_on_a_layer_without_heads_is_refused():
    """llama.cpp sizes every head of a stage from its first layer, and reads key_length only when
    that layer has heads: such a stage would not load."""
    kv = header("jamba", 4, attention__head_count_kv=(2, 0, 2, 0), attention__head_count=(2, 0, 2, 0))
    with pytest.raises(ConfigError, match="layer 1 has no attention heads.*start the stage on a layer with heads"):
        layer_rules.slice_overrides(kv, "jamba", 1, 4, True)


def test_a_slice_starting_on_a_layer_with_other_head_counts_keeps_the_head_size_of_the_original():
    kv = header("deci", 3, attention__head_count=(4, 2, 4), attention__head_count_kv=(4, 2, 4))
    out = layer_rules.slice_overrides(kv, "deci", 1, 3, True)
    assert out["deci.attention.key_length"] == ("uint32", 64)
    assert out["deci.attention.value_length"] == ("uint32", 64)


def test_deepstack_inputs_stay_with_stage_0():
    """Qwen3-VL's deepstack layers widen the input rows llama.cpp expects; a later stage takes
    plain hidden states (the deepstack features of text are zeros)."""
    kv = header("qwen3vl", 6, n_deepstack_layers=3)
    assert "qwen3vl.n_deepstack_layers" not in layer_rules.slice_overrides(kv, "qwen3vl", 0, 2, False)
    assert layer_rules.slice_overrides(kv, "qwen3vl", 2, 6, True)["qwen3vl.n_deepstack_layers"] == ("uint32", 0)


def test_a_window_llama_cpp_turns_on_without_the_key_is_written_out():
    kind, pattern = layer_rules.slice_overrides(header("gemma2", 6), "gemma2", 1, 3, False)[
        "gemma2.attention.sliding_window_pattern"]
    assert pattern == [False, True]  # gemma2: every other layer, from layer 0


def test_boundaries_must_fall_on_a_period_llama_cpp_keys_on_the_layer_index():
    kv = header("llama4", 8, interleave_moe_layer_step=2)
    with pytest.raises(ConfigError, match="boundary at layer 2 is not a multiple of 4"):
        layer_rules.slice_overrides(kv, "llama4", 0, 2, False)
    layer_rules.slice_overrides(kv, "llama4", 4, 8, True)


def test_an_input_scale_applied_to_hidden_states_is_neutralised_after_stage_0():
    kv = header("granite", 6, embedding_scale=12.0)
    assert "granite.embedding_scale" not in layer_rules.slice_overrides(kv, "granite", 0, 3, False)
    assert layer_rules.slice_overrides(kv, "granite", 3, 6, True)["granite.embedding_scale"] == ("float32", 1.0)


def test_a_default_computed_from_the_block_count_is_pinned_to_the_original():
    kind, value = layer_rules.slice_overrides(header("minicpm", 16), "minicpm", 8, 16, True)["minicpm.residual_scale"]
    assert kind == "float32" and value == pytest.approx(1.4 / 4)


@pytest.mark.parametrize("arch, reason", [
    ("glm4moe", "GGML_ABORT"), ("gemma3n", "altup"), ("deepseek4", "hyper-connections"), ("baichuan", "RoPE"),
    ("llada", "no KV memory"),
])
def test_an_architecture_no_metadata_can_split_is_refused_with_the_reason(arch, reason):
    with pytest.raises(UnsupportedModelError, match=f"architecture '{arch}' is refused: .*{reason}"):
        layer_rules.slice_overrides(header(arch, 8), arch, 0, 4, False)


def test_a_model_size_llama_cpp_keys_a_different_graph_on_is_refused():
    with pytest.raises(UnsupportedModelError, match="'gemma3' with 62 blocks is refused: Gemma-3 27B"):
        layer_rules.slice_overrides(header("gemma3", 62), "gemma3", 0, 31, False)
    with pytest.raises(UnsupportedModelError, match="'command-r' with 70 blocks is refused: Command-R"):
        layer_rules.slice_overrides(header("command-r", 70), "command-r", 0, 35, False)
    layer_rules.slice_overrides(header("command-r", 40), "command-r", 0, 20, False)
