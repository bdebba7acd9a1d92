"""How ``up``, ``bench`` and the tests pick ports for a local split."""

from __future__ import annotations

import socket

from skippy_stage.cli.local import free_ports


def test_free_ports_never_hands_out_a_port_twice_in_one_process():
    """A pipeline's stage ports and its metrics and HTTP ports come from separate calls made
    before any server binds; a repeat would make one stage fail with "Address already in use"."""
    seen: list[int] = []
    for _ in range(100):  # the kernel's own picks repeat within 400 ports in 50 of 50 trials
        seen += free_ports("127.0.0.1", 4)
    assert len(set(seen)) == len(seen)


def test_free_ports_are_bindable():
    for port in free_ports("127.0.0.1", 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
