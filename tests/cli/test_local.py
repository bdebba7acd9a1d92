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


def test_stages_started_here_share_the_host_and_sleep_their_openmp_workers_soon(monkeypatch):
    from skippy_stage.cli.local import stage_environment
    from skippy_stage.config import SHARED_HOST_SPINCOUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert stage_environment()["GOMP_SPINCOUNT"] == SHARED_HOST_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")
    assert stage_environment()["GOMP_SPINCOUNT"] == "12345", "an operator's value wins"


def test_a_stage_alone_on_its_host_keeps_libgomps_own_spin_count():
    """Importing the package and its server sets nothing: a stage on a node of its own keeps its
    OpenMP worker awake between frames (libgomp's default), which an idle VM needs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    run = subprocess.run([sys.executable, "-c", "import os, skippy_stage.server.server, skippy_stage.cli.commands; "
                          "print(os.environ.get('GOMP_SPINCOUNT'))"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "None"
