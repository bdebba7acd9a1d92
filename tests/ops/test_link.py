"""The link emulator (``skippy_stage.ops.link``): a relay adds exactly the configured one-way delay,
serialises at the configured rate, never alters or reorders bytes, and passes on ends, resets and
its own closing; ``up --link-delay-ms`` puts every edge of a chain through one."""

from __future__ import annotations

import argparse
import io
import random
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from support.up import running_up

from skippy_stage.cli.client import generate
from skippy_stage.cli.local import emulate_links, free_ports, pipeline_configs
from skippy_stage.errors import SkippyError
from skippy_stage.model.loader import reference_llama
from skippy_stage.ops.link import Link, Relay, relay_chain

# (sequence number, monotonic ns when sent): the echo server restamps what it sends back.
STAMP = struct.Struct("<qq")
SAMPLES = 200
# The emulator's precision (median within 0.2 ms of the setting on a quiet host) is a figure that
# `skippy-stage bench` measures and prints; a test on a shared 2-core machine asserts only what noise
# cannot break (never less than the setting) and what a broken relay would (a gross excess).


def gross_excess_s(delay_s: float) -> float:
    """More than this over the setting is a relay that delays twice, not a busy host."""
    return max(1e-3, delay_s / 4)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise EOFError
        buf += data
    return bytes(buf)


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(10)
    return sock


@contextmanager
def server(handle: Callable[[socket.socket], None]) -> Iterator[tuple[str, int]]:
    """A loopback TCP server running ``handle`` on every connection (a thread each)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(nodelay(conn),), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()
    finally:
        listener.close()


def echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer ended the connection (an end of stream or a reset), within the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


@pytest.mark.parametrize("delay_ms", [2, 10])
def test_the_one_way_delay_is_the_setting_in_both_directions(delay_ms: float):
    """Every sample at least the delay; the median near it (the loopback's own hop and the threads'
    wake-ups included)."""
    forward: list[float] = []

    def restamp(conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    seq, sent = STAMP.unpack(recv_exact(conn, STAMP.size))
                    forward.append((time.monotonic_ns() - sent) / 1e9)
                    conn.sendall(STAMP.pack(seq, time.monotonic_ns()))
            except (EOFError, OSError):
                pass

    back: list[float] = []
    with server(restamp) as target, Relay(target, Link.from_ms(delay_ms)) as relay:
        with nodelay(socket.create_connection(relay.address)) as client:
            for i in range(SAMPLES):
                client.sendall(STAMP.pack(i, time.monotonic_ns()))
                seq, sent = STAMP.unpack(recv_exact(client, STAMP.size))
                back.append((time.monotonic_ns() - sent) / 1e9)
                assert seq == i

    delay = delay_ms / 1000
    for name, samples in (("forward", forward), ("back", back)):
        assert len(samples) == SAMPLES
        median = statistics.median(samples)
        print(f"{delay_ms} ms {name}: median {median * 1e3:.3f} min {min(samples) * 1e3:.3f} "
              f"max {max(samples) * 1e3:.3f} ms")
        assert min(samples) >= delay, name
        assert median - delay <= gross_excess_s(delay), (name, median)


def test_a_bandwidth_cap_serialises_at_its_rate():
    """1 MB through 20 Mbit/s takes at least its 0.4 s, however fast the sender writes (and not
    half as long again: the cap, not the host, sets the pace)."""
    total = 1_000_000
    got = threading.Event()
    finished: list[float] = []

    def sink(conn: socket.socket) -> None:
        n = 0
        with conn:
            while n < total and (data := conn.recv(65536)):
                n += len(data)
        finished.append(time.monotonic())
        got.set()

    with server(sink) as target, Relay(target, Link(mbit=20)) as relay:
        with nodelay(socket.create_connection(relay.address)) as client:
            started = time.monotonic()
            client.sendall(random.randbytes(total))
            assert got.wait(10)

    elapsed = finished[0] - started
    print(f"1 MB at 20 Mbit/s: {elapsed:.3f} s")
    assert total * 8 / 20e6 <= elapsed < 1.5 * total * 8 / 20e6


def test_bytes_arrive_unaltered_and_in_order_under_jitter():
    rng = random.Random(7)
    sent = b"".join(rng.randbytes(rng.randint(1, 3000)) for _ in range(800))
    received = bytearray()

    with server(echo) as target, Relay(target, Link.from_ms(0.5, jitter_ms=3), seed=1) as relay:
        with nodelay(socket.create_connection(relay.address)) as client:
            def read() -> None:
                while len(received) < len(sent) and (data := client.recv(65536)):
                    received.extend(data)

            reader = threading.Thread(target=read)
            reader.start()
            view = memoryview(sent)
            while view:  # many small writes, each its own chunk with its own jitter
                n = rng.randint(1, 3000)
                client.sendall(view[:n])
                view = view[n:]
                time.sleep(rng.random() * 0.0005)
            reader.join(30)

    assert bytes(received) == sent


def test_a_half_close_travels_with_the_delay_and_the_other_direction_stays_open():
    seen_end: list[float] = []

    def answer_after_end(conn: socket.socket) -> None:
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            seen_end.append(time.monotonic())
            conn.sendall(data[::-1])

    with server(answer_after_end) as target, Relay(target, Link.from_ms(5)) as relay:
        with nodelay(socket.create_connection(relay.address)) as client:
            client.sendall(b"abc")
            ended = time.monotonic()
            client.shutdown(socket.SHUT_WR)
            assert recv_exact(client, 3) == b"cba"
            assert client.recv(10) == b""

    assert seen_end[0] - ended >= 0.005


@pytest.mark.parametrize("side", ["target", "client"])
def test_a_reset_on_one_side_closes_the_other(side: str):
    conns: list[socket.socket] = []
    target_saw_end = threading.Event()

    def hold(conn: socket.socket) -> None:
        conns.append(conn)
        if side == "client":
            closed_by_peer(conn)
            target_saw_end.set()

    with server(hold) as target, Relay(target, Link.from_ms(2)) as relay:
        client = nodelay(socket.create_connection(relay.address))
        client.sendall(b"x")
        wait_for(lambda: conns)
        reset_one = conns[0] if side == "target" else client
        reset_one.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset_one.close()
        if side == "target":
            assert closed_by_peer(client)
            client.close()
        else:
            assert target_saw_end.wait(5)
        wait_for(lambda: relay.connections == 0)


def test_closing_the_relay_closes_its_live_connections_and_stops_listening():
    with server(echo) as target:
        relay = Relay(target, Link.from_ms(1))
        clients = [nodelay(socket.create_connection(relay.address)) for _ in range(3)]
        for c in clients:
            c.sendall(b"ping")
            assert recv_exact(c, 4) == b"ping"
        assert relay.connections == 3

        relay.close()

        for c in clients:
            assert closed_by_peer(c)
            c.close()
        assert relay.connections == 0
        with pytest.raises(OSError):
            socket.create_connection(relay.address, timeout=2).close()


def test_relay_chain_relays_each_edge_on_an_address_of_its_own_at_the_stages_ports():
    """A stage reaches its neighbour's frame listener at the port the neighbour advertises on the
    host of the neighbour's endpoint: each edge's relay listens on its own loopback address, at
    the gRPC port and the frame port of the stage behind it."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(6)]  # (gRPC, frames) x 3 stages
    ports = [s.getsockname()[1] for s in listeners]
    endpoints = [f"127.0.0.1:{ports[2 * i]}" for i in range(3)]
    try:
        with relay_chain(endpoints, Link.from_ms(1), frame_ports=ports[1::2]) as chain:
            assert len(chain.downstream) == 2 and chain.return_to is not None
            relayed = [*chain.downstream, chain.return_to]
            hosts = [e.rpartition(":")[0] for e in relayed]
            assert len(set(hosts)) == 3 and "127.0.0.1" not in hosts
            for endpoint, stage in zip(relayed, [1, 2, 0]):
                host, _, port = endpoint.rpartition(":")
                assert int(port) == ports[2 * stage]
                for listener in listeners[2 * stage:2 * stage + 2]:  # both ports reach the stage
                    with socket.create_connection((host, listener.getsockname()[1]), timeout=2):
                        listener.settimeout(2)
                        listener.accept()[0].close()

        without_return = relay_chain(endpoints, Link(), direct_return=False)
        without_return.close()
        assert without_return.return_to is None and len(without_return.downstream) == 2
    finally:
        for s in listeners:
            s.close()


@pytest.mark.parametrize(("link", "named"), [
    (dict(delay_s=-0.001), "delay_s=-0.001"),
    (dict(jitter_s=float("nan")), "jitter_s=nan"),
    (dict(mbit=0), "mbit=0"),
])
def test_a_wrong_link_is_refused_naming_it(link: dict, named: str):
    with pytest.raises(SkippyError, match=named):
        Link(**link)


def test_stages_on_a_wildcard_address_are_refused():
    with pytest.raises(SkippyError, match="0.0.0.0"):
        relay_chain(["0.0.0.0:7000", "0.0.0.0:7001"], Link())


def test_up_points_every_edge_of_its_chain_at_a_relay_and_fixes_the_frame_ports():
    ports = free_ports("127.0.0.1", 3)
    configs = pipeline_configs("m.gguf", [(0, 10), (10, 20), (20, 30)], host="127.0.0.1", ports=ports, extra={})
    args = argparse.Namespace(host="127.0.0.1", link_delay_ms=3.0, link_jitter_ms=0.5, link_mbit=100.0)

    relays = emulate_links(configs, args)
    try:
        assert relays is not None
        assert [c["downstream"]["endpoint"] for c in configs[:2]] == relays.downstream
        assert configs[2]["return_to"]["endpoint"] == relays.return_to
        assert [c["upstream"]["endpoint"] for c in configs[1:]] == [f"127.0.0.1:{p}" for p in ports[:2]]
        assert all(isinstance(c["frame_port"], int) for c in configs)
        for edge, behind in zip(relays.edges, [1, 2, 0]):
            assert edge.link == Link(delay_s=0.003, jitter_s=0.0005, mbit=100.0)
            assert [r.target for r in edge.relays] == [("127.0.0.1", ports[behind]),
                                                       ("127.0.0.1", configs[behind]["frame_port"])]
    finally:
        if relays is not None:
            relays.close()

    no_link = argparse.Namespace(host="127.0.0.1", link_delay_ms=None, link_jitter_ms=0.0, link_mbit=20.0)
    with pytest.raises(SkippyError, match="need --link-delay-ms"):
        emulate_links(configs, no_link)


def wait_for(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


DELAY_MS = 5
MAX_TOKENS = 24
PROMPT = "The three primary colours are"


@pytest.mark.parametrize("transport", ["tcp", "stream"])
def test_up_with_a_link_delay_gives_the_same_text_and_pays_every_edge(smollm2, slice_cache, tmp_path, transport):
    """3 stages with the direct return: each token crosses 3 edges, so a generation cannot take
    less than 3 x D per token (no upper bound: the machine's load decides that)."""
    llm = reference_llama(smollm2, n_ctx=512, verbose=False)
    try:
        expected = llm.create_completion(PROMPT, max_tokens=MAX_TOKENS, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()

    log = tmp_path / "up.log"
    with running_up("--model", str(smollm2), "--stages", "3", "--link-delay-ms", str(DELAY_MS),
                    "--set", f"hop_transport={transport}", cache=slice_cache, log=log) as (endpoint, _):
        out = io.StringIO()
        figures = generate(endpoint, PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, seed=None, chat=False, out=out)

    assert out.getvalue() == expected
    assert figures["completion_tokens"] == MAX_TOKENS
    # Every token (the first with the prompt) is one trip down the chain and back: 3 edges.
    assert figures["seconds"] >= MAX_TOKENS * 3 * DELAY_MS / 1000
    assert "link emulator (a test tool): every edge 5 ms one-way" in log.read_text()
