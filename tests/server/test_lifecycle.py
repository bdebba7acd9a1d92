"""A stage is a good citizen of an orchestrator: clear failures at start, a clean drain.

A failure at start (bad config, missing model, port in use, a downstream that never
becomes ready) exits non-zero with one line naming the cause. On SIGTERM in-flight work
drains within the grace period, new work is refused, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from support.pipeline import StreamingRun
from support.waiting import eventually

from skippy_stage.cli.local import free_ports
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc


def serve(tmp_path, config: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    path = tmp_path / "stage.json"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "skippy_stage", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=timeout)


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


@pytest.fixture
def base_config(smollm2, slice_cache):
    port = free_ports("127.0.0.1", 1)[0]
    return {"model_path": str(smollm2), "stage_id": "stage-0", "stage_index": 0, "layer_start": 0,
            "layer_end": 30, "bind_addr": f"127.0.0.1:{port}", "cache_dir": str(slice_cache), "n_threads": 1}


def test_a_bad_config_exits_non_zero_naming_the_key(tmp_path, base_config):
    run = serve(tmp_path, {**base_config, "lane_cout": 4})
    assert run.returncode != 0
    assert "lane_cout" in last_line(run.stderr)


def test_a_missing_model_file_exits_non_zero_naming_the_path(tmp_path, base_config):
    run = serve(tmp_path, {**base_config, "model_path": str(tmp_path / "nope.gguf")})
    assert run.returncode != 0
    assert "nope.gguf" in last_line(run.stderr) and "not found" in last_line(run.stderr)


def test_a_port_in_use_exits_non_zero_naming_the_address(tmp_path, base_config):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = serve(tmp_path, {**base_config, "bind_addr": f"127.0.0.1:{port}"})
    assert run.returncode != 0
    assert f"127.0.0.1:{port}" in last_line(run.stderr)


def test_a_downstream_that_never_becomes_ready_exits_non_zero_naming_it(tmp_path, base_config):
    dead = free_ports("127.0.0.1", 1)[0]
    config = {**base_config, "layer_end": 15, "downstream_ready_timeout_s": 2,
              "downstream": {"stage_id": "stage-1", "stage_index": 1, "endpoint": f"127.0.0.1:{dead}"}}
    started = time.monotonic()
    run = serve(tmp_path, config)
    assert run.returncode != 0
    assert "stage-1" in last_line(run.stderr) and "did not become ready" in last_line(run.stderr)
    assert time.monotonic() - started < 60


def test_sigterm_drains_the_generation_in_flight_refuses_new_ones_and_exits_zero(smollm2, start_pipeline):
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1)
    head = pipeline.head_endpoint
    run = StreamingRun(head, "Once upon a time, there was a dragon who", 96, timeout=60)
    assert run.streaming.wait(60)
    pipeline.procs[0].send_signal(signal.SIGTERM)

    def a_new_generation() -> grpc.StatusCode:  # OK until the stage's main thread has run the handler
        with grpc.insecure_channel(head) as channel:
            try:
                list(pb_grpc.StageServiceStub(channel).Generate(pb.GenerateRequest(prompt="Hi", max_tokens=4),
                                                                timeout=10))
            except grpc.RpcError as refused:
                return refused.code()
            return grpc.StatusCode.OK

    assert eventually(a_new_generation, lambda code: code != grpc.StatusCode.OK) == grpc.StatusCode.UNAVAILABLE
    run.join(60)
    assert run.error is None, run.error
    assert run.outcome["done"].completion_tokens == 96
    assert pipeline.procs[0].wait(30) == 0
    pipeline.stop()


def test_sigterm_delivered_to_any_thread_of_a_stage_stops_it(smollm2, start_pipeline):
    """The kernel may hand a process's SIGTERM to any of its threads (OpenMP's, gRPC's); Python
    runs the handler on the main thread only once that thread runs. Sent here to one thread
    that is not the main one, as an orchestrator's SIGTERM can land."""
    import ctypes
    import os

    tgkill = getattr(ctypes.CDLL(None), "tgkill", None)
    if tgkill is None:
        pytest.skip("this libc has no tgkill()")
    pipeline = start_pipeline(smollm2, [(0, 30)], n_threads=2)
    proc = pipeline.procs[0]
    others = sorted(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
    assert others, "a serving stage runs more threads than its main one"
    assert tgkill(proc.pid, others[-1], signal.SIGTERM) == 0
    assert proc.wait(10) == 0


def test_a_session_left_idle_expires_on_every_stage(smollm2, start_pipeline):
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, session_idle_ttl_s=1.0)
    try:
        with grpc.insecure_channel(pipeline.head_endpoint) as channel:
            stub = pb_grpc.StageServiceStub(channel)
            entry = pb.BatchEntry(session_id="abandoned", positions=[0, 1, 2], token_ids=[504, 3575, 282],
                                  sample_last=True)
            stub.IterationBatch(pb.IterationBatchRequest(entries=[entry]), timeout=30)
        endpoints = [str(cfg["bind_addr"]) for cfg in pipeline.configs]

        def active() -> list[int]:
            out = []
            for endpoint in endpoints:
                with grpc.insecure_channel(endpoint) as channel:
                    out.append(pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)
                               .active_sessions)
            return out

        assert active() == [1, 1]
        deadline = time.monotonic() + 10
        while active() != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert active() == [0, 0]
    finally:
        pipeline.stop()
