"""Cut a link: two stages in separate network namespaces, and the cable between them pulled.

The test builds its own network: namespaces ``a`` and ``b`` joined by a veth pair with a
private /30 that exists only inside them. Stage-1 (layers 15:30) serves in ``b`` on its veth
address; the head, stage-0 (layers 0:15), serves in ``a`` and forwards to ``b``. Clients run
in ``a`` (``ip netns exec``) and reach the head on loopback.

With a generation under way the veth in ``a`` is taken down: no packet passes, nothing is
reset. The generation must end with UNAVAILABLE or DEADLINE_EXCEEDED within its deadline
(keepalive notices a silent peer in ~15 s), every process must still answer GetStatus, the
head must say NOT_SERVING; with the link back the head is SERVING again, a new generation
succeeds, and no stage keeps a session (the head retries the drop of the one stranded below
the cut once the link answers again).

Needs root and ``ip netns``; skipped otherwise, saying why.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLIENT = r'''
"""Runs inside a namespace: ``serve`` answers JSON requests on stdin; ``generate`` streams."""
import json
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc


def emit(obj):
    print(json.dumps(obj), flush=True)


def answer(req):
    with grpc.insecure_channel(req["endpoint"]) as channel:
        if req["op"] == "status":
            s = pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=req["timeout"])
            return {"ok": True, "state": s.state, "active_sessions": s.active_sessions,
                    "downstream_ok": s.downstream_ok, "downstream_error": s.downstream_error}
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                      timeout=req["timeout"])
        return {"ok": True, "status": health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}


def serve():
    for line in sys.stdin:
        try:
            emit(answer(json.loads(line)))
        except grpc.RpcError as err:
            emit({"ok": False, "code": err.code().name, "details": err.details()})


def generate(endpoint, prompt, max_tokens, timeout):
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        try:
            for msg in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=timeout):
                if msg.done:
                    emit({"done": True, "completion_tokens": msg.completion_tokens})
                else:
                    emit({"piece": msg.text})
        except grpc.RpcError as err:
            emit({"error": err.code().name, "details": err.details()})


if sys.argv[1] == "serve":
    serve()
else:
    generate(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
'''

PROMPT = "Here is a short poem about the sea:\n"
HEAD_PORT, TAIL_PORT = 7000, 7001
CALL_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Net:
    """Two namespaces joined by a veth pair; everything here lives inside them."""

    def __init__(self) -> None:
        tag = f"skippy-{os.getpid()}"
        self.a, self.b = f"{tag}-a", f"{tag}-b"
        self.veth_a, self.veth_b = f"sk{os.getpid()}a", f"sk{os.getpid()}b"
        subnet = os.getpid() % 64 * 4  # a /30 inside 10.231.0.0/24; private to our namespaces anyway
        self.addr_a, self.addr_b = f"10.231.0.{subnet + 1}", f"10.231.0.{subnet + 2}"
        self.created: list[str] = []

    def create(self) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "add", ns)
            self.created.append(ns)
        # Made inside a and moved straight to b: the root namespace never sees either end.
        _ip("-n", self.a, "link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b, "netns", self.b)
        _ip("-n", self.a, "addr", "add", f"{self.addr_a}/30", "dev", self.veth_a)
        _ip("-n", self.b, "addr", "add", f"{self.addr_b}/30", "dev", self.veth_b)
        for ns, veth in ((self.a, self.veth_a), (self.b, self.veth_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", veth, "up")

    def link(self, up: bool) -> None:
        _ip("-n", self.a, "link", "set", self.veth_a, "up" if up else "down")

    def destroy(self) -> None:
        for ns in self.created:
            _ip("netns", "del", ns, check=False)


def _netns_unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating network namespaces needs root; this test runs as a non-root user"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"skippy-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Lines:
    """A subprocess's stdout lines as JSON, each stamped with the monotonic time it arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.queue.put((time.monotonic(), json.loads(line)))
        self.queue.put((time.monotonic(), None))

    def next(self, timeout: float) -> tuple[float, dict | None]:
        return self.queue.get(timeout=timeout)


class Client:
    """A request/response client process inside one namespace (GetStatus, Health)."""

    def __init__(self, ns: str, script: Path) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script), "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines = Lines(self.proc)

    def ask(self, op: str, endpoint: str, timeout: float = 3.0) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "endpoint": endpoint, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        _, reply = self.lines.next(timeout + 15)
        assert reply is not None, f"the {op} client in its namespace exited"
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f}s")
        time.sleep(interval_s)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cutting_the_link_between_two_stages_fails_fast_hangs_nothing_and_heals(smollm2, slice_cache, tmp_path):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    net = Net()
    script = tmp_path / "netns_client.py"
    script.write_text(CLIENT)
    common = {"model_path": str(smollm2), "cache_dir": str(slice_cache), "n_threads": 1, "ctx_size": 2048,
              "lane_count": 2, "recovery_wait_s": 0, "downstream_ready_timeout_s": 120, "session_idle_ttl_s": 600,
              "allow_insecure": True}  # bound to a namespace address: the test network is trusted
    head = f"127.0.0.1:{HEAD_PORT}"
    tail = f"{net.addr_b}:{TAIL_PORT}"
    configs = [
        {**common, "stage_id": "stage-0", "stage_index": 0, "layer_start": 0, "layer_end": 15,
         "bind_addr": f"0.0.0.0:{HEAD_PORT}", "downstream": {"stage_id": "stage-1", "stage_index": 1, "endpoint": tail}},
        {**common, "stage_id": "stage-1", "stage_index": 1, "layer_start": 15, "layer_end": 30, "bind_addr": tail,
         "upstream": {"stage_id": "stage-0", "stage_index": 0, "endpoint": f"{net.addr_a}:{HEAD_PORT}"}},
    ]
    stages: list[subprocess.Popen] = []
    others: list[subprocess.Popen] = []
    clients: list[Client] = []
    logs = []
    try:
        net.create()
        for cfg, ns in zip(configs, (net.a, net.b)):
            path = tmp_path / f"{cfg['stage_id']}.json"
            path.write_text(json.dumps(cfg))
            log = (tmp_path / f"{cfg['stage_id']}.log").open("w")
            logs.append(log)
            stages.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "skippy_stage", "serve", "--config", str(path)],
                stdin=subprocess.DEVNULL, stderr=log))
        in_a, in_b = Client(net.a, script), Client(net.b, script)
        clients += [in_a, in_b]

        def head_health() -> str | None:
            for cfg, proc in zip(configs, stages):
                assert proc.poll() is None, f"{cfg['stage_id']} exited with {proc.returncode}"
            reply = in_a.ask("health", head, timeout=1.0)
            return reply.get("status")

        _wait_for(lambda: head_health() == "SERVING", 120, "the head was not SERVING")

        gen = subprocess.Popen(["ip", "netns", "exec", net.a, sys.executable, str(script), "generate", head, PROMPT,
                                "900", str(CALL_TIMEOUT_S)], stdout=subprocess.PIPE, text=True)
        others.append(gen)
        out = Lines(gen)
        called_at = time.monotonic()
        pieces = 0
        while pieces < 3:
            _, msg = out.next(60)
            assert msg is not None and "piece" in msg, f"the generation did not get going: {msg}"
            pieces += 1

        net.link(up=False)
        cut_at = time.monotonic()
        while True:
            at, msg = out.next(CALL_TIMEOUT_S + 15)
            assert msg is not None, "the client exited without a result"
            if "piece" not in msg:
                break
        assert "error" in msg, f"the generation finished across a cut link: {msg}"
        to_error = at - cut_at
        print(f"\nlink cut to the client's {msg['error']}: {to_error:.2f}s "
              f"(call deadline {CALL_TIMEOUT_S:.0f}s, {cut_at - called_at:.2f}s in): {msg['details']}")
        assert msg["error"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), msg
        assert at - called_at < CALL_TIMEOUT_S + 2, "the error came after the call's deadline"
        gen.wait(10)

        # Nothing hangs: both stages answer, and the head says it cannot serve.
        head_status = in_a.ask("status", head)
        tail_status = in_b.ask("status", tail)
        assert head_status["ok"] and tail_status["ok"], (head_status, tail_status)
        assert not head_status["downstream_ok"], head_status
        _wait_for(lambda: head_health() == "NOT_SERVING", 5, "the head did not report NOT_SERVING")
        print(f"while cut: head {head_status}; stage-1 {tail_status}")

        net.link(up=True)
        restored_at = time.monotonic()
        _wait_for(lambda: head_health() == "SERVING", 30, "the head was not SERVING again after the link came back")
        print(f"link restored to head SERVING: {time.monotonic() - restored_at:.2f}s")

        again = subprocess.run(["ip", "netns", "exec", net.a, sys.executable, str(script), "generate", head, PROMPT,
                                "16", "60"], capture_output=True, text=True, timeout=90)
        results = [json.loads(line) for line in again.stdout.splitlines()]
        assert results and results[-1].get("done"), f"a generation after the restore failed: {results[-1:]}"
        assert results[-1]["completion_tokens"] == 16

        # No stage keeps a session: the drop of the one stranded on stage-1 by the cut is retried
        # once the link answers again (the idle TTL, 600 s here, is not what frees it).
        def active() -> list[int]:
            return [in_a.ask("status", head)["active_sessions"], in_b.ask("status", tail)["active_sessions"]]

        print(f"active sessions after the restore: {active()}")
        _wait_for(lambda: active() == [0, 0], 15, "a stage still holds a session", interval_s=0.5)
        for cfg, proc in zip(configs, stages):
            assert proc.poll() is None, f"{cfg['stage_id']} exited with {proc.returncode}"
    except BaseException:
        for log in logs:
            log.flush()
            print(f"--- {log.name} (tail)\n" + "".join(Path(log.name).read_text().splitlines(True)[-15:]))
        raise
    finally:
        for client in clients:
            client.close()
        _stop(others + stages)
        for log in logs:
            log.close()
        net.destroy()
