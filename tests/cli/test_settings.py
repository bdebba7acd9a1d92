"""``--set [STAGE_ID.]FIELD=VALUE``: every StageConfig field on the stages ``up``, ``demo`` and
``bench`` start, checked by the same rules as ``check``, a wrong name or value refused naming it.
``profile`` and ``ab`` take theirs as one JSON object, whose names are checked the same way."""

from __future__ import annotations

import io
import subprocess
import sys

import grpc
import pytest
from support.up import running_up

from skippy_stage.cli.client import generate
from skippy_stage.cli.local import pipeline_configs
from skippy_stage.cli.settings import apply_settings
from skippy_stage.errors import ConfigError
from skippy_stage.model.loader import reference_llama
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

THREE = [(0, 10), (10, 20), (20, 30)]


def configs() -> list[dict]:
    return pipeline_configs("m.gguf", THREE, host="127.0.0.1", ports=[7000, 7001, 7002], extra={"lane_count": 4})


def test_a_setting_reaches_every_stage_and_a_prefixed_one_only_its_stage():
    out = apply_settings(configs(), ["repack=true", "cache_type_k=q8_0", "stage-1.lane_count=2",
                                     "auth_token_path=/run/secrets/token", "session_idle_ttl_s=30.5"])

    assert [c["repack"] for c in out] == [True, True, True]
    assert [c["cache_type_k"] for c in out] == ["q8_0"] * 3  # not JSON: a string
    assert [c["lane_count"] for c in out] == [4, 2, 4]
    assert {c["auth_token_path"] for c in out} == {"/run/secrets/token"}
    assert {c["session_idle_ttl_s"] for c in out} == {30.5}


def test_settings_apply_in_order_after_the_commands_flags_and_null_means_the_default():
    out = apply_settings(configs(), ["lane_count=8", "lane_count=6", "stage-2.lane_count=null"])
    assert [c["lane_count"] for c in out] == [6, 6, None]


def test_head_only_fields_go_to_the_head_and_one_key_of_an_object_can_be_set():
    out = apply_settings(configs(), ["speculative.drafter=ngram", "speculative.k=4", "http_port=8080"])

    assert out[0]["speculative"]["drafter"] == "ngram" and out[0]["speculative"]["k"] == 4
    assert out[0]["speculative"]["ngram"] == 2  # the other keys keep their defaults
    assert out[0]["http_port"] == 8080
    assert all("speculative" not in c and "http_port" not in c for c in out[1:])


@pytest.mark.parametrize(("setting", "named"), [
    ("no_such_field=1", "'no_such_field' is not a StageConfig field"),
    ("stage-7.lane_count=2", "'stage-7' is not a StageConfig field"),
    ("lane_count", "must be FIELD=VALUE"),
    ("repack=yes", "repack='yes' must be true or false"),
    ("lane_count=0", "lane_count=0 must be >= 1"),
    ("cache_type_k=q9", "parse cache_type_k for stage-0: 'q9'"),
    ("stage-1.max_inflight=0", "max_inflight=0 must be >= 1"),
    ("speculative.k=99", "speculative.k=99"),
    ("layer_end=12", "layer_end is wired by the command itself"),
    ("downstream=null", "downstream is wired by the command itself"),
])
def test_a_wrong_name_or_value_is_refused_naming_it(setting: str, named: str):
    with pytest.raises(ConfigError) as info:
        apply_settings(configs(), [setting])
    assert named in str(info.value)
    if "=" in setting and "wired" not in named and "not a StageConfig" not in named:
        assert f"--set {setting}" in str(info.value)


@pytest.mark.parametrize("command", ["up", "demo", "bench"])
def test_the_commands_refuse_a_wrong_setting_before_starting_anything(smollm2, command):
    args = {"up": ["up", "--model", str(smollm2), "--stages", "2"], "demo": ["demo"], "bench": ["bench"]}[command]
    done = subprocess.run([sys.executable, "-m", "skippy_stage", *args, "--set", "kv_unified=maybe"],
                          capture_output=True, text=True, timeout=120)

    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert "kv_unified='maybe' must be true or false" in lines[-1] and "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "named"), [
    (["profile", "--fields", '{"kv_unifed": true}'], "'kv_unifed' is not a StageConfig field"),
    (["profile", "--fields", "n_threads=1"], "'n_threads=1' is not JSON"),
    (["ab", "--a", '{"layer_start": 0}'], "'layer_start' is wired by the command itself"),
    (["ab", "--b", "[1]"], "'[1]' is not a JSON object of stage config fields"),
])
def test_the_measuring_commands_take_fields_as_a_json_object_and_refuse_a_wrong_one_before_starting(args, named):
    done = subprocess.run([sys.executable, "-m", "skippy_stage", *args], capture_output=True, text=True, timeout=120)

    assert done.returncode == 2
    assert named in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_up_serves_with_the_settings_given(smollm2, slice_cache):
    with running_up("--model", str(smollm2), "--stages", "2", "--set", "kv_unified=true", "--set", "ctx_size=4096",
                    "--set", "stage-1.lane_count=2", cache=slice_cache) as (endpoint, _):
        with grpc.insecure_channel(endpoint) as channel:
            head = pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        with grpc.insecure_channel(head.downstream_endpoint) as channel:
            final = pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert (head.lane_count, head.kv_pool_tokens, head.kv_cells_per_lane) == (4, 4096, 4096)  # one shared pool
        assert (final.lane_count, final.kv_pool_tokens, final.kv_cells_per_lane) == (2, 4096, 4096)

        out = io.StringIO()
        generate(endpoint, "The rain in Spain", max_tokens=8, temperature=0.0, seed=None, chat=False, out=out)
        llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
        try:
            assert out.getvalue() == llm.create_completion("The rain in Spain", max_tokens=8,
                                                           temperature=0)["choices"][0]["text"]
        finally:
            llm.close()
