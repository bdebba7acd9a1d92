"""Each stage exposes Prometheus metrics on its own port: requests by RPC and code, batch
sizes, compute time, forward-hop latency, lanes and KV cells, queue depth, activation bytes."""

from __future__ import annotations

from support.pipeline import grpc_generate, scrape
from support.pipeline import metric as value
from support.waiting import eventually

from skippy_stage.cli.local import free_ports


def test_stages_export_request_batch_hop_lane_and_wire_metrics(smollm2, start_pipeline):
    metrics_ports = free_ports("127.0.0.1", 2)
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=metrics_ports)
    try:
        text, last = grpc_generate(pipeline.head_endpoint, "The capital of France is", 8)
        assert last.done
        # The head frees its lane a moment after the last token; a stage books a frame after sending on.
        m = eventually(lambda: scrape(metrics_ports[0]), lambda m: value(m, "skippy_lanes_active") == 0)
        assert value(m, "skippy_requests_total", rpc="Generate", code="OK") == 1
        assert value(m, "skippy_batch_tokens_count") >= 8
        assert value(m, "skippy_compute_seconds_count") >= 8
        assert value(m, "skippy_forward_hop_seconds_count") >= 8
        assert value(m, "skippy_activation_bytes_total", direction="sent", codec="f32") >= 8 * 576 * 4
        assert value(m, "skippy_kv_cells_total") == 4 * 2048  # the pipeline fixture's ctx_size: 2048 for each of 4 lanes
        assert value(m, "skippy_lanes_active") == 0
        assert value(m, "skippy_queue_depth") == 0
        # 2 stages with a core each: about one batch per stage (the cap is max_inflight, 4 by default)
        assert 1 <= value(m, "skippy_batches_in_flight") <= 4
        below = eventually(lambda: scrape(metrics_ports[1]),
                           lambda b: min(value(b, "skippy_requests_total", rpc="Frame", code="OK"),
                                         value(b, "skippy_hop_latency_seconds_count")) >= 8)
        assert value(below, "skippy_activation_bytes_total", direction="received", codec="f32") >= 8 * 576 * 4
        # Frames are counted by what arrived, whatever the transport carried them.
        assert value(below, "skippy_requests_total", rpc="Frame", code="OK") >= 8
        # Hop latency: the upstream's send to this stage starting on the frame.
        assert value(below, "skippy_hop_latency_seconds_count") >= 8
        assert 0 < value(below, "skippy_hop_latency_seconds_sum") / value(below, "skippy_hop_latency_seconds_count") < 1
        print("sample of the head's metrics:\n" + "\n".join(
            line for line in m.splitlines() if line.startswith("skippy_") and "bucket" not in line))
    finally:
        pipeline.stop()


def test_the_head_reports_each_generations_time_to_first_token_and_time_per_output_token(smollm2, start_pipeline):
    """What a streaming client waits for, measured where the text leaves: one observation of each
    per generation, within the time the client itself saw; a one-token generation has no time per
    output token."""
    import time

    (port,) = free_ports("127.0.0.1", 1)
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=[port, None])
    try:
        started = time.monotonic()
        _, last = grpc_generate(pipeline.head_endpoint, "The capital of France is", 12)
        elapsed = time.monotonic() - started
        assert last.completion_tokens == 12
        m = scrape(port)
        assert value(m, "skippy_time_to_first_token_seconds_count") == 1
        assert 0 < value(m, "skippy_time_to_first_token_seconds_sum") < elapsed
        assert value(m, "skippy_time_per_output_token_seconds_count") == 1
        assert 0 < value(m, "skippy_time_per_output_token_seconds_sum") * 11 < elapsed
        grpc_generate(pipeline.head_endpoint, "The capital of France is", 1)
        m = scrape(port)
        assert value(m, "skippy_time_to_first_token_seconds_count") == 2
        assert value(m, "skippy_time_per_output_token_seconds_count") == 1
    finally:
        pipeline.stop()


def test_every_log_line_names_the_stage_and_run_and_a_request_logs_once_not_per_token(smollm2, start_pipeline, tmp_path):
    import json

    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, run_id="run-42", log_dir=tmp_path)
    try:
        _, last = grpc_generate(pipeline.head_endpoint, "The capital of France is", 24)
        session = last.session_id
    finally:
        pipeline.stop()
    for stage in ("stage-0", "stage-1"):
        lines = [json.loads(line) for line in (tmp_path / f"{stage}.log").read_text().splitlines()
                 if line.startswith("{")]
        assert lines and all(line["stage_id"] == stage and line["run_id"] == "run-42" for line in lines)
    head = [json.loads(line) for line in (tmp_path / "stage-0.log").read_text().splitlines() if line.startswith("{")]
    about_session = [line for line in head if line.get("session_id") == session and line["level"] == "info"]
    assert [line["event"] for line in about_session if line["event"] == "generate"] == ["generate"]
    assert len(about_session) <= 3  # one line per request, never one per token (24 tokens here)
    print("a head log line:", json.dumps(next(line for line in about_session if line["event"] == "generate")))


def test_the_frame_paths_histograms_expose_what_prometheus_clients_own_would():
    """Stages observe their per-frame histograms with a leaner class of their own (``metrics.Histogram``);
    a scraper must not see the difference: the same buckets, counts and sum, bounds included."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client import Histogram as ClientHistogram

    from skippy_stage.metrics import Histogram

    buckets = (0.00002, 0.0002, 0.001, 1.0, 10.0)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("skippy_x_seconds", "doc", buckets=buckets, registry=ours)
    reference = ClientHistogram("skippy_x_seconds", "doc", buckets=buckets, registry=theirs)
    for v in (0.0, 0.00001, 0.00002, 0.000021, 0.0002, 0.5, 1.0, 9.99, 10.0, 11.0, 1e9):
        mine.observe(v)
        reference.observe(v)

    def samples(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]
    assert samples(ours) == samples(theirs)
