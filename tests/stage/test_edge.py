"""Each edge is agreed at start-up: a stage whose downstream does not continue its layers
(or has another width, or takes frames over another transport) never reports SERVING, and
says why, naming both ends."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc


def two_stages(smollm2, slice_cache) -> list[dict]:
    ports = free_ports("127.0.0.1", 2)
    return pipeline_configs(str(smollm2), [(0, 10), (10, 30)], host="127.0.0.1", ports=ports,
                            extra={"cache_dir": str(slice_cache), "n_threads": 1})


def head_refusal(configs, tmp_path) -> pb.StageStatus:
    """Start the stages and wait for the head to say why it refuses its edge; the head must then
    be NOT_SERVING for readiness and SERVING for liveness."""
    pipeline = LocalPipeline(configs, tmp_path)
    try:
        head = str(configs[0]["bind_addr"])
        with grpc.insecure_channel(head) as channel:
            stage = pb_grpc.StageServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 120
            status = None
            while time.monotonic() < deadline:
                try:
                    status = stage.GetStatus(pb.GetStatusRequest(), timeout=2)
                    if "refused" in status.downstream_error:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
            assert status is not None
            assert not status.downstream_ok
            check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Not ready, but alive: a liveness probe must not restart it for its neighbour's fault.
            alive = health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2)
            assert alive.status == health_pb2.HealthCheckResponse.SERVING
            return status
    finally:
        pipeline.stop()


def test_a_downstream_that_does_not_continue_the_layers_keeps_the_head_not_serving(smollm2, slice_cache, tmp_path):
    configs = two_stages(smollm2, slice_cache)
    configs[1]["layer_start"] = 15  # stage-1 serves 15:30: layers 10..14 would be skipped
    status = head_refusal(configs, tmp_path)
    assert "layer_start=15" in status.downstream_error and "layer_end=10" in status.downstream_error


def test_neighbours_on_different_frame_transports_are_refused_naming_both_ends(smollm2, slice_cache, tmp_path):
    configs = two_stages(smollm2, slice_cache)
    configs[0]["hop_transport"] = "tcp"
    configs[1]["hop_transport"] = "stream"
    status = head_refusal(configs, tmp_path)
    error = status.downstream_error
    assert "edge to stage stage-1 refused" in error
    assert "hop_transport='stream'" in error and "(stage-0) sends them over 'tcp'" in error
