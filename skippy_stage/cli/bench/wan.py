"""The 3-stage split over emulated links: single-stream decode, speculation, concurrent sessions and
a long prompt's first token, with every edge of the chain (frames down, the final stage's direct
return to the head, both transports) through the link emulator (``skippy_stage.ops.link``) at each
one-way delay, against the same run's zero-delay pipeline.

A token crosses the chain's 3 edges once (head -> 1 -> 2 -> head), so a plain decode cannot beat
``floor_ms_per_token`` = 3 x D + the zero-delay pipeline's ms/token. The zero-delay pipeline runs
through relays too (delay 0, the same bandwidth cap): the emulator's own cost is in every figure
alike, and the floor adds only the delay. Every pipeline is loaded at once and measured in
interleaved rounds (the others frozen, as in ``decode``); all figures are medians over the rounds.
The clients run in the quiet client's process (``QuietClient``), never in this one, whose threads
are the relays'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from skippy_stage.cli.bench.batched import _prefill_prompt
from skippy_stage.cli.bench.pipeline import _awake, _Pipeline, after_freeze
from skippy_stage.cli.bench.quiet_client import QuietClient
from skippy_stage.cli.bench.speculative import SPEC_PROMPTS, SPEC_TOKENS, spec_run
from skippy_stage.cli.bench.workload import AGG_TOKENS, DECODE_ROUNDS, DECODE_TOKENS, PROMPT, QUICK, THREE
from skippy_stage.config import StageConfig
from skippy_stage.errors import SkippyError
from skippy_stage.ops.link import Link

# One-way delay per edge, ms (``bench --wan-delays-ms``); 0 is always measured (the floor's).
WAN_DELAYS_MS: tuple[float, ...] = (0.0, 5.0) if QUICK else (0.0, 2.0, 10.0)
# Concurrent sessions of the aggregate figures; the pipeline gets as many lanes as the most.
WAN_CONCURRENCY: tuple[int, ...] = (1, 4) if QUICK else (1, 4, 16)
# The long prompt whose time to first token is measured (``ttft_ms_1024``; shorter in a quick run,
# ``conditions.ttft_prompt_tokens`` says how long).
TTFT_TOKENS = 128 if QUICK else 1024
# KV cells per lane: the long prompt and its token, with room to spare.
CELLS_PER_LANE = max(TTFT_TOKENS, 1024) + 256
# Health checks per round through one edge's relay and straight to the stage behind it.
PINGS = 5 if QUICK else 20
# A token's trip: head -> 1 -> 2 -> head (the direct return), one edge each.
EDGES = len(THREE)

# The targets, each at any delay D (the table shows them beside the figures).
PLAIN_VS_FLOOR_MAX = 1.05
SPEEDUP_MIN = {"repetitive": 3.0, "free_form": 1.5}
AGGREGATE_VS_ZERO_DELAY_MIN = 0.8
TTFT_EXTRA_TRIPS_MAX = 2


@dataclass(frozen=True)
class WanSetup:
    """The links the ``wan`` section measures: one pipeline per one-way delay, each edge capped at
    ``mbit`` (every pipeline, the zero-delay one included; unset: no cap)."""

    delays_ms: tuple[float, ...] = WAN_DELAYS_MS
    mbit: float | None = None

    def __post_init__(self) -> None:
        for d in self.delays_ms:
            if not 0 <= d < 3_600_000:
                raise SkippyError(f"a wan delay of {d:g} ms must be a number of milliseconds >= 0")
        # The floor needs the zero-delay run; each delay once, in order.
        object.__setattr__(self, "delays_ms", tuple(sorted({0.0, *map(float, self.delays_ms)})))
        if self.mbit is not None and not self.mbit > 0:
            raise SkippyError(f"--link-mbit {self.mbit:g} must be > 0")

    @classmethod
    def from_flags(cls, delays_ms: str | None, link_delay_ms: float | None, mbit: float | None) -> WanSetup:
        """``--wan-delays-ms D,D,...`` or ``--link-delay-ms D`` (that delay and 0), and ``--link-mbit``."""
        if link_delay_ms is not None:
            return cls((0.0, link_delay_ms), mbit)
        if delays_ms is None:
            return cls(mbit=mbit)
        try:
            parsed = tuple(float(part) for part in delays_ms.split(","))
        except ValueError:
            raise SkippyError(f"--wan-delays-ms {delays_ms!r} must be milliseconds separated by commas, "
                              f"e.g. 0,2,10") from None
        return cls(parsed, mbit)


def delay_key(delay_ms: float) -> str:
    """A delay as the report's ``by_delay`` names it: "0", "2", "10", "2.5"."""
    return f"{delay_ms:g}"


@dataclass
class _Round:
    """One round's figures of one pipeline."""

    plain_ms: float
    plain_text: str
    spec: dict[str, dict[str, tuple[float, float, float, str]]]  # prompt -> drafter -> spec_run's
    aggregate: dict[str, float]
    ttft_ms: float
    ttft_prompt_tokens: int
    one_way_ms: float


def _wan(model: Path, workdir: Path, cache_dir: str, setup: WanSetup) -> dict[str, object]:
    """The ``wan`` report: per delay (``by_delay["<D>"]``) the figures, the floor, what the relay
    measured and whether the outputs are the zero-delay pipeline's."""
    (workdir / "wan").mkdir()
    lanes = max(WAN_CONCURRENCY)
    # lane_count for the most concurrent sessions (max_inflight as a stage has it by default).
    extra = {"lane_count": lanes, "ctx_size": lanes * CELLS_PER_LANE}
    ttft_prompt = _prefill_prompt(model, cache_dir, TTFT_TOKENS)
    pipelines: dict[str, _Pipeline] = {}
    quiet = QuietClient()
    runs: dict[str, list[_Round]] = {}
    try:
        for d in setup.delays_ms:
            key = delay_key(d)
            (workdir / "wan" / key).mkdir()
            pipelines[key] = _Pipeline(model, THREE, workdir / "wan" / key, cache_dir, kv_unified=False, extra=extra,
                                       link=Link.from_ms(d, mbit=setup.mbit))
        for pipeline in pipelines.values():
            with _awake(pipelines.values(), pipeline):
                after_freeze(partial(_warm, pipeline, quiet, ttft_prompt))
        for _ in range(DECODE_ROUNDS):
            for key, pipeline in pipelines.items():
                with _awake(pipelines.values(), pipeline):
                    runs.setdefault(key, []).append(after_freeze(partial(_round, pipeline, quiet, ttft_prompt)))
        # The head as it ran (after --set): what bounds the speculative and concurrent figures.
        head = StageConfig.from_dict(pipelines[delay_key(0.0)].local.configs[0])
        conditions = {"stages": len(THREE), "edges_per_token": EDGES, "decode_tokens": DECODE_TOKENS,
                      "speculative_tokens": SPEC_TOKENS, "speculative": {"drafter": "ngram", "k": "auto"},
                      "aggregate_tokens_per_session": AGG_TOKENS, "concurrency": list(WAN_CONCURRENCY),
                      "ttft_prompt_tokens": runs[delay_key(0.0)][0].ttft_prompt_tokens, "rounds": DECODE_ROUNDS,
                      "lane_count": head.lane_count, "max_inflight": head.max_inflight,
                      "verify_window_depth": getattr(head, "verify_window_depth", None),
                      "n_batch": head.n_batch, "hop_transport": head.hop_transport, "pings_per_round": PINGS}
    finally:
        quiet.close()
        for pipeline in pipelines.values():
            pipeline.stop()
    return _report(setup, runs, conditions)


def _warm(pipeline: _Pipeline, quiet: QuietClient, ttft_prompt: str) -> None:
    """Each kind of request once, short: connections made, buffers grown, before anything is timed
    (a quick run, whose figures only show the report's shape, warms the plain path only)."""
    quiet.generate(pipeline.endpoint, PROMPT, 8)
    if QUICK:
        return
    for prompt in SPEC_PROMPTS.values():
        quiet.generate(pipeline.endpoint, prompt, 8, speculative={"drafter": "ngram", "k": "auto"})
    quiet.generate(pipeline.endpoint, ttft_prompt, 1)
    quiet.concurrent(pipeline.endpoint, PROMPT, 2, max(WAN_CONCURRENCY))


def _round(pipeline: _Pipeline, quiet: QuietClient, ttft_prompt: str) -> _Round:
    endpoint = pipeline.endpoint
    plain = quiet.generate(endpoint, PROMPT, DECODE_TOKENS + 1)

    def generate(prompt: str, max_tokens: int, speculative: dict[str, object]) -> dict:
        return quiet.generate(endpoint, prompt, max_tokens, speculative=speculative)

    spec = {name: {drafter: spec_run(generate, pipeline.metrics_ports[0], prompt, drafter)
                   for drafter in ("none", "ngram")}
            for name, prompt in SPEC_PROMPTS.items()}
    aggregate = {str(c): quiet.concurrent(endpoint, PROMPT, AGG_TOKENS, c)["tokens_per_s"] for c in WAN_CONCURRENCY}
    ttft = quiet.generate(endpoint, ttft_prompt, 1)
    return _Round(plain_ms=1e3 / plain["tokens_per_s"], plain_text=plain["text"], spec=spec, aggregate=aggregate,
                  ttft_ms=ttft["ttft_s"] * 1e3, ttft_prompt_tokens=int(ttft["prompt_tokens"]),
                  one_way_ms=one_way_ms(pipeline, PINGS))


def one_way_ms(pipeline: _Pipeline, pings: int) -> float:
    """The one-way delay the emulator adds on an edge, measured: gRPC health checks of stage 1
    through the relay of the edge head -> 1 and straight to stage 1, alternated; half the
    difference of the median round trips (a check crosses the relay both ways). What is left
    beside the link's delay is the relay's own cost: an extra loopback hop and its threads' wake-ups."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert pipeline.relays is not None, "a pipeline without link emulation"
    request = health_pb2.HealthCheckRequest(service="")
    relayed: list[float] = []
    direct: list[float] = []
    with grpc.insecure_channel(pipeline.relays.downstream[0]) as via, \
            grpc.insecure_channel(str(pipeline.local.configs[1]["bind_addr"])) as straight:
        stubs = [(health_pb2_grpc.HealthStub(via), relayed), (health_pb2_grpc.HealthStub(straight), direct)]
        for stub, _ in stubs:
            stub.Check(request, timeout=30)  # connected and warm
        for _ in range(pings):
            for stub, times in stubs:
                started = time.perf_counter()
                stub.Check(request, timeout=30)
                times.append(time.perf_counter() - started)
    return float(np.median(relayed) - np.median(direct)) / 2 * 1e3


def _report(setup: WanSetup, runs: dict[str, list[_Round]], conditions: dict[str, object]) -> dict[str, object]:
    zero_key = delay_key(0.0)
    zero = _medians(runs[zero_key])
    top = str(max(WAN_CONCURRENCY))
    by_delay: dict[str, dict[str, object]] = {}
    for d in setup.delays_ms:
        key = delay_key(d)
        m = _medians(runs[key])
        floor = EDGES * d + zero["plain_ms_per_token"]
        first, zero_first = runs[key][0], runs[zero_key][0]
        by_delay[key] = {
            "plain_ms_per_token": m["plain_ms_per_token"],
            "floor_ms_per_token": floor,
            "speculative_ms_per_token": m["speculative_ms_per_token"],
            "plain_ms_per_token_same_prompts": m["plain_ms_per_token_same_prompts"],
            "aggregate_tokens_per_s": m["aggregate_tokens_per_s"],
            "ttft_ms_1024": m["ttft_ms_1024"],
            # What the relay added one way, measured (median over the rounds' pings).
            "relay_one_way_ms": m["relay_one_way_ms"],
            # What bounds them: the delay each plain token paid (ideally EDGES x D); tokens kept per
            # trip through the chain and what a speculative trip cost (each pays the whole trip).
            "delay_paid_ms_per_token": m["plain_ms_per_token"] - zero["plain_ms_per_token"],
            "speculative_tokens_per_trip": m["speculative_tokens_per_trip"],
            "speculative_rows_per_trip": m["speculative_rows_per_trip"],
            "speculative_ms_per_trip": m["speculative_ms_per_trip"],
            # Greedy: the same text as the zero-delay pipeline's (the first round's of each).
            "outputs_match_zero_delay": {
                "plain": first.plain_text == zero_first.plain_text,
                "plain_same_prompts": {name: first.spec[name]["none"][3] == zero_first.spec[name]["none"][3]
                                       for name in SPEC_PROMPTS},
                "speculative": {name: first.spec[name]["ngram"][3] == zero_first.spec[name]["ngram"][3]
                                for name in SPEC_PROMPTS},
            },
            "ratios": {
                "plain_vs_floor": m["plain_ms_per_token"] / floor,
                # tokens/s with the ngram drafter over without, the same prompt, at this delay
                "speculative_vs_plain_tokens_per_s": {
                    name: m["plain_ms_per_token_same_prompts"][name] / m["speculative_ms_per_token"][name]
                    for name in SPEC_PROMPTS},
                "aggregate_vs_zero_delay": {c: m["aggregate_tokens_per_s"][c] / zero["aggregate_tokens_per_s"][c]
                                            for c in m["aggregate_tokens_per_s"]},
                "ttft_bound_ms": zero["ttft_ms_1024"] + TTFT_EXTRA_TRIPS_MAX * EDGES * d,
                "ttft_excess_trips": ((m["ttft_ms_1024"] - zero["ttft_ms_1024"]) / (EDGES * d)) if d else 0.0,
            },
            # Per round, to tell the link's cost from the host's noise: the rounds ran interleaved, so
            # a round's figures at D and at 0 are minutes apart at most.
            "plain_ms_per_token_by_round": [r.plain_ms for r in runs[key]],
            "plain_vs_floor_by_round": [r.plain_ms / (EDGES * d + z.plain_ms) for r, z in zip(runs[key], runs[zero_key])],
            "ttft_ms_1024_by_round": [r.ttft_ms for r in runs[key]],
        }
    return {"delays_ms": list(setup.delays_ms), "link_mbit": setup.mbit, "by_delay": by_delay,
            "targets": {"plain_vs_floor_max": PLAIN_VS_FLOOR_MAX,
                        "speculative_vs_plain_tokens_per_s_min": SPEEDUP_MIN,
                        f"aggregate_{top}_vs_zero_delay_min": AGGREGATE_VS_ZERO_DELAY_MIN,
                        "ttft_excess_trips_max": TTFT_EXTRA_TRIPS_MAX},
            "conditions": conditions}


def _medians(rounds: Sequence[_Round]) -> dict[str, object]:
    def med(values: Sequence[float]) -> float:
        return float(np.median(values))

    def spec(drafter: str, index: int) -> dict[str, float]:
        return {name: med([r.spec[name][drafter][index] for r in rounds]) for name in SPEC_PROMPTS}

    return {"plain_ms_per_token": med([r.plain_ms for r in rounds]),
            "speculative_ms_per_token": spec("ngram", 0),
            "plain_ms_per_token_same_prompts": spec("none", 0),
            "speculative_tokens_per_trip": spec("ngram", 1),
            "speculative_rows_per_trip": spec("ngram", 2),
            "speculative_ms_per_trip": {name: med([r.spec[name]["ngram"][0] * r.spec[name]["ngram"][1]
                                                   for r in rounds]) for name in SPEC_PROMPTS},
            "aggregate_tokens_per_s": {c: med([r.aggregate[c] for r in rounds]) for c in rounds[0].aggregate},
            "ttft_ms_1024": med([r.ttft_ms for r in rounds]),
            "relay_one_way_ms": med([r.one_way_ms for r in rounds])}
