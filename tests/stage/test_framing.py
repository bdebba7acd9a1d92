"""The TCP frame transport's socket end: whole messages out of whatever the kernel delivers.

A frame must come out whole however its bytes arrive (together with others, or a byte at a
time), ``readable`` must say a message is waiting only when a whole one is (the listener runs
the ones that are and must not stall them behind one still arriving), and a length the link
cannot take is refused before its body is read.
"""

from __future__ import annotations

import socket
import threading

import pytest

from skippy_stage.errors import InvalidRequestError
from skippy_stage.stage import framing
from skippy_stage.v1 import stage_pb2 as pb


def pair(max_message_bytes: int = 1 << 20) -> tuple[socket.socket, framing.FrameSocket]:
    a, b = socket.socketpair()
    return a, framing.FrameSocket(b, max_message_bytes=max_message_bytes)


def hello(n: int) -> pb.FrameHello:
    return pb.FrameHello(version=n, stage_id="s" * n, token="t")


def test_messages_that_arrive_together_come_out_one_by_one_and_are_known_to_be_there():
    raw, link = pair()
    raw.sendall(b"".join(framing.encode(framing.Kind.HELLO, hello(n)) for n in (1, 2, 3)))
    got = []
    kind, body = link.receive()
    got.append(framing.parse(kind, body, framing.Kind.HELLO).version)
    while link.readable():
        kind, body = link.receive()
        got.append(framing.parse(kind, body, framing.Kind.HELLO).version)
    assert got == [1, 2, 3]
    assert not link.readable()


def test_a_message_still_arriving_is_not_readable_and_a_receive_waits_for_all_of_it():
    raw, link = pair()
    first, second = framing.encode(framing.Kind.HELLO, hello(1)), framing.encode(framing.Kind.HELLO, hello(200))
    raw.sendall(first + second[:7])
    assert framing.parse(*link.receive(), framing.Kind.HELLO).version == 1
    assert not link.readable()  # 7 bytes of the next one: the ones here are not held for it
    rest = threading.Timer(0.05, lambda: [raw.sendall(second[7 + i : 8 + i]) for i in range(len(second) - 7)])
    rest.start()
    assert framing.parse(*link.receive(), framing.Kind.HELLO) == hello(200)
    rest.join()


def test_a_length_beyond_the_limit_is_refused_before_its_body_is_read():
    raw, link = pair(max_message_bytes=64)
    raw.sendall((1 << 20).to_bytes(4, "big") + bytes([framing.Kind.HOP_REQUEST]))
    with pytest.raises(InvalidRequestError, match="exceeds max_message_bytes=64"):
        link.receive()


def test_a_peer_that_closes_mid_message_ends_the_link():
    raw, link = pair()
    raw.sendall(framing.encode(framing.Kind.HELLO, hello(5))[:6])
    raw.close()
    with pytest.raises(framing.LinkClosed, match="closed by the peer"):
        link.receive()


def test_a_large_body_arriving_in_pieces_comes_out_whole_and_so_does_the_next():
    raw, link = pair(max_message_bytes=1 << 24)
    big = pb.HopRequest(hop_id=3)
    big.request.frame.payload = bytes(range(256)) * 8000  # a 512-token prefill frame is ~1.2 MB
    data = framing.encode(framing.Kind.HOP_REQUEST, big) + framing.encode(framing.Kind.HELLO, hello(4))
    sender = threading.Thread(target=lambda: [raw.sendall(data[i : i + 50_000]) for i in range(0, len(data), 50_000)])
    sender.start()
    assert framing.parse(*link.receive(), framing.Kind.HOP_REQUEST) == big
    assert framing.parse(*link.receive(), framing.Kind.HELLO) == hello(4)
    sender.join()
