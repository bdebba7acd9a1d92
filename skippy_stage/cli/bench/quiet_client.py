"""The decode figures' client, kept off the stages' cores: a process of its own at nice 19
(``QuietClient``), or one that reads nothing until the end, its figure taken at the head
(``QuietClient.held``)."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from skippy_stage.cli.bench.pipeline import _Pipeline
from skippy_stage.cli.bench.readings import _scrape, thread_times
from skippy_stage.cli.client import generate


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
    """The quiet client's process: lowest CPU priority, then one request per JSON line read (an
    object: endpoint, prompt, max_tokens, stream_interval_ms, hold, speculative, sessions), each
    answered by a JSON line (ok, figures or error). ``hold``: the process stops itself at the first
    text (``_StopAtFirstText``). ``sessions``: that many Generate calls at once, one thread each
    (``_concurrent``). The figures of one call carry its ``text``."""
    os.nice(19)
    replies, sys.stdout = sys.stdout, sys.stderr  # nothing but replies on the pipe
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = [True, _concurrent(request) if "sessions" in request else _one(request)]
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises it
            answer = [False, f"{type(exc).__name__}: {exc}"]
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


def _one(request: dict) -> dict[str, object]:
    out = _StopAtFirstText() if request.get("hold") else io.StringIO()
    figures = generate(request["endpoint"], request["prompt"], max_tokens=request["max_tokens"], temperature=0.0,
                       seed=None, chat=False, out=out, stream_interval_ms=request.get("stream_interval_ms"),
                       speculative=request.get("speculative"))
    return {**figures, "text": out.getvalue()}


def _concurrent(request: dict) -> dict[str, object]:
    """``sessions`` greedy generations of the same prompt at once: tokens over the wall time from
    the first request to the last answer, and each session's text."""
    done: list[dict[str, object]] = []
    failed: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            figures = _one({**request, "hold": False})
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            with lock:
                failed.append(exc)
            return
        with lock:
            done.append(figures)

    threads = [threading.Thread(target=run) for _ in range(request["sessions"])]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    if failed:
        raise failed[0]
    tokens = sum(int(figures["completion_tokens"]) for figures in done)
    return {"completion_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "texts": [figures["text"] for figures in done]}


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
            [sys.executable, "-c", "from skippy_stage.cli.bench.quiet_client import quiet_client_loop; quiet_client_loop()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def generate(self, endpoint: str, prompt: str, max_tokens: int, stream_interval_ms: int | None = None,
                 speculative: dict[str, object] | None = None) -> dict[str, float]:
        """One greedy generation's figures (``client.generate``'s) and its ``text``."""
        return self._ask({"endpoint": endpoint, "prompt": prompt, "max_tokens": max_tokens,
                          "stream_interval_ms": stream_interval_ms, "speculative": speculative})

    def concurrent(self, endpoint: str, prompt: str, max_tokens: int, sessions: int) -> dict[str, object]:
        """``sessions`` greedy generations of ``prompt`` at once: ``completion_tokens`` in all,
        ``seconds`` (the first request to the last answer), ``tokens_per_s`` and each one's text
        (``texts``)."""
        return self._ask({"endpoint": endpoint, "prompt": prompt, "max_tokens": max_tokens, "sessions": sessions})

    def _ask(self, request: dict[str, object]) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return self._reply()

    def held(self, head: HeadProbe, prompt: str, max_tokens: int) -> dict[str, float]:
        """A streamed generation whose client reads nothing between its first text and the end:
        the client's process is stopped meanwhile, the messages wait in its socket, and the head's
        own figure (``skippy_time_per_output_token_seconds``) gives the decode speed — as with a
        client on another host, whose CPU is not the stages'. The head's stream is unchanged: it
        still hands gRPC one message per token."""
        before = head.tpot()
        self._proc.stdin.write(json.dumps({"endpoint": head.endpoint, "prompt": prompt, "max_tokens": max_tokens,
                                           "hold": max_tokens > 1}) + "\n")
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
