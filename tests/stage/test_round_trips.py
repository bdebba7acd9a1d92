"""Each stage measures the round trip of its links — to its downstream, and a final stage's direct
return to the head — from the health probes it already sends, and reports it in GetStatus and as a
Prometheus gauge; ``plan --measure`` reads it back."""

from __future__ import annotations

import argparse
from pathlib import Path

from support.pipeline import metric, scrape, status
from support.waiting import eventually

from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs, relay_links
from skippy_stage.cli.plan import add_plan_parser
from skippy_stage.ops.link import Link
from skippy_stage.stage.round_trips import NOT_MEASURED, WINDOW, RoundTrips
from skippy_stage.v1 import stage_pb2 as pb

RANGES = [(0, 15), (15, 30)]
SAMPLES = 3  # probes answered before the figures are read (one every health_interval_s, 0.5 s)


def test_the_round_trip_is_the_median_of_the_recent_samples_and_counts_every_one():
    trips = RoundTrips()
    assert trips.read() == NOT_MEASURED and NOT_MEASURED.median_us == 0
    for seconds in (0.5, 0.001, 0.002, 0.003):  # a first call that also connected, then the link
        trips.add(seconds)
    assert trips.read().median_s == 0.0025 and trips.read().samples == 4
    for _ in range(WINDOW):
        trips.add(0.004)
    assert trips.read().median_s == 0.004, "only the last WINDOW samples count"
    assert trips.read().samples == WINDOW + 4
    assert trips.read().median_us == 4000


def measured(endpoint: str, field: str) -> pb.StageStatus:
    """The stage's status once ``field``_samples has reached SAMPLES (or after 30 s, to assert on)."""
    return eventually(lambda: status(endpoint), lambda s: getattr(s, f"{field}_samples") >= SAMPLES, within_s=30)


def test_a_pipeline_reports_each_links_round_trip_in_status_and_metrics(smollm2, start_pipeline, capsys):
    metrics_ports = free_ports("127.0.0.1", 2)
    pipeline = start_pipeline(smollm2, RANGES, n_threads=1, metrics_port=metrics_ports)
    head, final = (str(c["bind_addr"]) for c in pipeline.configs)

    down = measured(head, "downstream_rtt")
    assert down.downstream_rtt_samples >= SAMPLES
    # A sample is an answer within the probe's deadline (health_probe_s, 1 s): more is no answer.
    assert 0 < down.downstream_rtt_us < 1_000_000
    assert down.return_rtt_samples == 0 and down.return_rtt_us == 0, "the head has no direct return"
    back = measured(final, "return_rtt")
    assert 0 < back.return_rtt_us < 1_000_000
    assert back.downstream_rtt_samples == 0 and back.downstream_rtt_us == 0, "the final stage has no downstream"

    assert 0 < metric(scrape(metrics_ports[0]), "skippy_downstream_rtt_seconds") < 1
    assert metric(scrape(metrics_ports[0]), "skippy_return_rtt_seconds") == 0
    assert 0 < metric(scrape(metrics_ports[1]), "skippy_return_rtt_seconds") < 1

    # plan --measure: half of each round trip is the pair's one-way latency (both ends measured it).
    parser = argparse.ArgumentParser(prog="skippy-stage")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", str(smollm2), "--nodes", "stage-0=1,stage-1=1",
                              "--measure", f"{head},{final}", "--hop-overhead-ms", "0"])
    capsys.readouterr()
    assert args.func(args) == 0
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if line.startswith("links (one-way): measured stage-0-stage-1 "))
    one_way_ms = float(line.split()[4])
    assert one_way_ms > 0
    two = next(line.split() for line in table.splitlines() if line.split()[:4] == ["2", "stage-0", ">", "stage-1"])
    assert abs(float(two[6]) - 2 * one_way_ms) < 0.006, "a token crosses the edge and the return: the link twice"


def test_a_5_ms_link_measures_at_least_10_ms_both_ways(smollm2, slice_cache: Path, tmp_path: Path):
    """Every probe crosses the emulated link down and back: no sample can be shorter than 2 x 5 ms
    (the emulator never delivers early), whatever the host's load."""
    configs = pipeline_configs(str(smollm2), RANGES, host="127.0.0.1", ports=free_ports("127.0.0.1", 2),
                               extra={"cache_dir": str(slice_cache), "ctx_size": 1024, "lane_count": 1,
                                      "n_threads": 1})
    pipeline = LocalPipeline(configs, tmp_path, links=relay_links(configs, Link.from_ms(5)))
    try:
        pipeline.wait_serving(180)
        head, final = (str(c["bind_addr"]) for c in configs)
        assert measured(head, "downstream_rtt").downstream_rtt_us >= 10_000
        assert measured(final, "return_rtt").return_rtt_us >= 10_000
    finally:
        pipeline.stop()
