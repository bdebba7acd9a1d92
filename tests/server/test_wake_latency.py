"""A stage told to keep the host's idle CPUs quick to wake holds the kernel's CPU latency
request exactly while it runs, and one that cannot hold it refuses to start, naming why."""

from __future__ import annotations

import os

import pytest

from skippy_stage.errors import ConfigError
from skippy_stage.server import wake_latency
from skippy_stage.server.wake_latency import WakeLatencyRequest

needs_device = pytest.mark.skipif(
    not os.access(wake_latency.DEVICE, os.R_OK | os.W_OK),
    reason=f"{wake_latency.DEVICE} is not readable and writable here (root, or the device given to the test)")


def test_a_request_that_cannot_be_held_names_the_setting_the_device_and_the_way_out(tmp_path):
    missing = tmp_path / "cpu_dma_latency"
    with pytest.raises(ConfigError) as refused:
        WakeLatencyRequest(0, stage_id="stage-1", device=str(missing))
    message = str(refused.value)
    assert "stage-1" in message and "cpu_wake_latency_us=0" in message and str(missing) in message
    assert "unset cpu_wake_latency_us" in message


@needs_device
def test_the_request_holds_while_open_and_ends_with_close():
    before = wake_latency.current_us()
    if before == 0:
        pytest.skip("another process holds this host's CPUs at 0 us already: a request cannot be told apart")
    request = WakeLatencyRequest(0, stage_id="stage-0")
    try:
        assert wake_latency.current_us() == 0
    finally:
        request.close()
    assert wake_latency.current_us() == before
    request.close()  # a second close is harmless


@needs_device
def test_a_serving_stage_holds_its_wake_latency_until_it_stops(smollm2, start_pipeline):
    before = wake_latency.current_us()
    if before == 0:
        pytest.skip("another process holds this host's CPUs at 0 us already: a stage's request cannot be told apart")
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, cpu_wake_latency_us=[None, 0])
    try:
        assert wake_latency.current_us() == 0
    finally:
        pipeline.stop()
    assert wake_latency.current_us() == before
