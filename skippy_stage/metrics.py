"""Prometheus metrics of one stage, on their own registry and (optionally) their own port.

Counters and histograms are updated on the batch path; lane, KV and queue gauges are read
from their owners at scrape time, so there is no second copy of that state to drift.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator
from functools import lru_cache
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_ENTRY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Fine between 0.1 and 1 ms, where a hop on one host lands: bench reads its median from these
# (interpolated within a bucket, so 0.2-0.5 ms in one bucket read a 230 us median as ~300).
_HOP_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.002,
                0.005, 0.01, 0.05, 0.25, 1.0)
_TPOT_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.25, 1.0)
_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class Histogram:
    """A Prometheus histogram for the frame path: one observation is a bisect and two adds
    under one lock, and the buckets are summed only when scraped.

    prometheus_client's own takes a lock per value it touches and checks its state on every
    call; a frame's ``record`` (four observations and its counters) on caches the last decode
    emptied (``Tally``) took 16 us with it and takes 11.6 with this. Exposed exactly as
    prometheus_client exposes one: ``_bucket{le=...}`` (cumulative, ``+Inf`` last), ``_count``,
    ``_sum``.
    """

    def __init__(self, name: str, documentation: str, *, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc = name, documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._labels = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        i = bisect_left(self._bounds, value)  # the first bound >= value: Prometheus buckets are le
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._doc)
        family.add_metric([], list(zip(self._labels, accumulate(counts))), sum_value=total)
        yield family


class Tally:
    """What one frame (or step) did on its way through a stage, recorded once its output has
    left (``StageMetrics.record``). (Failures are counted where they happen: off the fast path.)

    A metric update takes a lock and walks its buckets. On the path from a frame's bytes in
    to the next frame's bytes out that work is paid in series at every stage for every token,
    on caches the stage's own layers just evicted, where it costs 3-10x its hot price
    (measured); after the send it is off that path (on shared cores it still takes CPU from the
    next stage's compute, so it is kept small too).
    """

    __slots__ = ("latencies", "computes", "received", "sent", "frames_ok", "returns", "native")

    def __init__(self) -> None:
        self.latencies: list[float] = []  # seconds, one per frame
        self.computes: list[tuple[float, int, int, list[int]]] = []  # seconds, entries, tokens, forks' lengths
        self.received: list[tuple[str, int]] = []  # (codec, payload bytes) per frame
        self.sent: list[tuple[str, int]] = []
        self.frames_ok = 0
        self.returns: list[str] = []  # a final stage's outputs by how they left
        self.native = 0  # frames the native path ran


class _BeforeScrape:
    """A collector that gives nothing, registered first: a scrape runs its hooks before the
    metrics are read (what a stage keeps to record in bulk is recorded, then read)."""

    def __init__(self) -> None:
        self.hooks: list[Callable[[], None]] = []

    def collect(self) -> list:
        for hook in self.hooks:
            hook()
        return []


class StageMetrics:
    def __init__(self, stage_id: str) -> None:
        self.registry = CollectorRegistry()
        self._before_scrape = _BeforeScrape()
        self.registry.register(self._before_scrape)
        r, s = self.registry, {"stage_id": stage_id}
        # Children looked up once per label set (``labels`` validates and locks on every call).
        self.requests = lru_cache(Counter("skippy_requests", "RPCs handled, by method and status code",
                                          ["rpc", "code"], registry=r).labels)  # type: ignore[assignment]
        self.batch_entries = Histogram("skippy_batch_entries", "Sessions (entries) per batch", buckets=_ENTRY_BUCKETS,
                                       registry=r)
        self.batch_tokens = Histogram("skippy_batch_tokens", "Tokens per batch", buckets=_TOKEN_BUCKETS, registry=r)
        self.compute_seconds = Histogram("skippy_compute_seconds", "Seconds spent in this stage's layers per batch",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.hop_seconds = Histogram("skippy_forward_hop_seconds",
                                     "Seconds from sending a step's frame downstream to its outputs arriving back "
                                     "(everything below; where a step is waited for: the head, unary calls)",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.hop_latency_seconds = Histogram(
            "skippy_hop_latency_seconds", "Seconds from the upstream handing a frame to its transport to this stage "
            "starting on it (clocks of both hosts; exact on one host)", buckets=_HOP_BUCKETS, registry=r)
        self.coalesced_frames = Counter("skippy_coalesced_frames", "Frames that arrived together and ran in one "
                                        "llama_decode with others", registry=r)
        self.activation_bytes = Counter("skippy_activation_bytes", "Activation payload bytes, by direction and codec",
                                        ["direction", "codec"], registry=r)
        self._activation = lru_cache(self.activation_bytes.labels)
        self.forward_failures = Counter("skippy_forward_failures", "Batches lost because a downstream failed",
                                        ["failed_stage"], registry=r)
        self.native_frames = Counter("skippy_native_frames", "Frames this stage ran in compiled code (plain "
                                     "decode frames; every other frame runs in Python)", registry=r)
        self.lone_steps = Counter("skippy_lone_steps", "The head's decode steps of a lone greedy generation run back "
                                  "to back in compiled code, the scheduler seeing each token after the next step left",
                                  registry=r)
        self.returns = lru_cache(Counter("skippy_returns", "Batch outputs at the head, by the copy that settled the step "
                               "(direct: straight from the final stage; relay: back up through the stages) or, at "
                               "the final stage, how they left (sent: straight to the head; relayed: up the edge)",
                               ["path"], registry=r).labels)  # type: ignore[assignment]
        self.prefix_cache_hits = Counter("skippy_prefix_cache_hits", "New sessions at the head that started "
                                         "from a resident prefix", registry=r)
        self.prefix_cache_misses = Counter("skippy_prefix_cache_misses", "New sessions at the head that prefilled "
                                           "their whole prompt (no resident prefix shared a token, or a stage "
                                           "had lost it)", registry=r)
        self.prefix_cache_tokens_reused = Counter("skippy_prefix_cache_tokens_reused", "Prompt tokens whose KV came "
                                                  "from a resident prefix instead of a prefill", registry=r)
        self.sessions_moved = Counter("skippy_sessions_moved", "Live sessions' KV pages that left this stage "
                                      "(exported) or arrived (imported)", ["direction"], registry=r)
        self.handoffs = Counter("skippy_handoff_sessions", "Sessions of a draining downstream this stage handed to "
                                "its stand-in (moved) or could not (lost: the head re-prefills them)", ["outcome"],
                                registry=r).labels  # type: ignore[assignment]
        self.spec_drafted = Counter("skippy_spec_drafted_tokens", "Tokens the head drafted for speculative "
                                    "decoding (sent through the chain to be verified)", registry=r)
        self.spec_accepted = Counter("skippy_spec_accepted_tokens", "Drafted tokens the final stage's samples "
                                     "agreed with (kept)", registry=r)
        self.spec_stale = Counter("skippy_spec_stale_tokens", "Rows of speculative windows sent in flight that "
                                  "turned stale (a window before them was cut short): computed, not sampled",
                                  registry=r)
        self.session_forks = Counter("skippy_session_forks", "New sessions that started as a copy of a live "
                                     "session's KV (fork_of: n choices of one prompt)", registry=r)
        self.fork_tokens_copied = Counter("skippy_fork_tokens_copied", "Tokens whose KV a fork copied instead of "
                                          "computing them again", registry=r)
        # What a streaming client sees, measured where the text leaves (the head): the wait for the
        # first token's message, and the mean gap between a generation's messages after it.
        self.time_to_first_token = Histogram(
            "skippy_time_to_first_token_seconds", "Seconds from a generation's arrival at the head to its first "
            "text leaving for the client", buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "skippy_time_per_output_token_seconds", "Per generation, seconds from its first text leaving for the "
            "client to its end, over the tokens after the first message", buckets=_TPOT_BUCKETS, registry=r)
        self.image_encode_seconds = Histogram(
            "skippy_image_encode_seconds", "Seconds the head's projector took to encode one image of a prompt "
            "(libmtmd, before the image's rows enter the head's layers)", buckets=_LATENCY_BUCKETS, registry=r)
        self.session_recoveries = Counter("skippy_session_recoveries", "Sessions the head re-prefilled through the "
                                          "chain after a stage below failed", registry=r)
        self._gauges = {
            name: Gauge(f"skippy_{name}", doc, registry=r)
            for name, doc in (
                ("lanes_active", "Lanes bound to a session"),
                ("lanes_idle", "Reset lanes kept warm in the idle pool"),
                ("kv_cells_used", "KV cells held by sessions"),
                ("kv_cells_total", "KV cells in the pool admission counts against"),
                ("queue_depth", "Sessions waiting for admission at the head"),
                ("batches_in_flight", "Head: batches it keeps in flight now, from the measured step time and link "
                 "latency (at most max_inflight)"),
                ("resident_prefixes", "Finished sessions' KV kept as resident prefixes"),
                ("downstream_rtt_seconds", "Round trip to the downstream over its link: median of the last health "
                 "probes' answers (0 until one is answered)"),
                ("return_rtt_seconds", "Final stage: round trip to the head over the direct return's link, "
                 "measured the same way (0 until measured)"),
            )
        }
        self.info = Gauge("skippy_stage_info", "Identity of this stage", ["stage_id"], registry=r).labels(**s)
        self.info.set(1)

    def record(self, tally: Tally) -> None:
        """Add ``tally`` to the metrics and empty it (so recording it again adds nothing)."""
        for seconds in tally.latencies:
            self.hop_latency_seconds.observe(seconds)
        for seconds, entries, tokens, forks in tally.computes:
            self.compute_seconds.observe(seconds)
            self.batch_entries.observe(entries)
            self.batch_tokens.observe(tokens)
            if forks:
                self.session_forks.inc(len(forks))
                self.fork_tokens_copied.inc(sum(forks))
        for codec, n in tally.received:
            self._activation("received", codec).inc(n)
        for codec, n in tally.sent:
            self._activation("sent", codec).inc(n)
        if tally.frames_ok:
            self.requests(rpc="Frame", code="OK").inc(tally.frames_ok)
        for path in tally.returns:
            self.returns(path=path).inc()
        if tally.native:
            self.native_frames.inc(tally.native)
        tally.__init__()

    def before_scrape(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` before each scrape reads the metrics."""
        self._before_scrape.hooks.append(hook)

    def gauge_from(self, name: str, read: Callable[[], float]) -> None:
        """Read a gauge from its owner at scrape time."""
        self._gauges[name].set_function(read)

    def serve_http(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)
