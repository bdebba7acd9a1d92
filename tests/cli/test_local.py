"""How ``up``, ``bench`` and the tests pick ports for a local split."""

from __future__ import annotations

import socket
from pathlib import Path

from skippy_stage.cli.local import free_ports


def test_free_ports_never_hands_out_a_port_twice_in_one_process():
    """A pipeline's stage ports and its metrics and HTTP ports come from separate calls made
    before any server binds; a repeat would make one stage fail with "Address already in use"."""
    seen: list[int] = []
    for _ in range(100):  # the kernel's own picks repeat within 400 ports in 50 of 50 trials
        seen += free_ports("127.0.0.1", 4)
    assert len(set(seen)) == len(seen)


def test_free_ports_lie_below_the_range_outgoing_connections_draw_from():
    """A stage started after its neighbours have connected to each other must still find its
    port free: the kernel hands ports of the ephemeral range to every outgoing connection."""
    from skippy_stage.cli.local import _ephemeral_range

    low, high = _ephemeral_range()
    assert all(not low <= port <= high for port in free_ports("127.0.0.1", 20))


def test_free_ports_are_bindable():
    for port in free_ports("127.0.0.1", 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_stages_started_here_share_the_host_and_sleep_their_openmp_workers_soon(monkeypatch):
    from skippy_stage.cli.local import stage_environment
    from skippy_stage.config import SHARED_HOST_SPINCOUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert stage_environment()["GOMP_SPINCOUNT"] == SHARED_HOST_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")
    assert stage_environment()["GOMP_SPINCOUNT"] == "12345", "an operator's value wins"


def test_co_located_stages_keep_spinning_briefly_at_barriers_once_several_threads_decode(monkeypatch):
    """Beside the spin count it sets, the launcher sets OMP_WAIT_POLICY=active: libgomp then spins
    min(1000, GOMP_SPINCOUNT) at a barrier, not 100, once a process runs more OpenMP threads than
    cores (a second decoding thread: max_inflight 2 cost a single stream 8 % without it). Not
    where the operator chose the spin count or the policy."""
    from skippy_stage.cli.local import stage_environment
    from skippy_stage.config import SHARED_HOST_WAIT_POLICY

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert stage_environment()["OMP_WAIT_POLICY"] == SHARED_HOST_WAIT_POLICY == "active"
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert stage_environment()["OMP_WAIT_POLICY"] == "passive", "an operator's policy wins"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")
    assert "OMP_WAIT_POLICY" not in stage_environment(), "an operator's spin count: their policy too"


def test_a_head_alone_on_its_host_running_several_steps_keeps_libgomps_spin_with_the_throttled_one_lifted():
    """A head with max_inflight > 1 decodes on that many threads, each leading its own OpenMP team:
    more threads than cores, where libgomp spins only 100 at a barrier unless the policy is active.
    Its serve sets the policy with libgomp's own spin count for an unset one; nothing for one
    decoding thread, below the head, or where the operator chose."""
    from skippy_stage.config import STANDALONE_SPINCOUNT, several_teams_openmp

    assert several_teams_openmp(2, True, {}) == {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": STANDALONE_SPINCOUNT}
    assert STANDALONE_SPINCOUNT == "300000", "libgomp's default with no policy set"
    assert several_teams_openmp(1, True, {}) == {}
    assert several_teams_openmp(4, False, {}) == {}
    assert several_teams_openmp(2, True, {"GOMP_SPINCOUNT": "10"}) == {}
    assert several_teams_openmp(2, True, {"OMP_WAIT_POLICY": "passive"}) == {}


def test_stages_started_here_bind_their_openmp_threads_unless_the_operator_placed_them(monkeypatch):
    from skippy_stage.cli.local import stage_environment

    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    assert stage_environment()["OMP_PROC_BIND"] == "true"
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0-1")
    assert "OMP_PROC_BIND" not in stage_environment(), "an operator's placement wins"
    monkeypatch.delenv("GOMP_CPU_AFFINITY")
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert stage_environment()["OMP_PROC_BIND"] == "false"


def test_co_located_stages_start_their_openmp_places_at_their_own_core():
    """Stage i of a shared host binds from its own core on: libgomp puts the loading thread (and
    so every thread the stage starts) on the first place. Stages that take every core start one
    core apart; stages given fewer threads than cores start that many apart, side by side."""
    from skippy_stage.config import SHARED_HOST_PLACES_ENV, shared_host_openmp, stage_openmp_places

    marked = shared_host_openmp({})
    assert marked[SHARED_HOST_PLACES_ENV] == "1"
    assert stage_openmp_places(1, 2, marked, {0, 1}) == {"OMP_PLACES": "{1},{0}"}
    assert stage_openmp_places(1, 1, marked, {0, 1}) == {"OMP_PLACES": "{1},{0}"}
    assert stage_openmp_places(2, 3, marked, [7, 2, 5]) == {"OMP_PLACES": "{7},{2},{5}"}, "sorted cores, rotated"
    assert stage_openmp_places(1, 8, marked, [3, 9, 4]) == {"OMP_PLACES": "{4},{9},{3}"}
    assert stage_openmp_places(1, 2, marked, range(4)) == {"OMP_PLACES": "{2},{3},{0},{1}"}, "side by side"
    assert stage_openmp_places(3, 1, marked, range(4)) == {"OMP_PLACES": "{3},{0},{1},{2}"}
    assert stage_openmp_places(1, 4, marked, range(4)) == {"OMP_PLACES": "{1},{2},{3},{0}"}, "all cores: one apart"
    for index in (0, 2, 4):
        assert stage_openmp_places(index, 2, marked, {0, 1}) == {}, "no rotation: libgomp's own places"
    assert stage_openmp_places(2, 2, marked, range(4)) == {}, "round the cores: back at the first"
    assert stage_openmp_places(3, 1, marked, {5}) == {}, "one core: nothing to rotate"
    assert stage_openmp_places(1, 2, {}, {0, 1}) == {}, "not started beside other stages: nothing"
    for operator in ({"OMP_PLACES": "cores"}, {"GOMP_CPU_AFFINITY": "0-1"}):
        assert stage_openmp_places(1, 2, {**marked, **operator}, {0, 1}) == {}, "an operator's placement wins"
    assert SHARED_HOST_PLACES_ENV not in shared_host_openmp({"OMP_PROC_BIND": "spread"}), \
        "an operator who binds the threads places them too"


def test_a_stage_alone_on_its_host_keeps_libgomps_own_spin_count():
    """Importing the package and its server sets nothing: a stage on a node of its own keeps its
    OpenMP worker awake between frames (libgomp's default), which an idle VM needs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_WAIT_POLICY")}
    run = subprocess.run([sys.executable, "-c", "import os, skippy_stage.server.server, skippy_stage.cli.commands; "
                          "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_PROC_BIND'), "
                          "os.environ.get('OMP_WAIT_POLICY'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "None None None"


_CHILD = ("from skippy_stage.cli.local import die_with_parent; die_with_parent(); import time; time.sleep(60)")


def test_a_stage_started_here_dies_with_the_process_that_started_it(tmp_path):
    """The stage sets its own death signal after exec (no preexec_fn: Python then forks for real,
    and grpcio's fork handlers hung such a fork in a parent with live channels)."""
    import os
    import subprocess
    import sys
    import time

    parent = ("import subprocess, sys\n"
              "from skippy_stage.cli.local import stage_environment\n"
              f"p = subprocess.Popen([sys.executable, '-c', {_CHILD!r}], env=stage_environment())\n"
              "print(p.pid, flush=True)\n"
              "import time; time.sleep(1.5)\n")  # long enough for the child to arm its signal
    run = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    child = int(run.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, 9)
    raise AssertionError("the stage outlived the process that started it")


def test_a_stage_whose_starter_is_already_gone_stops_at_once():
    import os
    import subprocess
    import sys

    env = {**os.environ, "SKIPPY_DIE_WITH_PARENT": "1"}  # not our parent: it died before we armed the signal
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, timeout=30)
    assert run.returncode == -15


def test_co_located_stages_whose_threads_exceed_the_cores_share_one_compute_lock(monkeypatch, tmp_path):
    """Two stages computing at once, each on every core, wait for each other's threads at every
    barrier: every stage of such a split gets the same lock file, so they take turns; stages that fit
    the cores together get none; an operator's value wins. The pipeline removes the file when it
    stops."""
    from skippy_stage.cli.local import pipeline_configs, remove_launcher_locks

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    ranges = [(0, 10), (10, 20), (20, 30)]

    def locks(**extra):
        configs = pipeline_configs("m.gguf", ranges, host="127.0.0.1", ports=[5, 6, 7], extra=extra)
        return {cfg.get("compute_lock_path") for cfg in configs}

    (shared,) = locks(n_threads=4)
    assert shared is not None and shared.endswith(".compute.lock") and "-5." in shared
    assert locks(n_threads=3) == {shared}  # 3 + 3 threads on 4 cores
    assert locks(n_threads=2) == {None}  # 2 + 2: they fit
    assert locks(n_threads=1, n_threads_batch=2) == {None}
    assert locks(n_threads=1, n_threads_batch=4) == {shared}  # a prompt's threads count
    assert locks() == {shared}  # unset: every core, as a stage has it
    assert locks(n_threads=4, compute_lock_path=None) == {None}

    own = tmp_path / "operator.lock"
    own.write_text("")
    configs = pipeline_configs("m.gguf", ranges, host="127.0.0.1", ports=[5, 6, 7], extra={"n_threads": 4})
    Path(shared).write_text("")
    remove_launcher_locks([*configs, {"stage_index": 0, "bind_addr": "127.0.0.1:9", "compute_lock_path": str(own)}])
    assert not Path(shared).exists() and own.exists(), "the launcher's lock goes, an operator's stays"
