"""``skippy-stage bench``: what a split costs, as ratios against the unsplit model, in one run.

Everything runs here, now, on the packaged SmolLM2: the single-process llama-cpp-python
baseline and real pipelines of ``serve`` processes on loopback, with the same thread
budget on both sides (all cores for the single process and for each stage: only the stage
holding the token computes). Single-stream decode runs in interleaved rounds, medians
reported. The numbers are reported, never asserted: machines are noisy, so only same-run
ratios mean anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import structlog

from skippy_stage.cli.client import generate
from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs, stage_environment
from skippy_stage.cli.settings import apply_settings
from skippy_stage.config import MAX_STREAM_INTERVAL_MS, SHARED_HOST_PLACES_ENV, StageConfig
from skippy_stage.errors import SkippyError
from skippy_stage.model import threadpool
from skippy_stage.model.packaged import smollm2_path
from skippy_stage.model.runtime import BatchEntry, StageRuntime
from skippy_stage.server import wake_latency
from skippy_stage.stage import native_frames, wire
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

# SKIPPY_BENCH_QUICK=1 shrinks every run (the test suite uses it to check the report's shape).
_QUICK = os.environ.get("SKIPPY_BENCH_QUICK") == "1"
DECODE_TOKENS = 16 if _QUICK else 128
AGG_TOKENS = 8 if _QUICK else 64
# Five rounds (medians): on a busy 2-vCPU host one round of a 3-stage decode can take 2x the next.
DECODE_ROUNDS = 1 if _QUICK else 5
PREFILL_TOKENS = 64 if _QUICK else 512
CONCURRENCY = (1, 4, 8)
# The 3-stage split every 3-stage figure runs.
THREE = [(0, 10), (10, 20), (20, 30)]
# ``bench --set``: applied to the stages of every pipeline a phase starts (see run).
SETTINGS: list[str] = []
# A 4-turn chat over a long system message: each turn's prompt holds every turn before it.
CHAT_SYSTEM = ("You are a careful assistant for a shipping company. " * (6 if _QUICK else 40)).strip()
CHAT_TURNS = ["Where is my parcel?", "It was sent on Monday from Berlin.", "How long does it usually take?",
              "Thank you, and can I change the address?"]
CHAT_TOKENS = 8 if _QUICK else 24
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
# Speculative decoding: a prompt whose answer quotes it (prompt lookup drafts well) and a free one.
SPEC_PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and watched "
                "the ships pass safely through the narrow strait. In winter the storms came early, and he kept the "
                "fire burning through the night, writing the names of the ships in a worn leather book. When the "
                "keeper grew old, his granddaughter took the lamp, and the book, and the stairs.")
SPEC_PROMPTS = {"repetitive": f"Repeat the following passage exactly.\n\nPassage: {SPEC_PASSAGE}\n\nRepeated passage:",
                "free_form": "Write a short story about a fox who learns to fly. Once upon a time,"}
SPEC_TOKENS = 24 if _QUICK else 96


def _long_prompt(runtime: StageRuntime, n_tokens: int) -> tuple[str, list[int]]:
    paragraph = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
                 "Over centuries, towers of stone replaced the fires, and lenses replaced the open flame. ")
    text = paragraph
    while len(runtime.tokenizer.tokenize(text)) < n_tokens:
        text += paragraph
    tokens = runtime.tokenizer.tokenize(text)[:n_tokens]
    return text, tokens


class SingleDecoder:
    """The unsplit model in this process (llama-cpp-python's Llama), kept loaded so its
    decode runs can be interleaved with the pipelines' runs."""

    def __init__(self, model: Path, threads: int) -> None:
        from skippy_stage.model.loader import reference_llama

        self.threads = threads
        self.llm = reference_llama(model, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.tokens = self.llm.tokenize(PROMPT.encode())

    def ms_per_token(self) -> float:
        return self.measure()[0]

    def measure(self) -> tuple[float, dict[str, float]]:
        """ms per token, and this process's CPU by thread over the same tokens (``thread_split``:
        its decoding threads are llama.cpp's; the rest is this bench's own, idle meanwhile)."""
        started = time.perf_counter()
        before: dict[int, tuple[int, int]] = {}
        n = 0
        for _ in self.llm.generate(self.tokens, temp=0.0, reset=True):
            n += 1
            if n == 1:
                before = thread_times(os.getpid())
                started = time.perf_counter()  # from the first sampled token: decode only
            if n == DECODE_TOKENS + 1:
                break
        ms = (time.perf_counter() - started) / DECODE_TOKENS * 1e3
        return ms, thread_split(_subtract(thread_times(os.getpid()), before), DECODE_TOKENS, self.threads)

    def close(self) -> None:
        self.llm.close()


def single_process(model: Path, threads: int, cache_dir: str) -> dict[str, object]:
    """The unsplit model in this process, batched through the low-level API: prefill and
    aggregate decode of several sequences."""
    cfg = StageConfig(model_path=str(model), stage_id="single", stage_index=0, layer_start=0, layer_end=30,
                      n_threads=threads, lane_count=8, ctx_size=8 * 2048, n_batch=512, n_ubatch=512, cache_dir=cache_dir)
    runtime = StageRuntime(cfg)
    _, long_tokens = _long_prompt(runtime, PREFILL_TOKENS)
    started = time.perf_counter()
    runtime.run_batch([BatchEntry("prefill", np.arange(PREFILL_TOKENS), token_ids=long_tokens, sample=True)])
    prefill_tps = PREFILL_TOKENS / (time.perf_counter() - started)
    runtime.drop_session("prefill")

    aggregate = {}
    prompt = runtime.tokenizer.tokenize(PROMPT)
    for c in CONCURRENCY:
        sessions = [f"s{i}" for i in range(c)]
        started = time.perf_counter()
        results = runtime.run_batch([BatchEntry(s, np.arange(len(prompt)), token_ids=prompt, sample=True)
                                     for s in sessions])
        last = {r.session_id: r.token for r in results}
        pos = len(prompt)
        for _ in range(AGG_TOKENS - 1):
            results = runtime.run_batch([BatchEntry(s, [pos], token_ids=[last[s]], sample=True) for s in sessions])
            last = {r.session_id: r.token for r in results}
            pos += 1
        aggregate[str(c)] = c * AGG_TOKENS / (time.perf_counter() - started)
        for s in sessions:
            runtime.drop_session(s)
    runtime.close()
    return {"prefill_tps": prefill_tps, "aggregate": aggregate}


def wake_latency_setting() -> int | None:
    """The ``cpu_wake_latency_us`` every bench stage holds: 0 (idle CPUs poll) where this process
    may ask the kernel, the host's own idle policy otherwise. The request is host-wide, so the
    single process, measured while pipelines are up, runs under it too.
    SKIPPY_BENCH_WAKE_LATENCY_US overrides: a number, or "host" to leave the host's policy."""
    override = os.environ.get("SKIPPY_BENCH_WAKE_LATENCY_US")
    if override:
        return None if override == "host" else int(override)
    return 0 if wake_latency.may_request() else None


def stage_threads(n_stages: int) -> int:
    """llama.cpp threads per local stage, as `up` gives them (all cores: only a busy stage
    spins); SKIPPY_BENCH_STAGE_THREADS overrides, e.g. 1 for cores/stages on 2 cores."""
    override = os.environ.get("SKIPPY_BENCH_STAGE_THREADS")
    return int(override) if override else (os.cpu_count() or 1)


class _Pipeline:
    def __init__(self, model: Path, ranges: list[tuple[int, int]], workdir: Path, cache_dir: str,
                 transport: str | None = None, return_path: str = "direct", prefix_cache: bool = False,
                 kv_unified: bool | None = None, native_frames: bool = True, extra: dict | None = None) -> None:
        """``prefix_cache`` off by default: the decode and prefill figures send the same prompt
        again and again, which resident prefixes would answer without a prefill."""
        threads = self.threads = stage_threads(len(ranges))
        ports = free_ports("127.0.0.1", 2 * len(ranges))
        ports, self.metrics_ports = ports[: len(ranges)], ports[len(ranges) :]
        configs = pipeline_configs(str(model), ranges, host="127.0.0.1", ports=ports, extra={
            "n_threads": threads, "lane_count": 8, "ctx_size": 8 * 2048, "max_inflight": 1, "cache_dir": cache_dir,
            **({"hop_transport": transport} if transport else {}),
            **({} if prefix_cache else {"cache_idle_slots": 0}),
            **({} if kv_unified is None else {"kv_unified": kv_unified}),
            "cpu_wake_latency_us": wake_latency_setting(), "native_frames": native_frames, **(extra or {}),
        }, return_path=return_path)
        configs = apply_settings(configs, SETTINGS)
        for cfg, port in zip(configs, self.metrics_ports):
            cfg["metrics_port"] = port
        self.local = LocalPipeline(configs, workdir)
        self.local.wait_serving(300)
        self.endpoint = self.local.head_endpoint

    def generate(self, prompt: str, max_tokens: int) -> dict[str, float]:
        return generate(self.endpoint, prompt, max_tokens=max_tokens, temperature=0.0, seed=None, chat=False,
                         out=io.StringIO())

    def stop(self) -> None:
        self.local.stop()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until a one-token generation goes through: a pipeline just resumed (``_awake``) has
        stages whose health probes of their neighbours lapsed while it was stopped."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.generate(PROMPT, 1)
                return
            except SkippyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def chat_ttft(self, turns: list[str], max_tokens: int) -> list[float]:
        """Seconds to the first piece of text of each turn of one conversation (gRPC Generate)."""
        messages: list[pb.ChatMessage] = [pb.ChatMessage(role="system", content=CHAT_SYSTEM)]
        ttft = []
        with grpc.insecure_channel(self.endpoint) as channel:
            stub = pb_grpc.StageServiceStub(channel)
            for question in turns:
                messages.append(pb.ChatMessage(role="user", content=question))
                request = pb.GenerateRequest(max_tokens=max_tokens, messages=messages,
                                             sampling=pb.SamplingParams(temperature=0.0))
                started, first, reply = time.perf_counter(), None, []
                for msg in stub.Generate(request, timeout=300):
                    if msg.text:
                        first = first or time.perf_counter() - started
                        reply.append(msg.text)
                ttft.append(first if first is not None else time.perf_counter() - started)
                messages.append(pb.ChatMessage(role="assistant", content="".join(reply)))
        return ttft


class _Echo(pb_grpc.StageServiceServicer):
    """Answers every frame at once: what one hop costs with no stage work at all."""

    def ActivationStream(self, request_iterator, context):  # noqa: N802
        for hop in request_iterator:
            yield pb.HopReply(hop_id=hop.hop_id)


def _echo_server(port: int, socket_port: int, frame_port: int, ready) -> None:
    import socket
    from concurrent import futures

    import grpc

    from skippy_stage.stage import framing

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = _Echo()
    pb_grpc.add_StageServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    listener = socket.create_server(("127.0.0.1", socket_port))
    frames = socket.create_server(("127.0.0.1", frame_port))

    def framed() -> None:
        conn, _ = frames.accept()
        framing.tune(conn)
        link = framing.FrameSocket(conn, max_message_bytes=1 << 20)
        link.receive()
        link.send(framing.Kind.WELCOME, pb.FrameWelcome())
        try:
            while True:
                kind, body = link.receive()
                hop = framing.parse(kind, body, framing.Kind.HOP_REQUEST)
                link.send(framing.Kind.HOP_REPLY, pb.HopReply(hop_id=hop.hop_id))
        except framing.LinkClosed:
            pass
    threading.Thread(target=framed, daemon=True).start()
    ready.set()
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        if data.endswith(b"\n"):
            conn.sendall(b"k")
    server.stop(0)


def _round_trips_us(send, wait, rounds: int) -> float:
    for i in range(rounds // 10):
        send(i)
        wait()
    started = time.perf_counter()
    for i in range(rounds):
        send(i)
        wait()
    return (time.perf_counter() - started) / rounds * 1e6


def hop_floor_us(rounds: int = 2000) -> dict[str, float]:
    """Round trips of one f32 SmolLM2 frame (2304 bytes) to another process on loopback, with
    nothing running a model: over the gRPC ActivationStream (this project's StreamHop), over
    this project's TCP frame transport (``framing``: length-prefixed HopRequest/HopReply),
    and over a bare TCP socket (the floor of any transport here)."""
    import multiprocessing
    import queue as queue_mod
    import socket

    import grpc

    from skippy_stage.config import PeerConfig
    from skippy_stage.security import Credentials
    from skippy_stage.stage import codec, framing
    from skippy_stage.stage.hops import StreamHop
    from skippy_stage.stage.steps import Activations, Frame, Step

    port, socket_port, frame_port = free_ports("127.0.0.1", 3)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_echo_server, args=(port, socket_port, frame_port, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the echo server did not start")
        payload = b"\0" * wire.payload_size("f32", 1, 576)
        desc = wire.make_descriptor(dtype="f32", producer_stage_index=0, layer_start=0, layer_end=10, token_count=1,
                                    sequence_count=1, width=576)
        step = Step(request_id="", entries=[], frame=Activations(desc, payload))
        replies: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            hop = StreamHop(PeerConfig("echo", 1, f"127.0.0.1:{port}"), pb_grpc.StageServiceStub(channel), (),
                            translate=lambda err: err, on_reply=replies.put, on_broken=lambda err: None)
            grpc_us = _round_trips_us(lambda i: hop.send(Frame(step, hop_id=i)),
                                      lambda: replies.get(timeout=10), rounds)
            hop.close()
        link = framing.dial("127.0.0.1", frame_port, creds=Credentials(), purpose=pb.FrameHello.PURPOSE_HOP,
                            stage_id="bench", max_message_bytes=1 << 20, timeout_s=10)
        frame_us = _round_trips_us(lambda i: link.send(framing.Kind.HOP_REQUEST, codec.frame_to_pb(Frame(step, hop_id=i))),
                                   link.receive, rounds)
        link.close()
        sock = socket.create_connection(("127.0.0.1", socket_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frame = payload[:-1] + b"\n"
        socket_us = _round_trips_us(lambda i: sock.sendall(frame), lambda: sock.recv(1), rounds)
        sock.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"grpc_stream_round_trip_us": grpc_us, "tcp_frame_round_trip_us": frame_us,
            "tcp_socket_round_trip_us": socket_us}


def _wake_receiver(port: int, ready, result) -> None:
    import socket
    import statistics

    listener = socket.create_server(("127.0.0.1", port))
    ready.set()
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    late = []
    while len(data := conn.recv(8)) == 8:
        late.append(time.time_ns() - int.from_bytes(data, "little"))
    result.put(statistics.median(late) / 1e3)


def wake_floor_us(sends: int = 400, busy_s: float = 0.003) -> dict[str, float]:
    """One-way latency of a send to a process that sleeps in ``recv`` while the sender computes
    (``busy_s`` of spinning between sends, as a stage's decode): what a hop pays to wake the
    next stage's CPU, under the host's idle policy and, where this process may ask, with idle
    CPUs held to 0 us (``cpu_wake_latency_us: 0``)."""
    import multiprocessing
    import socket

    def one() -> float:
        port = free_ports("127.0.0.1", 1)[0]
        ctx = multiprocessing.get_context("spawn")
        ready, result = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_wake_receiver, args=(port, ready, result), daemon=True)
        proc.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the wake receiver did not start")
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(sends):
                    until = time.perf_counter() + busy_s
                    while time.perf_counter() < until:
                        pass
                    sock.sendall(time.time_ns().to_bytes(8, "little"))
            return result.get(timeout=60)
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    out = {"host_policy": one()}
    if wake_latency.may_request():
        request = wake_latency.WakeLatencyRequest(0, stage_id="bench")
        try:
            out["held_0_us"] = one()
        finally:
            request.close()
    return out


THREAD_KEYS = ("decoding", "other", "decoding_wait")
T = TypeVar("T")


def thread_times(pid: int) -> dict[int, tuple[int, int]]:
    """Every thread of ``pid``: (ns on a CPU, ns runnable but waiting for one), from schedstat."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[int(task.name)] = (cpu, wait)
    return out


def thread_split(delta: dict[int, tuple[int, int]], n_tokens: int, decoding: int) -> dict[str, float]:
    """us per token of one process's CPU (``delta``: each thread's ns on a CPU and ns waiting for
    one): its ``decoding`` busiest threads (the decode's OpenMP team, the thread that calls
    llama_decode included: its Python between decodes counts here), the rest of its threads (gRPC,
    the stream, listeners, timers), and how long the decoding threads were runnable but waited
    for a core (preempted, or woken onto a busy one). A difference of two runs' counts can come
    out below 0 for a thread that happened to do more in the shorter run (a timer, a probe):
    counted as 0, as a thread cannot spend less than nothing."""
    rows = sorted(((max(cpu, 0), max(wait, 0)) for cpu, wait in delta.values()), reverse=True)
    per = 1e-3 / n_tokens
    return {"decoding": sum(r[0] for r in rows[:decoding]) * per, "other": sum(r[0] for r in rows[decoding:]) * per,
            "decoding_wait": sum(r[1] for r in rows[:decoding]) * per}


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("skippy_") and " " in line:
            name, _, number = line.rpartition(" ")
            values[name] = float(number)
    return values


_KINDS = ("compute", "forward_hop", "hop_latency")


def _histogram_sums(port: int) -> dict[str, object]:
    """(sum, count) of the compute, forward-hop and hop-latency histograms of one stage, and
    the hop-latency bucket counts (for a median)."""
    values = _scrape(port)
    out: dict[str, object] = {
        kind: (values.get(f"skippy_{kind}_seconds_sum", 0.0), values.get(f"skippy_{kind}_seconds_count", 0.0))
        for kind in _KINDS
    }
    prefix = 'skippy_hop_latency_seconds_bucket{le="'
    out["hop_latency_buckets"] = sorted(
        (float(name[len(prefix):-2]), count) for name, count in values.items() if name.startswith(prefix))
    return out


def _mean_delta(before: dict, after: dict, kind: str) -> float:
    (s1, c1), (s0, c0) = after[kind], before[kind]
    return (s1 - s0) / (c1 - c0) if c1 > c0 else 0.0


def hop_overheads_us(before: list[dict], after: list[dict]) -> list[float]:
    """What one leg costs, from the stages' own histograms: the head's wait for a step's
    outputs minus what the stages below spent computing, over the legs a token travels
    (one per stage: down every edge, then back to the head).

    What is left is the transport's own cost: serialisation, the network stack, thread
    hand-offs and scheduling.
    """
    n = len(after)
    waited = _mean_delta(before[0], after[0], "forward_hop")
    below = sum(_mean_delta(before[k], after[k], "compute") for k in range(1, n))
    return [(waited - below) / n * 1e6]


def hop_latency_median_us(before: list[dict], after: list[dict]) -> float:
    """Median of "frame handed to the transport -> compute starts at the next stage" over every
    stage below the head in one run, interpolated within the histogram's buckets."""
    total: dict[float, float] = {}
    for b, a in zip(before[1:], after[1:]):
        for (le, c1), (_, c0) in zip(a["hop_latency_buckets"], b["hop_latency_buckets"]):
            total[le] = total.get(le, 0.0) + c1 - c0
    buckets = sorted(total.items())
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    half = buckets[-1][1] / 2
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= half:
            if le == float("inf"):
                return lower_le * 1e6
            span = count - lower_count
            return (lower_le + (le - lower_le) * ((half - lower_count) / span if span else 0.0)) * 1e6
        lower_le, lower_count = le, count
    return lower_le * 1e6


class _StopAtFirstText(io.StringIO):
    """A client's text sink that stops its process (SIGSTOP) when the first text arrives: the
    rest of the stream waits in the socket until the bench resumes it (``QuietClient.held``)."""

    def __init__(self) -> None:
        super().__init__()
        self._stopped = False

    def write(self, text: str) -> int:
        if not self._stopped:
            self._stopped = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().write(text)


def quiet_client_loop() -> None:
    """The quiet client's process: lowest CPU priority, then one Generate call per JSON line
    read (endpoint, prompt, max_tokens, stream_interval_ms, hold), each answered by a JSON line
    (ok, figures or error). ``hold``: the process stops itself at the first text (``_StopAtFirstText``)."""
    os.nice(19)
    replies, sys.stdout = sys.stdout, sys.stderr  # nothing but replies on the pipe
    for line in sys.stdin:
        endpoint, prompt, max_tokens, interval_ms, hold = json.loads(line)
        try:
            answer = [True, generate(endpoint, prompt, max_tokens=max_tokens, temperature=0.0, seed=None,
                                     chat=False, out=_StopAtFirstText() if hold else io.StringIO(),
                                     stream_interval_ms=interval_ms)]
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises it
            answer = [False, f"{type(exc).__name__}: {exc}"]
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


class HeadProbe:
    """What the bench reads of a pipeline's head while a held client waits: its time per output
    token histogram (sum, count) and whether it has gone idle."""

    # The head at rest wakes for gRPC's timers and health probes only: well under this much CPU
    # per poll interval; while it serves a token stream it spends far more.
    IDLE_CPU_S = 0.003
    POLL_S = 0.05

    def __init__(self, endpoint: str, pid: int, metrics_port: int) -> None:
        self.endpoint, self.pid, self.metrics_port = endpoint, pid, metrics_port

    def tpot(self) -> tuple[float, float]:
        values = _scrape(self.metrics_port)
        return (values.get("skippy_time_per_output_token_seconds_sum", 0.0),
                values.get("skippy_time_per_output_token_seconds_count", 0.0))

    def _cpu_s(self) -> float:
        return sum(cpu for cpu, _ in thread_times(self.pid).values()) / 1e9

    def wait_for_generation_end(self, before: tuple[float, float], timeout_s: float = 300.0) -> None:
        """Until the head has observed one more generation's time per output token. Its metrics
        are read only once it has gone quiet (a scrape costs the head CPU); its CPU time is read
        from /proc meanwhile."""
        deadline = time.monotonic() + timeout_s
        last = self._cpu_s()
        while time.monotonic() < deadline:
            time.sleep(self.POLL_S)
            now = self._cpu_s()
            quiet, last = now - last < self.IDLE_CPU_S, now
            if quiet and self.tpot()[1] > before[1]:
                return
        raise RuntimeError(f"the head did not finish the bench's generation within {timeout_s:.0f} s")


class QuietClient:
    """The single-stream decode figures' Generate client, in a process of its own at nice 19.

    A client is usually on another host. On this one it shares the stages' cores, and its work
    for every streamed token (gRPC's receive, Python's loop) preempts whichever stage is decoding
    at that moment, which the unsplit model, measured with no client at all, never pays. At the
    lowest priority it runs when a core would otherwise idle; its figures can only come out
    later, never earlier. bench measures the difference too (``client_priority_2_stage``).
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from skippy_stage.cli.bench import quiet_client_loop; quiet_client_loop()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def generate(self, endpoint: str, prompt: str, max_tokens: int,
                 stream_interval_ms: int | None = None) -> dict[str, float]:
        self._proc.stdin.write(json.dumps([endpoint, prompt, max_tokens, stream_interval_ms, False]) + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def held(self, head: HeadProbe, prompt: str, max_tokens: int) -> dict[str, float]:
        """A streamed generation whose client reads nothing between its first text and the end:
        the client's process is stopped meanwhile, the messages wait in its socket, and the head's
        own figure (``skippy_time_per_output_token_seconds``) gives the decode speed — as with a
        client on another host, whose CPU is not the stages'. The head's stream is unchanged: it
        still hands gRPC one message per token."""
        before = head.tpot()
        self._proc.stdin.write(json.dumps([head.endpoint, prompt, max_tokens, None, max_tokens > 1]) + "\n")
        self._proc.stdin.flush()
        if max_tokens > 1 and self._stopped_or_replied():
            head.wait_for_generation_end(before)
            self._proc.send_signal(signal.SIGCONT)
        figures = self._reply()
        if max_tokens > 1:
            seconds, count = head.tpot()
            if count <= before[1]:
                raise RuntimeError("the head observed no time per output token for the bench's generation")
            figures["tokens_per_s"] = (count - before[1]) / (seconds - before[0])
        return figures

    def _stopped_or_replied(self) -> bool:
        """Wait until the client has stopped itself (True) or answered without stopping (False:
        the generation ended or failed before any text)."""
        while True:
            if select.select([self._proc.stdout], [], [], 0.005)[0]:
                return False
            try:
                state = Path(f"/proc/{self._proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
            except FileNotFoundError:
                return False
            if state in ("T", "t"):
                return True

    def _reply(self) -> dict[str, float]:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bench's client exited (code {self._proc.wait()})")
        ok, figures = json.loads(line)
        if not ok:
            raise RuntimeError(f"the bench's client failed: {figures}")
        return figures

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


class _HeldClient:
    """``QuietClient.held`` on one pipeline, called as ``QuietClient.generate`` is (a stream, never
    a stream interval)."""

    def __init__(self, quiet: QuietClient, pipeline: _Pipeline) -> None:
        self._quiet = quiet
        self._head = HeadProbe(pipeline.endpoint, pipeline.local.procs[0].pid, pipeline.metrics_ports[0])

    def generate(self, endpoint: str, prompt: str, max_tokens: int,
                 stream_interval_ms: int | None = None) -> dict[str, float]:
        if stream_interval_ms is not None:
            raise ValueError("a held client reads a stream of one message per token")
        return self._quiet.held(self._head, prompt, max_tokens)


def after_freeze(measure: Callable[[], T], attempts: int = 3) -> T:
    """``measure()``, again (after a pause) when it failed because a stage was not ready. A stage
    frozen by ``_awake`` mid health probe finds the probe lapsed once it runs again and reports
    NOT_SERVING until its next probe (then the stage above it does the same for one round): a
    generation a moment after the resume can hit that, even after ``wait_ready`` saw one succeed."""
    for _ in range(attempts - 1):
        try:
            return measure()
        except (RuntimeError, SkippyError) as exc:
            if "is not ready" not in str(exc):
                raise
            time.sleep(1.5)  # past the lapsed probe's round and the next one above it
    return measure()


def _decode_ms(pipeline: _Pipeline, client: QuietClient | None = None,
               whole: bool = False) -> tuple[float, list[float], list[float], list[float], float, list[dict]]:
    """Single-stream ms/token, each stage's CPU ms per token over the same run, the hop
    overhead from the stages' histograms, each stage's compute ms per batch, the median hop
    latency (send -> compute starts at the next stage), and each stage's CPU by thread
    (``thread_split``). ``whole``: the client asks for the whole completion rather than a stream
    (``stream_interval_ms`` at its most: the first token at once, the rest about once a second
    and with the end).

    Every per-token figure is of the decode steps alone, as the single process's are: what a
    one-token generation of the same prompt cost (its prefill, the session's set-up and end) is
    taken off the whole run's counters. Before, one ~18-token prefill in 129 steps added ~0.2 ms
    to each stage's mean compute and ~1 ms to its CPU per token.

    A stage computes about a third of the model per token; CPU far above that means its
    threads spin while it waits, stealing cores from the stage that has work.
    """
    if client is None:
        run = pipeline.generate
    else:
        run = partial(client.generate, pipeline.endpoint, stream_interval_ms=MAX_STREAM_INTERVAL_MS if whole else None)
    run(PROMPT, 8)  # warm the path
    pids = [p.pid for p in pipeline.local.procs]

    def snapshot() -> tuple[list[dict], list[dict]]:
        return [thread_times(pid) for pid in pids], [_histogram_sums(p) for p in pipeline.metrics_ports]

    prompt_before = snapshot()
    run(PROMPT, 1)
    prompt_after = snapshot()
    full_before = snapshot()
    figures = run(PROMPT, DECODE_TOKENS + 1)
    full_after = snapshot()
    n = figures["completion_tokens"] - 1  # decode steps: the first token comes with the prefill
    threads = [thread_split(_subtract(_subtract(fa, fb), _subtract(pa, pb)), n, pipeline.threads)
               for fb, fa, pb, pa in zip(full_before[0], full_after[0], prompt_before[0], prompt_after[0])]
    cpu = [(t["decoding"] + t["other"]) / 1e3 for t in threads]
    # The decode steps' histogram counts: the whole run's after the prompt-only run's are taken off.
    hist_before = [_shifted(fb, pb, pa) for fb, pb, pa in zip(full_before[1], prompt_before[1], prompt_after[1])]
    hist_after = full_after[1]
    compute = [_mean_delta(b, a, "compute") * 1e3 for b, a in zip(hist_before, hist_after)]
    return (1e3 / figures["tokens_per_s"], cpu, hop_overheads_us(hist_before, hist_after), compute,
            hop_latency_median_us(hist_before, hist_after), threads)


def _subtract(total: dict[int, tuple[int, int]], part: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Per thread, ``total`` minus ``part`` (a thread ``part`` lacks counts from 0): a later
    ``thread_times`` reading minus an earlier one, or one run's counts minus another's."""
    return {tid: (t[0] - part.get(tid, (0, 0))[0], t[1] - part.get(tid, (0, 0))[1]) for tid, t in total.items()}


def _shifted(before: dict, part_before: dict, part_after: dict) -> dict:
    """``before`` moved on by what happened between ``part_before`` and ``part_after``: taken
    off a later reading, it leaves what happened since ``before`` except that part."""
    out: dict[str, object] = {kind: tuple(b + pa - pb for b, pb, pa in zip(before[kind], part_before[kind], part_after[kind]))
                              for kind in _KINDS}
    out["hop_latency_buckets"] = [(le, c + pa - pb) for (le, c), (_, pb), (_, pa)
                                  in zip(before["hop_latency_buckets"], part_before["hop_latency_buckets"],
                                         part_after["hop_latency_buckets"])]
    return out


def _aggregate(pipeline: _Pipeline, concurrency: int) -> float:
    results: list[dict[str, float]] = []
    lock = threading.Lock()

    def one() -> None:
        figures = pipeline.generate(PROMPT, AGG_TOKENS)
        with lock:
            results.append(figures)

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return sum(r["completion_tokens"] for r in results) / elapsed


def run(json_path: str | None = None, settings: Sequence[str] = ()) -> dict[str, object]:
    """Every phase, with ``settings`` (``--set``) applied to the stages of every pipeline it starts
    (the unsplit references stay as they are)."""
    SETTINGS[:] = settings
    # A wrong name or value, refused before anything runs.
    apply_settings(pipeline_configs("model.gguf", THREE, host="127.0.0.1", ports=[1, 2, 3], extra={}), settings)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    model = smollm2_path()
    cores = os.cpu_count() or 1
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="skippy-bench-") as tmp:
        cache_dir = str(Path(tmp) / "slices")
        decode = _interleaved_decode(model, Path(tmp), cache_dir, cores, HEADLINE_CONTENDERS, whole=("2", "3"))
        compared = _interleaved_decode(model, Path(tmp), cache_dir, cores, COMPARISON_CONTENDERS)
        streamed = _interleaved_decode(model, Path(tmp), cache_dir, cores, STREAM_CONTENDERS)
        report["stream_interval_2_stage"] = {"interval_ms": STREAM_INTERVAL_MS,
                                             "each_token_ms_per_token": streamed["2-each"]["ms"],
                                             "interval_ms_per_token": streamed["2-interval"]["ms"],
                                             "single_process_ms_per_token": streamed["single"]["ms"]}
        report["client_priority_2_stage"] = {"quiet_ms_per_token": streamed["2-each"]["ms"],
                                             "local_ms_per_token": streamed["2-local"]["ms"],
                                             "held_ms_per_token": streamed["2-held"]["ms"],
                                             "single_process_ms_per_token": streamed["single"]["ms"]}
        report["single_process_ms_per_token"] = decode["single"]["ms"]
        pipelines_ms = {n: decode[n]["ms"] for n in ("2", "3")}
        stage_cpu = {n: decode[n]["cpu"] for n in ("2", "3")}
        hops = {"2": decode["2"]["hops"], "3": decode["3"]["hops"]}
        # The stages below the head with their plain frames in C (the default) and all in Python.
        report["frame_path_comparison_3_stage"] = {"native_ms_per_token": compared["3-tcp"]["ms"],
                                                   "python_ms_per_token": compared["3-python"]["ms"]}
        report["native_frames"] = native_frames.available() == ""
        report["return_path_comparison_3_stage"] = {"relay_ms_per_token": compared["3-relay"]["ms"],
                                                    "direct_ms_per_token": compared["3-tcp"]["ms"]}
        report["decode_rounds"] = {**{name: d["runs"] for name, d in decode.items()},
                                   **{f"{name} (comparison phase)": d["runs"] for name, d in compared.items()}}
        (Path(tmp) / "aggregate").mkdir()
        pipeline = _Pipeline(model, THREE, Path(tmp) / "aggregate", cache_dir)
        # Batched decode and prefill, the single process and the pipeline alternating in rounds
        # (medians), so a noisy moment of the host hits both alike.
        single_runs: list[dict] = []
        pipeline_runs: list[dict] = []
        try:
            runtime_text = _prefill_prompt(model, cache_dir)
            pipeline.generate(runtime_text, 1)  # warm
            for _ in range(DECODE_ROUNDS):
                single_runs.append(single_process(model, cores, cache_dir))
                figures = pipeline.generate(runtime_text, 1)
                pipeline_runs.append({"prefill_tps": PREFILL_TOKENS / figures["ttft_s"],
                                      "aggregate": {str(c): _aggregate(pipeline, c) for c in CONCURRENCY}})
        finally:
            pipeline.stop()

        def median(runs: list[dict], key: str, sub: str | None = None) -> float:
            return float(np.median([r[key][sub] if sub else r[key] for r in runs]))
        prefill: dict[str, float] = {"single_process": median(single_runs, "prefill_tps"),
                                     "pipeline": median(pipeline_runs, "prefill_tps")}
        aggregate: dict[str, dict[str, float]] = {
            name: {str(c): median(runs, "aggregate", str(c)) for c in CONCURRENCY}
            for name, runs in (("single_process", single_runs), ("pipeline", pipeline_runs))}
        report["chat_ttft_s"] = _chat_ttft(model, Path(tmp), cache_dir)
        report["speculative"] = _speculative(model, Path(tmp), cache_dir)
        report["repack"] = _repack(Path(tmp), cache_dir, cores)
        report["hop_floor_us"] = hop_floor_us(200 if _QUICK else 2000)
        report["wake_floor_us"] = wake_floor_us(100 if _QUICK else 400)
        report["cpu_wake_latency_us"] = wake_latency_setting()
        report["transport_floor_us"] = {"grpc_stream": report["hop_floor_us"]["grpc_stream_round_trip_us"],
                                        "tcp_frame": report["hop_floor_us"]["tcp_frame_round_trip_us"],
                                        "tcp_socket": report["hop_floor_us"]["tcp_socket_round_trip_us"]}
        single_ms = compared["single"]["ms"]  # the phase's own unsplit runs
        report["transport_comparison_3_stage"] = {
            transport: {"ms_per_token": compared[name]["ms"],
                        "per_hop_overhead_us": (compared[name]["ms"] - single_ms) / 3 * 1e3,
                        "hop_latency_us": compared[name]["hop_latency"]}
            for transport, name in (("tcp", "3-tcp"), ("stream", "3-stream"))
        }
        report["hop_transport_default"] = StageConfig.__dataclass_fields__["hop_transport"].default
        # Median "frame handed to the transport -> compute starts at the next stage", from the
        # stages' own histograms, over the default 3-stage pipeline's decode runs.
        report["hop_latency_us"] = decode["3"]["hop_latency"]
        report["pipeline_ms_per_token"] = pipelines_ms
        # The same pipelines, the client asking for the whole completion (no message per token).
        report["whole_completion_ms_per_token"] = {n: decode[f"{n}-whole"]["ms"] for n in ("2", "3")}
        report["one_stage_ms_per_token"] = decode["1"]["ms"]
        report["stage_cpu_ms_per_token"] = stage_cpu
        # Where a token's CPU goes: each process's decoding threads and the rest (thread_split), the
        # single process's next to the 1-, 2- and 3-stage pipelines'. On a host whose cores are busy
        # for the whole token, CPU beyond the single process's is what the split costs.
        report["token_cpu_us_by_thread"] = {n: decode[n]["threads"] for n in ("single", "1", "2", "3")}
        # What a token pays per hop, as the client sees it: the 3-stage decode's excess over the
        # single process, over the 3 legs a token travels (head -> 1 -> 2 -> head, direct return).
        report["per_hop_overhead_us"] = (pipelines_ms["3"] - report["single_process_ms_per_token"]) / 3 * 1e3
        # From the stages' own histograms: the head's wait for a step's outputs minus the compute
        # of the stages below, per leg (2 and 3 stages averaged).
        all_hops = [h for n in hops.values() for h in n]
        report["per_hop_overhead_us_histograms"] = sum(all_hops) / len(all_hops)
        report["per_hop_overhead_us_by_hop"] = hops
        # Split cost = hidden-state capture + compute inflation + hops: the stages' own compute
        # per token, summed, next to the single process's whole ms/token.
        report["stage_compute_ms_per_token"] = {n: sum(decode[n]["compute"]) for n in ("2", "3")}
        report["stage_compute_ms_by_stage"] = {n: decode[n]["compute"] for n in ("2", "3")}
        # Stages sharing this host sleep their OpenMP workers soon after a decode; the single
        # process runs as llama-cpp-python does (an operator's GOMP_SPINCOUNT applies to both).
        report["openmp_spincount"] = {"stages": stage_environment()["GOMP_SPINCOUNT"],
                                      "single_process": os.environ.get("GOMP_SPINCOUNT", "libgomp default")}
        report["openmp_wait_policy"] = {"stages": stage_environment().get("OMP_WAIT_POLICY", "libgomp default"),
                                        "single_process": os.environ.get("OMP_WAIT_POLICY", "libgomp default")}
        report["openmp_proc_bind"] = {"stages": stage_environment().get("OMP_PROC_BIND", "libgomp default"),
                                      "single_process": os.environ.get("OMP_PROC_BIND", "libgomp default")}
        # Whether each stage's binding starts at its own core (stage_index mod the cores).
        report["openmp_places_by_stage"] = stage_environment().get(SHARED_HOST_PLACES_ENV) == "1"
        report["hidden_state_capture"] = _capture_kind()
        # What runs the CPU graphs: OpenMP, or (a build without it) ggml's own pool, polling as set.
        report["cpu_threads"] = "openmp" if threadpool.openmp_build() else {
            "stages": f"ggml pool, poll {threadpool.poll_level(stage_environment())}",
            "single_process": f"ggml pool, poll {threadpool.poll_level(os.environ)}"}
        # The whole cost of splitting, per extra stage, as seen by a client.
        report["split_cost_us_per_extra_stage"] = (pipelines_ms["3"] - report["single_process_ms_per_token"]) / 2 * 1e3
        report["aggregate_tokens_per_s"] = aggregate
        report["prefill_tokens_per_s"] = prefill
        report["wire_bytes_per_token"] = {d: wire.payload_size(d, 1, 576) for d in wire.DTYPES}
        report["ratios"] = {
            "decode_2_stage": report["single_process_ms_per_token"] / pipelines_ms["2"],
            "decode_3_stage": report["single_process_ms_per_token"] / pipelines_ms["3"],
            # The stack unsplit against the single process, and each split against the stack unsplit.
            "decode_1_stage": report["single_process_ms_per_token"] / decode["1"]["ms"],
            "decode_2_stage_whole_completion": report["single_process_ms_per_token"] / decode["2-whole"]["ms"],
            "decode_3_stage_whole_completion": report["single_process_ms_per_token"] / decode["3-whole"]["ms"],
            "decode_2_stage_vs_1_stage": decode["1"]["ms"] / pipelines_ms["2"],
            "decode_3_stage_vs_1_stage": decode["1"]["ms"] / pipelines_ms["3"],
            "aggregate_8_vs_single_batched_8": aggregate["pipeline"]["8"] / aggregate["single_process"]["8"],
            "aggregate_8_vs_pipeline_1": aggregate["pipeline"]["8"] / aggregate["pipeline"]["1"],
            "prefill_512": prefill["pipeline"] / prefill["single_process"],
            "chat_turn4_ttft_without_vs_with_prefix_cache": (report["chat_ttft_s"]["without_prefix_cache"][-1]
                                                             / report["chat_ttft_s"]["with_prefix_cache"][-1]),
            **{f"speculative_{name}_tokens_per_s_ngram_vs_none": figures["speedup"]
               for name, figures in report["speculative"].items()},
        }
        report["conditions"] = {"cores": cores, "model": model.name, "decode_tokens": DECODE_TOKENS,
                                "aggregate_tokens_per_session": AGG_TOKENS, "prefill_tokens": PREFILL_TOKENS,
                                "pipeline_threads_per_stage": {"2": stage_threads(2), "3": stage_threads(3)},
                                "single_process_threads": cores}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def _speculative(model: Path, workdir: Path, cache_dir: str) -> dict[str, dict[str, object]]:
    """3 stages, greedy, one stream: each prompt without speculation and with the ngram drafter
    (``k: "auto"``, adaptive drafting: the speed setting; a number k drafts as the reference does, every
    step up to k rows, which on a CPU can cost more than it saves), interleaved in rounds (medians). ``tokens_per_trip``: decoded tokens
    per decode step through the chain (the head's batches, from its metrics); ``ms_per_token``:
    after the first token."""
    (workdir / "speculative").mkdir()
    pipeline = _Pipeline(model, THREE, workdir / "speculative", cache_dir, kv_unified=False)
    head_metrics = pipeline.metrics_ports[0]

    def one(prompt: str, drafter: str) -> tuple[float, float, float]:
        before = _scrape(head_metrics)
        figures = generate(pipeline.endpoint, prompt, max_tokens=SPEC_TOKENS, temperature=0.0, seed=None, chat=False,
                           out=io.StringIO(), speculative={"drafter": drafter, "k": "auto"})
        after = _scrape(head_metrics)
        steps, rows = (after.get(name, 0.0) - before.get(name, 0.0)
                       for name in ("skippy_batch_entries_count", "skippy_batch_tokens_sum"))
        n = figures["completion_tokens"]
        ms = (figures["seconds"] - figures["ttft_s"]) / max(n - 1, 1) * 1e3
        # the first step is the prompt's prefill: its rows are the prompt's tokens
        prompt_rows = figures["prompt_tokens"]
        decode_steps = max(steps - 1, 1)
        return ms, (n - 1) / decode_steps, (rows - prompt_rows) / decode_steps

    out: dict[str, dict[str, object]] = {}
    try:
        for name, prompt in SPEC_PROMPTS.items():
            one(prompt, "ngram")  # warm
            runs: dict[str, list[tuple[float, float, float]]] = {"none": [], "ngram": []}
            for _ in range(DECODE_ROUNDS):
                for drafter in runs:
                    runs[drafter].append(one(prompt, drafter))
            figures = {drafter: {"ms_per_token": float(np.median([r[0] for r in rs])),
                                 "tokens_per_trip": float(np.median([r[1] for r in rs])),
                                 "rows_per_trip": float(np.median([r[2] for r in rs])),
                                 "ms_per_trip": float(np.median([r[0] * r[1] for r in rs]))}
                       for drafter, rs in runs.items()}
            # What bounds the speed-up: tokens per trip over what a trip of that many rows costs
            # (every drafted row runs every layer and the output head: on a CPU nearly linear).
            out[name] = {**figures, "speedup": figures["none"]["ms_per_token"] / figures["ngram"]["ms_per_token"],
                         "trip_cost_ratio": figures["ngram"]["ms_per_trip"] / figures["none"]["ms_per_trip"]}
    finally:
        pipeline.stop()
    return out


def _chat_ttft(model: Path, workdir: Path, cache_dir: str) -> dict[str, list[float]]:
    """The same 4-turn chat on 3 stages with resident prefixes and without: time to first token
    per turn (median of the rounds)."""
    out: dict[str, list[list[float]]] = {"with_prefix_cache": [], "without_prefix_cache": []}
    for name, enabled in (("with_prefix_cache", True), ("without_prefix_cache", False)):
        (workdir / f"chat-{name}").mkdir()
        pipeline = _Pipeline(model, THREE, workdir / f"chat-{name}", cache_dir,
                             prefix_cache=enabled, kv_unified=False)
        try:
            pipeline.chat_ttft(["Hello."], 1)  # warm
            for _ in range(DECODE_ROUNDS):
                out[name].append(pipeline.chat_ttft(CHAT_TURNS, CHAT_TOKENS))
        finally:
            pipeline.stop()
    return {name: [float(np.median(turn)) for turn in zip(*runs)] for name, runs in out.items()}


# Weight repacking on vs off: SmolLM2 requantized to Q4_0, every matrix of which llama.cpp repacks on
# an AVX2 or AVX-512 CPU (of its Q4_1 as packaged: none, both ways would run the same kernels), on
# 2 stages. Gemma-3-270M Q4_K_M, whose texts differ with repack, repacks 27 small tensors only
# (12.7 MiB of 248): no difference in speed measured on an AMD EPYC. Sized to add ~30 s.
REPACK_SPLIT = [(0, 15), (15, 30)]
REPACK_DECODE_TOKENS = 16 if _QUICK else 32
REPACK_PREFILL_TOKENS = 64 if _QUICK else 256
REPACK_ROUNDS = 1 if _QUICK else 5


def _llama_decode_ms(llm, tokens: list[int], n_tokens: int) -> float:
    """ms per greedy token of an in-process ``Llama`` after the first (decode steps only)."""
    count, started = 0, time.perf_counter()
    for _ in llm.generate(tokens, temp=0.0, reset=True):
        count += 1
        if count == 1:
            started = time.perf_counter()
        if count == n_tokens + 1:
            break
    return (time.perf_counter() - started) / max(count - 1, 1) * 1e3


def _llama_prefill_tps(llm, tokens: list[int]) -> float:
    llm.reset()
    started = time.perf_counter()
    llm.eval(tokens)
    return len(tokens) / (time.perf_counter() - started)


def _repack(workdir: Path, cache_dir: str, cores: int) -> dict[str, object]:
    """``repack`` off (the default) and on: single-stream decode ms/token and prefill tokens/s of
    a 2-stage pipeline, each against the unsplit model in this process loaded the same way
    (``reference_llama(repack=...)``; on is stock ``Llama``'s loading), both pipelines and both
    models loaded at once and run in interleaved rounds (medians), the others frozen. On an AMX
    CPU, which refuses repacking, the reason instead, under "skipped"."""
    from skippy_stage.model import host
    from skippy_stage.model.loader import reference_llama
    from skippy_stage.model.packaged import requantized_q4_0

    if host.host_info().amx:
        return {"skipped": f"this CPU has AMX, where repack=true is refused ({host.AMX_REPACK_CRASH})"}
    started = time.perf_counter()
    model = requantized_q4_0(smollm2_path(), workdir)
    ways = {"off": False, "on": True}
    singles, pipelines = {}, {}
    runs: dict[str, dict[str, list[float]]] = {way: {"single_ms": [], "single_tps": [], "pipeline_ms": [],
                                                     "pipeline_tps": []} for way in ways}
    try:
        for way, repack in ways.items():
            singles[way] = reference_llama(model, repack=repack, n_ctx=2048, n_threads=cores, n_threads_batch=cores,
                                           verbose=False)
            (workdir / f"repack-{way}").mkdir()
            pipelines[way] = _Pipeline(model, REPACK_SPLIT, workdir / f"repack-{way}", cache_dir,
                                       extra={"repack": repack, "lane_count": 1, "ctx_size": 2048})
        llm = singles["off"]
        decode_tokens = llm.tokenize(PROMPT.encode())
        text = "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
        prefill_tokens = llm.tokenize((text * REPACK_PREFILL_TOKENS).encode())[:REPACK_PREFILL_TOKENS]
        prefill_text = llm.detokenize(prefill_tokens[1:]).decode()  # the head adds the BOS itself
        with _awake(pipelines.values(), None):
            for single in singles.values():
                _llama_decode_ms(single, decode_tokens, 2)  # warm (a pipeline is warmed by _awake)
        for _ in range(REPACK_ROUNDS):
            for way in ways:
                with _awake(pipelines.values(), None):
                    runs[way]["single_ms"].append(_llama_decode_ms(singles[way], decode_tokens, REPACK_DECODE_TOKENS))
                    runs[way]["single_tps"].append(_llama_prefill_tps(singles[way], prefill_tokens))
                with _awake(pipelines.values(), pipelines[way]):
                    decoded = after_freeze(partial(pipelines[way].generate, PROMPT, REPACK_DECODE_TOKENS + 1))
                    prefilled = after_freeze(partial(pipelines[way].generate, prefill_text, 1))
                runs[way]["pipeline_ms"].append(1e3 / decoded["tokens_per_s"])
                runs[way]["pipeline_tps"].append(prefilled["prompt_tokens"] / prefilled["ttft_s"])
    finally:
        for llm in singles.values():
            llm.close()
        for pipeline in pipelines.values():
            pipeline.stop()
    out: dict[str, object] = {"model": "SmolLM2-135M requantized to Q4_0", "stages": [list(r) for r in REPACK_SPLIT],
                              "decode_tokens": REPACK_DECODE_TOKENS, "prefill_tokens": REPACK_PREFILL_TOKENS,
                              "rounds": REPACK_ROUNDS, "seconds": time.perf_counter() - started}
    for way in ways:
        m = {key: float(np.median(values)) for key, values in runs[way].items()}
        out[way] = {"single_process_ms_per_token": m["single_ms"], "pipeline_ms_per_token": m["pipeline_ms"],
                    "decode_ratio": m["single_ms"] / m["pipeline_ms"],
                    "single_process_prefill_tokens_per_s": m["single_tps"],
                    "pipeline_prefill_tokens_per_s": m["pipeline_tps"],
                    "prefill_ratio": m["pipeline_tps"] / m["single_tps"],
                    # What the stages ran with (a `bench --set repack=...` applies to these pipelines too).
                    "stages_repack": bool(pipelines[way].local.configs[0].get("repack", False))}
    # Above 1: repack on is the faster. Medians of each round's ratio: a round runs off and on one
    # right after the other, so a busy moment of the host weighs on both sides of its ratio.
    on, off = runs["on"], runs["off"]
    out["on_vs_off"] = {
        "single_process_decode": float(np.median(np.divide(off["single_ms"], on["single_ms"]))),
        "pipeline_decode": float(np.median(np.divide(off["pipeline_ms"], on["pipeline_ms"]))),
        "single_process_prefill": float(np.median(np.divide(on["single_tps"], off["single_tps"]))),
        "pipeline_prefill": float(np.median(np.divide(on["pipeline_tps"], off["pipeline_tps"]))),
    }
    return out


# Single-stream decode, in two phases of interleaved rounds: the headline ratios (2 and 3 stages,
# the defaults: TCP frames, tokens straight back to the head), then the transports and return
# paths compared on 3 stages. Each phase loads only its own pipelines: an idle stage process
# still wakes ~100 times a second (gRPC's thread pool, health probes), and ten of them waking
# in the middle of the measured pipeline's decodes cost its 3-stage ratio ~0.05 in this
# project's runs (0.70-0.72 with all four pipelines loaded, 0.75-0.80 with two).
# "1": the whole model in one stage, served by this project's own stack (gRPC client, the head's
# scheduler, the runtime): what separates it from the single process is the stack, and what
# separates the pipelines from it is the split alone.
HEADLINE_CONTENDERS = {"1": ([(0, 30)], "direct", "tcp"), "2": ([(0, 15), (15, 30)], "direct", "tcp"),
                       "3": (THREE, "direct", "tcp")}
# "3-python": the default pipeline with every frame on the Python path (native_frames off).
COMPARISON_CONTENDERS = {"3-tcp": (THREE, "direct", "tcp"), "3-relay": (THREE, "relay", "tcp"),
                         "3-stream": (THREE, "direct", "stream"), "3-python": (THREE, "direct", "tcp", False)}
# The client's stream: one message per token (the default) against tokens that come within
# STREAM_INTERVAL_MS of the last message sent together (``stream_interval_ms``), 2 stages.
STREAM_INTERVAL_MS = 20.0
STREAM_CONTENDERS = {"2-each": ([(0, 15), (15, 30)], "direct", "tcp"),
                     "2-interval": ([(0, 15), (15, 30)], "direct", "tcp", True,
                                    {"stream_interval_ms": STREAM_INTERVAL_MS}),
                     # The client in the bench's own process at normal priority (the others: QuietClient).
                     "2-local": ([(0, 15), (15, 30)], "direct", "tcp", True, None, "local"),
                     # The client reading nothing until the end (as on another host), timed at the head.
                     "2-held": ([(0, 15), (15, 30)], "direct", "tcp", True, None, "held")}


def _interleaved_decode(model: Path, workdir: Path, cache_dir: str, cores: int,
                        contenders: dict[str, tuple], whole: tuple[str, ...] = ()) -> dict[str, dict]:
    """Single-stream decode of the unsplit model and of ``contenders`` (name: layer ranges,
    return path, transport[, native frames[, other config[, "local": the client in this process]]]),
    in rounds; the pipelines' client is a QuietClient unless a contender says "local" (the client in
    this process) or "held" (``QuietClient.held``, timed at the head). The
    contenders named in ``whole`` run once more per round for a client that asks for the whole
    completion rather than a stream (``<name>-whole``), the unsplit model's own way of working.

    Everything is loaded at once and each round runs each contender once, so a slow moment of a
    noisy machine hits all of them alike; the figures are the medians over the rounds. The
    pipelines not being measured are frozen meanwhile (``_awake``).
    """
    pipelines: dict[str, _Pipeline] = {}
    clients: dict[str, QuietClient | None] = {}
    quiet = QuietClient()
    single = SingleDecoder(model, cores)
    runs: dict[str, list] = {"single": [], **{name: [] for name in contenders}, **{f"{n}-whole": [] for n in whole}}
    try:
        for name, (ranges, return_path, transport, *more) in contenders.items():
            sub = workdir / f"decode-{name}"
            sub.mkdir()
            pipelines[name] = _Pipeline(model, ranges, sub, cache_dir, return_path=return_path, transport=transport,
                                        native_frames=more[0] if more else True,
                                        extra=more[1] if len(more) > 1 else None)
            clients[name] = {"local": None, "held": _HeldClient(quiet, pipelines[name])}.get(
                more[2] if len(more) > 2 else "", quiet)
        with _awake(pipelines.values(), None):
            single.ms_per_token()  # warm
        for _ in range(DECODE_ROUNDS):
            with _awake(pipelines.values(), None):
                ms, threads = single.measure()
                runs["single"].append((ms, [], [], [], 0.0, [threads]))
            for name, pipeline in pipelines.items():
                with _awake(pipelines.values(), pipeline):
                    runs[name].append(after_freeze(partial(_decode_ms, pipeline, clients[name])))
                    if name in whole:
                        runs[f"{name}-whole"].append(after_freeze(partial(_decode_ms, pipeline, clients[name],
                                                                          whole=True)))
    finally:
        quiet.close()
        single.close()
        for pipeline in pipelines.values():
            pipeline.stop()
    out = {}
    for name, values in runs.items():
        ms = [v[0] for v in values]
        median = sorted(values, key=lambda v: v[0])[len(values) // 2]
        out[name] = {"ms": float(np.median(ms)), "runs": ms, "cpu": median[1],
                     "compute": [float(c) for c in np.median(np.array([v[3] for v in values]), axis=0)]
                     if name != "single" else [],
                     "hops": [float(h) for h in np.median(np.array([v[2] for v in values]), axis=0)]
                     if name != "single" else [],
                     "hop_latency": float(np.median([v[4] for v in values])),
                     # Each process's CPU by thread, medians over the rounds.
                     "threads": [{key: float(np.median([v[5][i][key] for v in values])) for key in THREAD_KEYS}
                                 for i in range(len(values[0][5]))]}
    return out


@contextlib.contextmanager
def _awake(pipelines, measured: _Pipeline | None):
    """Only ``measured``'s stages run (None: no pipeline's): the others are stopped (SIGSTOP)
    until the block ends. An idle stage process still wakes ~100 times a second (gRPC's thread
    pool, health probes), on the cores the measured decode uses; a host serving one pipeline has
    no idle ones beside it. Once woken, a pipeline serves a token before it is measured."""
    frozen = [proc for pipeline in pipelines if pipeline is not measured for proc in pipeline.local.procs
              if proc.poll() is None]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        if measured is not None:
            measured.wait_ready()
        yield
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)


def _capture_kind() -> str:
    from skippy_stage.model.capture import native_library_path

    return "native" if native_library_path() is not None else "python"


def _prefill_prompt(model: Path, cache_dir: str) -> str:
    """A text of exactly PREFILL_TOKENS tokens for the head's tokenizer."""
    cfg = StageConfig(model_path=str(model), stage_id="tok", stage_index=0, layer_start=0, layer_end=30,
                      lane_count=1, ctx_size=1024, cache_dir=cache_dir, n_threads=1)
    runtime = StageRuntime(cfg)
    try:
        text, _ = _long_prompt(runtime, PREFILL_TOKENS)
        while len(runtime.tokenizer.tokenize(text)) > PREFILL_TOKENS:
            text = text[:-1]
        return text
    finally:
        runtime.close()


def format_table(report: dict[str, object]) -> str:
    r = report
    ratios = r["ratios"]
    agg = r["aggregate_tokens_per_s"]
    lines = [
        f"{'measure':44} {'pipeline':>12} {'single':>12} {'ratio':>8} {'target':>8}",
        f"{'decode ms/token, 2 stages':44} {r['pipeline_ms_per_token']['2']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_2_stage']:8.2f} {'>=0.95':>8}",
        f"{'decode ms/token, 3 stages':44} {r['pipeline_ms_per_token']['3']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_3_stage']:8.2f} {'>=0.90':>8}",
        f"{'decode ms/token, 1 stage (this stack, unsplit)':44} {r['one_stage_ms_per_token']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_1_stage']:8.2f}",
        f"{'decode ms/token, 2 stages, whole completion':44} {r['whole_completion_ms_per_token']['2']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_2_stage_whole_completion']:8.2f}",
        f"{'decode ms/token, 3 stages, whole completion':44} {r['whole_completion_ms_per_token']['3']:12.2f} "
        f"{r['single_process_ms_per_token']:12.2f} {ratios['decode_3_stage_whole_completion']:8.2f}",
        f"{'decode, 2 / 3 stages vs 1 stage (the split alone)':44} {'':>12} {'':>12} "
        f"{ratios['decode_2_stage_vs_1_stage']:5.2f} / {ratios['decode_3_stage_vs_1_stage']:.2f}",
        f"{'per-hop overhead (us, 3-stage excess / 3 legs)':44} {r['per_hop_overhead_us']:12.0f}",
        f"{'per-hop overhead (us, from stage histograms)':44} {r['per_hop_overhead_us_histograms']:12.0f}",
    ]
    for c in ("1", "4", "8"):
        lines.append(f"{'aggregate tok/s, concurrency ' + c:44} {agg['pipeline'][c]:12.1f} "
                     f"{agg['single_process'][c]:12.1f} {agg['pipeline'][c] / agg['single_process'][c]:8.2f}"
                     f" {'>=0.85' if c == '8' else '':>8}")
    lines.append(f"{'split cost per extra stage (us, client view)':44} {r['split_cost_us_per_extra_stage']:12.0f}")
    lines.append(f"{'aggregate 8 vs pipeline 1':44} {'':>12} {'':>12} {ratios['aggregate_8_vs_pipeline_1']:8.2f} {'>=1.5':>8}")
    p = r["prefill_tokens_per_s"]
    lines.append(f"{'prefill tok/s, 512-token prompt':44} {p['pipeline']:12.1f} {p['single_process']:12.1f} "
                 f"{ratios['prefill_512']:8.2f} {'>=0.95':>8}")
    chat = r["chat_ttft_s"]
    lines.append(f"{'chat turn 4 TTFT s, no prefix cache / cache':44} {chat['without_prefix_cache'][-1]:12.3f} "
                 f"{chat['with_prefix_cache'][-1]:12.3f} {ratios['chat_turn4_ttft_without_vs_with_prefix_cache']:8.2f} "
                 f"{'>=3':>8}")
    lines.append("chat TTFT s per turn, with prefix cache: " + ", ".join(f"{t:.3f}" for t in chat["with_prefix_cache"])
                 + "; without: " + ", ".join(f"{t:.3f}" for t in chat["without_prefix_cache"]))
    for name, target in (("repetitive", ">=1.8"), ("free_form", ">=0.95")):
        s = r["speculative"][name]
        lines.append(f"{'speculative ngram, ' + name + ' (ms/token)':44} {s['ngram']['ms_per_token']:12.2f} "
                     f"{s['none']['ms_per_token']:12.2f} {s['speedup']:8.2f} {target:>8}")
        lines.append(f"  ngram: {s['ngram']['tokens_per_trip']:.2f} tokens per trip of {s['ngram']['rows_per_trip']:.2f} rows, "
                     f"a trip costing {s['trip_cost_ratio']:.2f}x a plain one (ratio column: tokens/s with ngram over "
                     f"without, 3 stages)")
    lines.append(f"{'hop latency (us, send -> next stage computes)':44} {r['hop_latency_us']:12.0f} "
                 f"{'':>12} {'':>8} {'<=200':>8}")
    for transport, t in r["transport_comparison_3_stage"].items():
        default = " (default)" if transport == r["hop_transport_default"] else ""
        lines.append(f"3 stages over {transport:6}: {t['ms_per_token']:.2f} ms/token, per-hop overhead "
                     f"{t['per_hop_overhead_us']:.0f} us, hop latency {t['hop_latency_us']:.0f} us{default}")
    si = r["stream_interval_2_stage"]
    lines.append(f"2 stages, a client message per token: {si['each_token_ms_per_token']:.2f} ms/token "
                 f"({si['single_process_ms_per_token'] / si['each_token_ms_per_token']:.2f}); tokens within "
                 f"{si['interval_ms']:.0f} ms sent together (stream_interval_ms): {si['interval_ms_per_token']:.2f} "
                 f"ms/token ({si['single_process_ms_per_token'] / si['interval_ms_per_token']:.2f})")
    cp = r["client_priority_2_stage"]
    lines.append(f"2 stages, the client in the bench's process at normal priority: {cp['local_ms_per_token']:.2f} "
                 f"ms/token ({cp['single_process_ms_per_token'] / cp['local_ms_per_token']:.2f}); in its own at "
                 f"nice 19 (every decode figure): {cp['quiet_ms_per_token']:.2f} ms/token "
                 f"({cp['single_process_ms_per_token'] / cp['quiet_ms_per_token']:.2f}); reading nothing until "
                 f"the end (timed at the head): {cp['held_ms_per_token']:.2f} ms/token "
                 f"({cp['single_process_ms_per_token'] / cp['held_ms_per_token']:.2f})")
    fp = r["frame_path_comparison_3_stage"]
    lines.append(f"3 stages, frames below the head in Python: {fp['python_ms_per_token']:.2f} ms/token; "
                 f"in C where plain: {fp['native_ms_per_token']:.2f} ms/token"
                 f"{' (default)' if r['native_frames'] else ' (not built here: both ran Python)'}")
    rp = r["return_path_comparison_3_stage"]
    lines.append(f"3 stages, tokens relayed back: {rp['relay_ms_per_token']:.2f} ms/token; "
                 f"straight to the head: {rp['direct_ms_per_token']:.2f} ms/token (medians, interleaved runs)")
    floor = r["hop_floor_us"]
    lines.append(f"hop floor, 2304-byte frame to another process and back: grpcio stream "
                 f"{floor['grpc_stream_round_trip_us']:.0f} us, TCP frames {floor['tcp_frame_round_trip_us']:.0f} us, "
                 f"bare TCP socket {floor['tcp_socket_round_trip_us']:.0f} us")
    wake = r["wake_floor_us"]
    held = r["cpu_wake_latency_us"]
    lines.append(f"wake of a sleeping receiver, one-way (sender busy 3 ms between sends): host idle policy "
                 f"{wake['host_policy']:.0f} us" + (f", idle CPUs held to 0 us {wake['held_0_us']:.0f} us"
                                                    if "held_0_us" in wake else "")
                 + f"; bench stages held cpu_wake_latency_us={'unset (host policy)' if held is None else held}")
    for n, cpu in r["stage_cpu_ms_per_token"].items():
        lines.append(f"CPU ms per token by stage, {n} stages: " + ", ".join(f"{c:.2f}" for c in cpu))
    by_thread = r["token_cpu_us_by_thread"]
    base = by_thread["single"][0]["decoding"] + by_thread["single"][0]["other"]
    for n, procs in by_thread.items():
        total = sum(p["decoding"] + p["other"] for p in procs)
        name = "single process" if n == "single" else f"{n} stage{'s' if n != '1' else ''}"
        lines.append(f"CPU us per token, {name}: " + "; ".join(
            f"{p['decoding']:.0f} decoding (waited {p['decoding_wait']:.0f}) + {p['other']:.0f} other" for p in procs)
            + ("" if n == "single" else f" = {total:.0f}, {total - base:+.0f} vs single"))
    for n, by_stage in r["stage_compute_ms_by_stage"].items():
        lines.append(f"compute ms per token by stage, {n} stages: " + ", ".join(f"{c:.2f}" for c in by_stage)
                     + f" (sum {r['stage_compute_ms_per_token'][n]:.2f}; single process "
                       f"{r['single_process_ms_per_token']:.2f} in all)")
    spin, policy, bind = r["openmp_spincount"], r["openmp_wait_policy"], r["openmp_proc_bind"]
    lines.append(f"OpenMP spin count: stages {spin['stages']}, single process {spin['single_process']}; wait policy: "
                 f"stages {policy['stages']}, single process {policy['single_process']}; threads "
                 f"bound: stages {bind['stages']}, single process {bind['single_process']}; "
                 f"{'each stage from its own core' if r.get('openmp_places_by_stage') else 'every stage from the first core'}; "
                 f"hidden-state capture {r['hidden_state_capture']}")
    threads = r["cpu_threads"]
    if threads != "openmp":
        lines.append(f"CPU graphs on llama.cpp built without OpenMP: stages {threads['stages']}, single process "
                     f"{threads['single_process']} (the OpenMP settings above do nothing)")
    lines.append("wire bytes/token: " + ", ".join(f"{k} {v}" for k, v in r["wire_bytes_per_token"].items()))
    rp = r["repack"]
    if "skipped" in rp:
        lines.append(f"repack on vs off: skipped ({rp['skipped']})")
    else:
        for way in ("off", "on"):
            w = rp[way]
            lines.append(f"{'decode ms/token, repack ' + way + ', 2 stages':44} {w['pipeline_ms_per_token']:12.2f} "
                         f"{w['single_process_ms_per_token']:12.2f} {w['decode_ratio']:8.2f}")
            lines.append(f"{'prefill tok/s, repack ' + way + ', ' + str(rp['prefill_tokens']) + '-token prompt':44} "
                         f"{w['pipeline_prefill_tokens_per_s']:12.1f} {w['single_process_prefill_tokens_per_s']:12.1f} "
                         f"{w['prefill_ratio']:8.2f}")
        v = rp["on_vs_off"]
        lines.append(f"repack on vs off ({rp['model']}; above 1: on is faster): decode {v['pipeline_decode']:.2f} "
                     f"(single process {v['single_process_decode']:.2f}), prefill {v['pipeline_prefill']:.2f} "
                     f"(single process {v['single_process_prefill']:.2f})")
    return "\n".join(lines)
