"""StageConfig: what a stage accepts at start-up, and how it refuses the rest.

Every refusal is a ConfigError whose message names the stage and the offending value,
because the reader is an operator looking at one log line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from skippy_stage.config import CACHE_TYPES, Endpoint, PeerConfig, StageConfig, load_config
from skippy_stage.errors import ConfigError

MINIMAL: dict[str, Any] = {
    "model_path": "/models/smollm2.gguf",
    "stage_id": "stage-0",
    "stage_index": 0,
    "layer_start": 0,
    "layer_end": 10,
}

DOWNSTREAM = {"stage_id": "stage-1", "stage_index": 1, "endpoint": "127.0.0.1:5001"}


def config(**changes: Any) -> StageConfig:
    """A valid head-stage config (stage-0, layers 0:10) with ``changes`` applied."""
    return StageConfig.from_dict({**MINIMAL, **changes})


def middle(**changes: Any) -> StageConfig:
    """A valid middle stage: stage-1 of three, layers 10:20."""
    values: dict[str, Any] = {
        "stage_id": "stage-1",
        "stage_index": 1,
        "layer_start": 10,
        "layer_end": 20,
        "upstream": {"stage_id": "stage-0", "stage_index": 0, "endpoint": "127.0.0.1:5000"},
        "downstream": {"stage_id": "stage-2", "stage_index": 2, "endpoint": "127.0.0.1:5002"},
    }
    return config(**{**values, **changes})


def refused(**changes: Any) -> str:
    """The message of the ConfigError that ``config(**changes)`` raises."""
    with pytest.raises(ConfigError) as info:
        config(**changes)
    return str(info.value)


def write_json(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(data))
    return path


# -- loading ---------------------------------------------------------------------------


def test_minimal_config_loads_from_a_json_file(tmp_path: Path) -> None:
    cfg = load_config(write_json(tmp_path, MINIMAL))

    assert cfg.stage_id == "stage-0"
    assert cfg.model_path == "/models/smollm2.gguf"
    assert (cfg.layer_start, cfg.layer_end, cfg.n_layers) == (0, 10, 10)
    assert cfg.lane_count == 4
    assert cfg.load_mode == "runtime-slice"
    assert cfg.downstream is None and cfg.upstream is None


def test_head_stage_without_downstream_includes_embeddings_and_output() -> None:
    cfg = config()

    assert cfg.include_embeddings is True
    assert cfg.include_output is True


def test_head_stage_with_downstream_includes_embeddings_but_not_output() -> None:
    cfg = config(downstream=DOWNSTREAM)

    assert cfg.include_embeddings is True
    assert cfg.include_output is False
    assert cfg.downstream == PeerConfig("stage-1", 1, "127.0.0.1:5001")


def test_middle_stage_includes_neither_embeddings_nor_output() -> None:
    cfg = middle()

    assert cfg.include_embeddings is False
    assert cfg.include_output is False


def test_final_stage_includes_output_but_not_embeddings() -> None:
    cfg = config(
        stage_id="stage-2",
        stage_index=2,
        layer_start=20,
        layer_end=30,
        upstream={"stage_id": "stage-1", "stage_index": 1, "endpoint": "127.0.0.1:5001"},
    )

    assert cfg.include_embeddings is False
    assert cfg.include_output is True


def test_config_round_trips_through_to_dict() -> None:
    cfg = middle(lane_count=8, n_ubatch=256)

    assert StageConfig.from_dict(cfg.to_dict()) == cfg


def test_replace_validates_the_new_config() -> None:
    cfg = config()

    assert cfg.replace(lane_count=2).lane_count == 2
    with pytest.raises(ConfigError, match="lane_count=0"):
        cfg.replace(lane_count=0)


def test_unreadable_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"

    with pytest.raises(ConfigError, match="nope.json"):
        load_config(missing)


def test_invalid_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"stage_id": ')

    with pytest.raises(ConfigError, match="broken.json.*not valid JSON"):
        load_config(path)


def test_non_utf8_file_is_refused_with_config_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe{")

    with pytest.raises(ConfigError, match="binary.json"):
        load_config(path)


def test_a_json_array_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(write_json(tmp_path, [MINIMAL]))


# -- keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["include_embeddings", "include_output", "layers", "n_ctx"])
def test_unknown_keys_are_refused_by_name(key: str) -> None:
    message = refused(**{key: True})

    assert "stage-0" in message
    assert "unknown config key" in message
    assert key in message


@pytest.mark.parametrize("key", ["model_path", "stage_id", "stage_index", "layer_start", "layer_end"])
def test_missing_required_keys_are_refused_by_name(key: str) -> None:
    data = {k: v for k, v in MINIMAL.items() if k != key}

    with pytest.raises(ConfigError) as info:
        StageConfig.from_dict(data)

    assert "missing required config key" in str(info.value)
    assert key in str(info.value)


def test_empty_stage_id_is_refused() -> None:
    with pytest.raises(ConfigError, match="stage_id must be a non-empty string"):
        config(stage_id="")


# -- layer range and sizes ---------------------------------------------------------------


@pytest.mark.parametrize(("start", "end"), [(5, 5), (7, 3)])
def test_empty_layer_range_is_refused_naming_stage_and_values(start: int, end: int) -> None:
    message = refused(stage_id="stage-3", stage_index=3, layer_start=start, layer_end=end)

    assert "stage-3" in message
    assert f"{start}:{end}" in message
    assert f"layer_end={end}" in message
    assert f"layer_start={start}" in message


def test_negative_layer_start_is_refused() -> None:
    message = refused(layer_start=-1)

    assert "stage-0" in message and "layer_start=-1" in message


def test_lane_count_zero_is_refused() -> None:
    message = refused(lane_count=0)

    assert "stage-0" in message
    assert "lane_count=0" in message


def test_lane_count_above_n_ubatch_is_refused() -> None:
    message = refused(lane_count=8, n_batch=4, n_ubatch=4)

    assert "stage-0" in message and "lane_count=8" in message and "n_ubatch=4" in message


def test_n_ubatch_above_n_batch_is_refused_naming_n_ubatch() -> None:
    message = refused(n_batch=256, n_ubatch=512)

    assert "stage-0" in message
    assert "n_ubatch=512" in message
    assert "n_batch=256" in message


def test_n_ubatch_equal_to_n_batch_is_accepted() -> None:
    assert config(n_batch=256, n_ubatch=256).n_ubatch == 256


@pytest.mark.parametrize("value", [1.5, "4", True])
def test_integer_fields_must_be_real_integers(value: object) -> None:
    message = refused(ctx_size=value)

    assert "stage-0" in message
    assert f"ctx_size={value!r}" in message


def test_max_message_bytes_of_2_gib_or_more_is_refused_naming_field_and_value() -> None:
    # gRPC's size options are signed 32-bit ints: 2**31 would wrap.
    message = refused(max_message_bytes=2**31)

    assert "stage-0" in message and f"max_message_bytes={2**31}" in message
    assert config(max_message_bytes=2**31 - 1).max_message_bytes == 2**31 - 1


def test_cache_idle_slots_above_lane_count_is_refused() -> None:
    message = refused(lane_count=2, cache_idle_slots=3)

    assert "stage-0" in message and "cache_idle_slots=3" in message


def test_check_block_count_refuses_a_range_beyond_the_model() -> None:
    cfg = config(layer_start=20, layer_end=31)

    with pytest.raises(ConfigError) as info:
        cfg.check_block_count(30)

    message = str(info.value)
    assert "stage-0" in message
    assert "layer_end=31" in message
    assert "block count 30" in message


def test_check_block_count_accepts_a_range_ending_at_the_last_block() -> None:
    config(layer_start=20, layer_end=30).check_block_count(30)


# -- cache types and attention -------------------------------------------------------------


@pytest.mark.parametrize("name", ["cache_type_k", "cache_type_v"])
def test_bad_cache_type_names_the_field_and_stage(name: str) -> None:
    message = refused(**{name: "q3_k"})

    assert f"parse {name} for stage-0" in message
    assert "'q3_k'" in message


@pytest.mark.parametrize("cache_type", CACHE_TYPES)
def test_every_cache_type_is_accepted_for_keys(cache_type: str) -> None:
    assert config(cache_type_k=cache_type).cache_type_k == cache_type


def test_the_accepted_cache_types_are_the_seed_list() -> None:
    assert set(CACHE_TYPES) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0", "iq4_nl"])
def test_quantized_value_cache_without_flash_attention_is_refused(cache_type: str) -> None:
    message = refused(cache_type_v=cache_type, flash_attn_type="disabled")

    assert "stage-0" in message
    assert f"cache_type_v={cache_type!r}" in message
    assert "flash attention" in message


@pytest.mark.parametrize("flash", ["enabled", "auto"])
def test_quantized_value_cache_with_flash_attention_is_accepted(flash: str) -> None:
    assert config(cache_type_v="q8_0", flash_attn_type=flash).cache_type_v == "q8_0"


@pytest.mark.parametrize("flash", ["auto", "disabled", "enabled"])
def test_flash_attn_type_accepts_auto_disabled_enabled(flash: str) -> None:
    assert config(flash_attn_type=flash).flash_attn_type == flash


@pytest.mark.parametrize("flash", ["on", "true", True])
def test_flash_attn_type_refuses_anything_else(flash: object) -> None:
    message = refused(flash_attn_type=flash)

    assert "stage-0" in message
    assert f"flash_attn_type={flash!r}" in message


# -- load mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["runtime-slice", "artifact-slice"])
def test_slice_load_modes_are_accepted(mode: str) -> None:
    assert config(load_mode=mode).load_mode == mode


def test_layer_package_load_mode_is_refused_as_offline_only() -> None:
    message = refused(load_mode="layer-package")

    assert "stage-0" in message
    assert "'layer-package'" in message
    assert "layer-package schema v1 is offline-only" in message


def test_unknown_load_mode_is_refused() -> None:
    message = refused(load_mode="mmap-slice")

    assert "stage-0" in message and "'mmap-slice'" in message


# -- layer packages ------------------------------------------------------------------------------

PACKAGE = {"package_ref": "https://models.example/smollm2-pkg/", "manifest_sha256": "ab" * 32,
           "load_mode": "artifact-slice"}


@pytest.mark.parametrize("ref", ["/srv/packages/smollm2", "file:///srv/packages/smollm2",
                                 "http://models.example/pkg", "https://models.example/pkg/"])
def test_a_package_stage_needs_no_model_path(ref: str) -> None:
    data = {k: v for k, v in {**MINIMAL, **PACKAGE, "package_ref": ref}.items() if k != "model_path"}
    cfg = StageConfig.from_dict(data)

    assert (cfg.package_ref, cfg.manifest_sha256, cfg.model_path) == (ref, "ab" * 32, "")


@pytest.mark.parametrize(("changes", "named"), [
    ({"manifest_sha256": None}, "manifest_sha256=None must be set with package_ref="),
    ({"manifest_sha256": "ab" * 31}, f"manifest_sha256={'ab' * 31!r} is not a sha256"),
    ({"load_mode": "runtime-slice"}, "load_mode='runtime-slice' must be artifact-slice with package_ref="),
    ({"package_ref": "hf://org/pkg"}, "package_ref='hf://org/pkg' is not a package directory"),
    ({"package_ref": ""}, "package_ref='' is not a package directory"),
    ({"package_ref": None}, "manifest_sha256='abab"),
])
def test_package_fields_are_refused_unless_they_come_together(changes: dict[str, Any], named: str) -> None:
    message = refused(**{**PACKAGE, **changes})

    assert "stage-0" in message and named in message


def test_layer_package_load_mode_stays_refused_with_a_package() -> None:
    assert "layer-package schema v1 is offline-only" in refused(**{**PACKAGE, "load_mode": "layer-package"})


# -- booleans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mmap", "mlock", "direct_io", "repack", "check_tensors", "no_host_buffer",
                                  "op_offload", "kv_offload", "kv_unified", "swa_full"])
@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_boolean_fields_must_be_real_booleans(name: str, value: object) -> None:
    message = refused(**{name: value})

    assert "stage-0" in message
    assert f"{name}={value!r}" in message
    assert "must be true or false" in message


# -- endpoints -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("127.0.0.1:5000", Endpoint("127.0.0.1", 5000)),
        ("[::1]:5000", Endpoint("::1", 5000)),
        ("stage-1.svc:7000", Endpoint("stage-1.svc", 7000)),
    ],
)
def test_downstream_endpoint_accepts_host_port(endpoint: str, expected: Endpoint) -> None:
    cfg = config(downstream={**DOWNSTREAM, "endpoint": endpoint})

    assert cfg.downstream is not None
    assert cfg.downstream.address == expected
    assert str(cfg.downstream.address) == endpoint


@pytest.mark.parametrize("endpoint", ["localhost", "host:99999", ":80", "host:0", "127.0.0.1:", 5000])
def test_downstream_endpoint_must_be_host_port(endpoint: object) -> None:
    message = refused(downstream={**DOWNSTREAM, "endpoint": endpoint})

    assert "stage-0" in message
    assert "downstream.endpoint" in message
    assert repr(endpoint) in message


@pytest.mark.parametrize("endpoint", ["localhost", "host:99999", ":80"])
def test_bind_addr_must_be_host_port(endpoint: str) -> None:
    message = refused(bind_addr=endpoint)

    assert "stage-0" in message
    assert "bind_addr" in message
    assert repr(endpoint) in message


@pytest.mark.parametrize("endpoint", ["127.0.0.1:0", "0.0.0.0:0", "[::]:0"])
def test_bind_addr_allows_port_zero(endpoint: str) -> None:
    assert config(bind_addr=endpoint).bind_addr == endpoint


# -- neighbours --------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 2, 5])
def test_downstream_stage_index_must_be_the_next_index(index: int) -> None:
    message = refused(downstream={**DOWNSTREAM, "stage_index": index})

    assert "stage-0" in message
    assert f"downstream.stage_index={index}" in message
    assert "must be 1" in message


def test_upstream_stage_index_must_be_the_previous_index() -> None:
    with pytest.raises(ConfigError) as info:
        middle(upstream={"stage_id": "stage-0", "stage_index": 1, "endpoint": "127.0.0.1:5000"})

    message = str(info.value)
    assert "stage-1" in message
    assert "upstream.stage_index=1" in message
    assert "must be 0" in message


def test_head_stage_refuses_an_upstream() -> None:
    message = refused(stage_index=1, upstream={"stage_id": "stage-x", "stage_index": 0, "endpoint": "127.0.0.1:5000"})

    assert "stage-0" in message
    assert "'stage-x'" in message
    assert "head stage" in message


@pytest.mark.parametrize(
    "peer",
    [
        {"stage_id": "stage-1", "stage_index": 1},
        {**DOWNSTREAM, "extra": 1},
        "127.0.0.1:5001",
    ],
)
def test_peer_must_have_exactly_stage_id_stage_index_endpoint(peer: object) -> None:
    message = refused(downstream=peer)

    assert "stage-0" in message
    assert "downstream" in message
    assert "stage_id, stage_index, endpoint" in message


def test_peer_stage_index_must_be_an_integer() -> None:
    message = refused(downstream={**DOWNSTREAM, "stage_index": "1"})

    assert "stage-0" in message and "downstream.stage_index='1'" in message


@pytest.mark.parametrize("field,value", [("session_idle_ttl_s", -1), ("admission_wait_s", "x"),
                                         ("downstream_ready_timeout_s", 0), ("recovery_wait_s", -0.5)])
def test_timeouts_must_be_positive_numbers_of_seconds(field, value):
    with pytest.raises(ConfigError, match=field):
        StageConfig.from_dict({**MINIMAL, field: value})


@pytest.mark.parametrize("value", [-1, True, 1.5, "0", 2_000_000_001])
def test_cpu_wake_latency_must_be_microseconds_the_kernel_takes(value):
    with pytest.raises(ConfigError, match=f"cpu_wake_latency_us={value!r}"):
        StageConfig.from_dict({**MINIMAL, "cpu_wake_latency_us": value})


def test_cpu_wake_latency_is_left_to_the_host_unless_asked():
    assert StageConfig.from_dict(MINIMAL).cpu_wake_latency_us is None
    assert StageConfig.from_dict({**MINIMAL, "cpu_wake_latency_us": 0}).cpu_wake_latency_us == 0


# -- return_to (the final stage's direct return to the head) ------------------------

HEAD = {"stage_id": "stage-0", "stage_index": 0, "endpoint": "127.0.0.1:5000"}


def final(**changes: Any) -> StageConfig:
    """A valid final stage: stage-2 of three, layers 20:30."""
    values: dict[str, Any] = {
        "stage_id": "stage-2", "stage_index": 2, "layer_start": 20, "layer_end": 30,
        "upstream": {"stage_id": "stage-1", "stage_index": 1, "endpoint": "127.0.0.1:5001"},
    }
    return config(**{**values, **changes})


def test_the_final_stage_may_return_tokens_straight_to_the_head() -> None:
    cfg = final(return_to=HEAD)
    assert cfg.return_to == PeerConfig(**HEAD)
    assert cfg.include_output


@pytest.mark.parametrize("stage", ["head", "middle"])
def test_return_to_is_refused_on_a_stage_that_is_not_final(stage: str) -> None:
    with pytest.raises(ConfigError) as info:
        middle(return_to=HEAD) if stage == "middle" else config(return_to=HEAD)
    assert "return_to='stage-0'" in str(info.value) and "only for the final stage" in str(info.value)


def test_return_to_must_name_stage_index_0() -> None:
    with pytest.raises(ConfigError) as info:
        final(return_to={**HEAD, "stage_index": 1})
    assert "return_to.stage_index=1" in str(info.value) and "must be 0" in str(info.value)


@pytest.mark.parametrize("bad", ["nowhere", {"stage_id": "stage-0", "stage_index": 0}, "127.0.0.1:5000"])
def test_return_to_must_be_a_peer_with_a_host_port_endpoint(bad: object) -> None:
    raw = bad if not isinstance(bad, str) or ":" not in bad else {**HEAD, "endpoint": "no-port"}
    with pytest.raises(ConfigError) as info:
        final(return_to=raw)
    assert "return_to" in str(info.value)


# -- configs written for the seed (skippy-server) ------------------------------------------------

# Every field of the seed's StageConfig, spelled as the seed writes it: its defaults, nulls
# for the optional ones, tcp:// endpoints, the selected device as an object.
SEED_CONFIG: dict[str, Any] = {
    "run_id": "run-local", "topology_id": "three-hosts", "model_id": "smollm2:Q4_1",
    "package_ref": None, "manifest_sha256": None, "source_model_path": None, "source_model_sha256": None,
    "source_model_bytes": None, "materialized_path": None, "materialized_pinned": False,
    "model_path": "/models/smollm2.gguf", "checkpoint_quantization": None, "checkpoint_imatrix": None,
    "checkpoint_imatrix_sha256": None, "projector_path": None, "projector_use_gpu": None, "media_marker": None,
    "image_min_tokens": None, "image_max_tokens": None, "batch_max_tokens": None, "glm_dsa_policy": "auto",
    "generation_signal_window": None,
    "stage_id": "stage-1", "stage_index": 1, "layer_start": 10, "layer_end": 20,
    "ctx_size": 4096, "lane_count": 4, "n_batch": None, "n_ubatch": None, "n_threads": None,
    "n_threads_batch": None, "n_gpu_layers": 0, "mmap": None, "mlock": False, "repack": False,
    "op_offload": None, "no_host_buffer": False, "check_tensors": False, "direct_io": False, "main_gpu": None,
    "split_mode": "auto", "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn_type": "disabled",
    "kv_offload": None, "kv_unified": None, "swa_full": None, "cache_idle_slots": None,
    "filter_tensors_on_load": False, "resident_tensor_names": [],
    "selected_device": {"backend_device": "CPU", "stable_id": None, "index": 0, "vram_bytes": None},
    "kv_cache": None, "native_mtp_enabled": False, "load_mode": "runtime-slice",
    "bind_addr": "tcp://0.0.0.0:7001",
    "upstream": {"stage_id": "stage-0", "stage_index": 0, "endpoint": "tcp://gpu-a:7000"},
    "downstream": {"stage_id": "stage-2", "stage_index": 2, "endpoint": "tcp://gpu-c:7000"},
}


def test_a_config_that_spells_every_seed_field_loads(tmp_path: Path) -> None:
    cfg = load_config(write_json(tmp_path, SEED_CONFIG))

    assert (cfg.stage_id, cfg.layer_start, cfg.layer_end, cfg.ctx_size) == ("stage-1", 10, 20, 4096)
    assert cfg.bind_addr == "0.0.0.0:7001"
    assert cfg.upstream.endpoint == "gpu-a:7000" and cfg.downstream.endpoint == "gpu-c:7000"
    assert cfg.selected_device == "CPU"
    defaults = StageConfig(model_path="m", stage_id="s", stage_index=0, layer_start=0, layer_end=1)
    for name in ("n_batch", "n_ubatch", "n_threads", "main_gpu", "kv_offload", "kv_unified", "swa_full", "mmap",
                 "op_offload"):
        assert getattr(cfg, name) == getattr(defaults, name), name


@pytest.mark.parametrize(("name", "value"), [
    ("source_model_path", "/m.safetensors"),
    ("source_model_sha256", "cd" * 32), ("source_model_bytes", 123), ("materialized_path", "/cache/pkg"),
    ("materialized_pinned", True),
    ("batch_max_tokens", 1024), ("glm_dsa_policy", "v1"),
    ("generation_signal_window", 8), ("filter_tensors_on_load", True), ("resident_tensor_names", ["blk.10.x"]),
    ("kv_cache", {"mode": "lookup-record"}),
])
def test_a_seed_field_this_stage_would_have_to_act_on_is_refused_by_name(name: str, value: object) -> None:
    message = refused(**{**middle().to_dict(), name: value, "downstream_alternates": []})

    assert "stage-1" in message and f"{name}={value!r}" in message
    assert "does not implement" in message


@pytest.mark.parametrize("kv_cache", [None, {"mode": "disabled"}])
def test_a_disabled_seed_kv_cache_is_accepted(kv_cache: object) -> None:
    assert config(kv_cache=kv_cache).stage_id == "stage-0"


def test_native_mtp_enabled_is_off_unless_asked_and_accepted_on_the_final_stage() -> None:
    assert config().native_mtp_enabled is False
    assert middle(native_mtp_enabled=False).native_mtp_enabled is False
    assert final(native_mtp_enabled=True).native_mtp_enabled is True


def test_native_mtp_enabled_is_refused_by_name_on_a_stage_with_a_downstream() -> None:
    """The seed writes true on every stage; here only the final stage has the trunk's last hidden state."""
    with pytest.raises(ConfigError) as info:
        middle(native_mtp_enabled=True)
    assert "stage-1" in str(info.value) and "native_mtp_enabled=True" in str(info.value)
    assert "final stage" in str(info.value)
    with pytest.raises(ConfigError, match="native_mtp_enabled='yes' must be true or false"):
        final(native_mtp_enabled="yes")


def test_null_means_the_default_for_every_field_that_has_one() -> None:
    optional = [f for f in dataclasses.fields(StageConfig)
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    cfg = config(**{f.name: None for f in optional})
    for f in optional:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(cfg, f.name) == default, f.name


def test_tcp_endpoints_are_accepted_everywhere_and_stored_as_host_port() -> None:
    cfg = config(bind_addr="tcp://0.0.0.0:7000", downstream={**DOWNSTREAM, "endpoint": "tcp://[::1]:5001"},
                 downstream_alternates=[{**DOWNSTREAM, "endpoint": "TCP://spare:5001"}])
    assert cfg.bind_addr == "0.0.0.0:7000"
    assert cfg.downstream.endpoint == "[::1]:5001" and cfg.downstream.address == Endpoint("::1", 5001)
    assert cfg.downstream_alternates[0].endpoint == "spare:5001"


@pytest.mark.parametrize("endpoint", ["unix:///run/stage.sock", "http://gpu-b:7000", "quic://gpu-b:7000"])
def test_an_endpoint_with_another_scheme_is_refused_naming_it(endpoint: str) -> None:
    message = refused(downstream={**DOWNSTREAM, "endpoint": endpoint})

    assert repr(endpoint) in message and "tcp://" in message


@pytest.mark.parametrize("mode", ["auto", "none", "layer", "row", "tensor"])
def test_every_seed_split_mode_is_accepted(mode: str) -> None:
    assert config(split_mode=mode).split_mode == mode


def test_an_unknown_split_mode_is_refused_listing_the_seed_values() -> None:
    message = refused(split_mode="pipeline")
    assert "split_mode='pipeline'" in message and "auto, none, layer, row, tensor" in message


def test_selected_device_may_be_a_name_or_the_seeds_object() -> None:
    assert config(selected_device="CPU").selected_device == "CPU"
    assert config(selected_device={"backend_device": "CUDA0", "index": 0}).selected_device == "CUDA0"
    assert "selected_device.backend_device" in refused(selected_device={"index": 0})
    assert "unknown key(s) vendor" in refused(selected_device={"backend_device": "CPU", "vendor": "x"})


@pytest.mark.parametrize(("changes", "named"), [
    ({"direct_io": True, "mmap": True}, "direct_io=True"),
    ({"direct_io": True, "mlock": True}, "direct_io=True"),
])
def test_direct_io_cannot_be_combined_with_mmap_or_mlock(changes: dict, named: str) -> None:
    assert named in refused(**changes)


def test_loader_defaults_follow_the_seed_and_llama_server() -> None:
    cfg = config()
    assert (cfg.repack, cfg.mmap, cfg.mlock, cfg.direct_io, cfg.check_tensors, cfg.no_host_buffer) == \
        (False, None, False, False, False, False)
    assert (cfg.kv_unified, cfg.ctx_size, cfg.split_mode) == (False, None, "auto")


def test_session_idle_ttl_zero_means_never() -> None:
    assert config(session_idle_ttl_s=0).session_idle_ttl_s == 0
