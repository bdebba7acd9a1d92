"""What a hop costs with no model at all: round trips to an echo process over each transport, and
the wake-up of a receiver sleeping in ``recv``. The pipeline figures are read against these floors."""

from __future__ import annotations

import threading
import time

from skippy_stage.cli.local import free_ports
from skippy_stage.server import wake_latency
from skippy_stage.stage import wire
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc


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
