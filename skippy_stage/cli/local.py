"""A split on this machine: one ``serve`` process per stage on loopback, chained.

``up``, ``demo``, ``bench`` and the tests start pipelines here; the chain wiring (who is
upstream, downstream and the head of whom) is written once, in :func:`pipeline_configs`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from skippy_stage.config import chain_links, shared_host_openmp
from skippy_stage.errors import SkippyError

if TYPE_CHECKING:
    import argparse

    from skippy_stage.ops.link import ChainRelays, Link


def stage_environment() -> dict[str, str]:
    """The environment of a ``serve`` process started here, beside other stages: OpenMP's spin
    count and thread binding for a shared host (unless the operator set their own), and who to
    die with."""
    return {**os.environ, **shared_host_openmp(dict(os.environ)), PARENT_ENV: str(os.getpid())}


def child_python(code: str) -> list[str]:
    """The command that runs ``code`` in a Python started here, importing what this interpreter
    has installed and never the current directory: ``python -m``/``-c`` put the working directory
    first on the path, so run from a source checkout (where the compiled parts are not built) a
    stage imported the checkout and ran every frame the slow way. Python's safe-path mode (-P,
    3.11+) leaves it off; before 3.11 the code drops it itself."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-c", code]
    return [sys.executable, "-c", "import sys; del sys.path[0]; " + code]


def stage_command(*args: str) -> list[str]:
    """``skippy-stage ARGS`` as a process started here (see :func:`child_python`)."""
    return [*child_python("import sys; from skippy_stage.cli.commands import main; sys.exit(main())"), *args]


def parse_layers(text: str) -> list[tuple[int, int]]:
    ranges = []
    for part in text.split(","):
        a, sep, b = part.partition(":")
        if not sep or not a.strip().isdigit() or not b.strip().isdigit():
            raise SkippyError(f"--layers part {part!r} must be START:END")
        ranges.append((int(a), int(b)))
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        if end != start:
            raise SkippyError(f"--layers ranges must be contiguous: {end} is followed by {start}")
    return ranges


def even_split(block_count: int, stages: int) -> list[tuple[int, int]]:
    if not 1 <= stages <= block_count:
        raise SkippyError(f"--stages {stages} must be between 1 and the model's {block_count} layers")
    cuts = [round(i * block_count / stages) for i in range(stages + 1)]
    return list(zip(cuts, cuts[1:]))


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


# Where free_ports looks first: below the kernel's ephemeral range (read at run time).
_LISTEN_PORTS_FROM = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(host: str, n: int) -> list[int]:
    """n ports nobody listens on now, and that this process has not handed out before.

    The ports are free only until someone binds them: two calls made before the first
    caller's servers bind (a pipeline's stage ports, then its metrics or HTTP ports) could
    otherwise get the same port back, and one stage would fail to start with "Address already
    in use". They are taken below the kernel's ephemeral range where it leaves room: a port the
    kernel picks for ``bind(0)`` comes from the range every outgoing connection also draws from,
    and a stage started a while later (a stand-in, after its pipeline's stages had connected to
    each other) found its port taken by such a connection.
    """
    sockets = []
    ports: list[int] = []
    low, _ = _ephemeral_range()
    below = low > _LISTEN_PORTS_FROM + 1000  # room below the ephemeral range
    rng = random.Random()
    try:
        with _handed_out_lock:
            for attempt in range(n + 1000):
                if len(ports) == n:
                    break
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                sockets.append(s)  # held until the end, so nothing here can get it again now
                # below the ephemeral range first; the kernel's pick once that keeps failing
                wanted = rng.randrange(_LISTEN_PORTS_FROM, low) if below and attempt < 500 else 0
                try:
                    s.bind((host, wanted))
                except OSError:
                    continue
                port = s.getsockname()[1]
                if port not in _handed_out:
                    ports.append(port)
            if len(ports) < n:
                raise SkippyError(f"could not find {n} free ports on {host}")
            _handed_out.update(ports)
        return ports
    finally:
        for s in sockets:
            s.close()


def pipeline_configs(model: str, ranges: list[tuple[int, int]], *, host: str, ports: list[int],
                     extra: dict[str, object], return_path: str = "direct") -> list[dict[str, object]]:
    """One StageConfig dict per range, chained upstream to downstream on the given ports.

    ``return_path="direct"``: the final stage also sends sampled tokens straight to the head.
    """
    endpoints = [f"{host}:{ports[i]}" for i in range(len(ranges))]
    links = chain_links([f"stage-{i}" for i in range(len(ranges))], endpoints, direct_return=return_path == "direct")
    configs = []
    for i, (start, end) in enumerate(ranges):
        cfg: dict[str, object] = {
            "run_id": extra.get("run_id", "local"), "model_path": model, "stage_id": f"stage-{i}", "stage_index": i,
            "layer_start": start, "layer_end": end, "bind_addr": endpoints[i],
        }
        cfg.update({k: v for k, v in extra.items() if k != "run_id"})
        cfg.update(links[i])
        configs.append(cfg)
    if "compute_lock_path" not in extra and oversubscribed(configs):
        for cfg in configs:
            cfg["compute_lock_path"] = str(launcher_lock(ports[0]))
    return configs


def launcher_lock(port: int) -> Path:
    """The compute lock file of the split whose head listens on ``port`` (``oversubscribed``)."""
    return Path(tempfile.gettempdir()) / f"skippy-stage-{os.getuid()}-{port}.compute.lock"


def remove_launcher_locks(configs: list[dict[str, object]]) -> None:
    """Remove the compute lock files :func:`pipeline_configs` named for ``configs`` (an operator's
    own lock file stays: other processes may hold it)."""
    for cfg in configs:
        lock, bind = cfg.get("compute_lock_path"), str(cfg.get("bind_addr", ""))
        port = bind.rpartition(":")[2]
        if cfg.get("stage_index") == 0 and port.isdigit() and lock == str(launcher_lock(int(port))):
            Path(lock).unlink(missing_ok=True)


def oversubscribed(configs: list[dict[str, object]]) -> bool:
    """Whether stages on one host would run more threads at once than it has cores, were two of them
    to compute at the same time. Then they share a compute lock (``compute_lock_path``) and take
    turns: two stages computing together, each bound to every core, wait for each other's threads at
    every barrier of the graph. Measured with a 3-stage SmolLM2 split on 2 cores (2 threads each, an
    AMD EPYC), a prompt's chunks in flight without the lock: a 1,025-token prompt's first token
    came after 4.3 s with one chunk in flight and 8.8-11.7 s with four."""
    cores = os.cpu_count() or 1
    threads = [int(cfg.get("n_threads_batch") or cfg.get("n_threads") or cores) for cfg in configs]
    return len(configs) > 1 and sum(sorted(threads)[-2:]) > cores


def add_link_flags(p: argparse.ArgumentParser) -> None:
    """--link-delay-ms/--link-jitter-ms/--link-mbit: every edge of a local chain through the link
    emulator (``skippy_stage.ops.link``)."""
    p.add_argument("--link-delay-ms", type=float, default=None, metavar="D",
                   help="TEST TOOL, never a production path: emulate a link of D ms one-way on every edge of the "
                        "chain (frames down, the return to the head; both transports), through a relay in this "
                        "process")
    p.add_argument("--link-jitter-ms", type=float, default=0.0, metavar="J",
                   help="with --link-delay-ms: up to J ms more per chunk, uniformly drawn (bytes never reorder)")
    p.add_argument("--link-mbit", type=float, default=None, metavar="M",
                   help="with --link-delay-ms: cap each edge at M Mbit/s each way")


def emulate_links(configs: list[dict[str, object]], args: argparse.Namespace) -> ChainRelays | None:
    """With --link-delay-ms: :func:`relay_links` with the flags' link (and a line on stderr saying
    so); else None."""
    delay_ms = getattr(args, "link_delay_ms", None)
    if delay_ms is None:
        if getattr(args, "link_jitter_ms", 0.0) or getattr(args, "link_mbit", None) is not None:
            raise SkippyError("--link-jitter-ms and --link-mbit need --link-delay-ms (0 for none)")
        return None
    from skippy_stage.ops.link import Link

    for flag, value in (("--link-delay-ms", delay_ms), ("--link-jitter-ms", args.link_jitter_ms)):
        if not 0 <= value < 3_600_000:
            raise SkippyError(f"{flag} {value:g} must be a number of milliseconds >= 0")
    if args.link_mbit is not None and not args.link_mbit > 0:
        raise SkippyError(f"--link-mbit {args.link_mbit:g} must be > 0")
    link = Link.from_ms(delay_ms, args.link_jitter_ms, args.link_mbit)
    relays = relay_links(configs, link)
    print(f"# link emulator (a test tool): every edge {link.describe()}", file=sys.stderr, flush=True)
    return relays


def relay_links(configs: list[dict[str, object]], link: Link) -> ChainRelays:
    """A relay through ``link`` for every edge of the local chain ``configs`` describes, and the
    configs pointed at them (``downstream``, ``return_to``; in place). Each stage's frame listener
    gets a fixed port (``frame_port``), which its relay forwards beside its gRPC port. Close the
    relays after the stages have stopped (``LocalPipeline`` does)."""
    from skippy_stage.ops.link import relay_chain

    endpoints = [str(cfg["bind_addr"]) for cfg in configs]
    host = endpoints[0].rpartition(":")[0].strip("[]")
    frame_ports: list[int] = []
    for cfg, spare in zip(configs, free_ports(host, len(configs))):
        port = cfg.get("frame_port")
        frame_ports.append(port if isinstance(port, int) else spare)
        cfg["frame_port"] = frame_ports[-1]
    relays = relay_chain(endpoints, link, frame_ports=frame_ports,
                         direct_return=any("return_to" in cfg for cfg in configs))
    for cfg, endpoint in zip(configs, relays.downstream):
        cfg["downstream"] = _at(cfg["downstream"], endpoint)
    if relays.return_to is not None:
        configs[-1]["return_to"] = _at(configs[-1]["return_to"], relays.return_to)
    return relays


def _at(peer: object, endpoint: str) -> dict[str, object]:
    """A peer entry of a config (``downstream``, ``return_to``) reached at ``endpoint`` instead."""
    assert isinstance(peer, dict), peer
    return {**peer, "endpoint": endpoint}


# Set in a stage's environment by whoever starts it here: that process's id (see die_with_parent).
PARENT_ENV = "SKIPPY_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """In a stage started here, first thing: SIGTERM when the process that started it dies
    (Linux), so a crashed or killed ``up``/``bench`` never leaves stages running, holding ports
    and its output pipes open. (Linux sends it when the *thread* that started the child ends:
    start stages from a thread that outlives them, as the CLI and the tests do.)

    Done by the child after exec, not in a ``preexec_fn``: a fork with a function to run makes
    Python fork for real, and grpcio's fork handlers in a parent with live channels hung that
    fork for good (seen in the test run: the parent stuck inside ``fork()``); without one Python
    uses vfork, which runs no fork handlers. A parent that died before this ran is caught by
    comparing the parent's id."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


class LocalPipeline:
    """``serve`` processes for a split on loopback; stopped together."""

    def __init__(self, configs: list[dict[str, object]], workdir: Path, *, log_dir: Path | None = None,
                 log_level: str | None = None, links: ChainRelays | None = None) -> None:
        """``log_dir``: write each stage's stderr to ``<stage_id>.log`` there instead of ours.
        ``links``: the relays of an emulated link (:func:`emulate_links`), closed by :meth:`stop`."""
        self.configs = configs
        self.links = links
        self.procs: list[subprocess.Popen] = []
        self.log_files = []
        for cfg in configs:
            path = workdir / f"{cfg['stage_id']}.json"
            path.write_text(json.dumps(cfg, indent=1))
            stderr = None
            if log_dir is not None:
                stderr = (log_dir / f"{cfg['stage_id']}.log").open("w")
                self.log_files.append(stderr)
            self.procs.append(subprocess.Popen(
                stage_command(*(["--log-level", log_level] if log_level else []), "serve", "--config", str(path)),
                stdin=subprocess.DEVNULL, stderr=stderr, env=stage_environment(),
            ))

    def restart(self, index: int) -> None:
        """Start stage ``index`` again with its config (after it died or was killed)."""
        old = self.procs[index]
        if old.poll() is None:
            raise SkippyError(f"stage {self.configs[index]['stage_id']} is still running")
        self.procs[index] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL,
                                             stderr=self.log_files[index] if self.log_files else None,
                                             env=stage_environment())

    @property
    def head_endpoint(self) -> str:
        return str(self.configs[0]["bind_addr"])

    def wait_serving(self, timeout_s: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from skippy_stage.config import StageConfig
        from skippy_stage.security import Credentials

        deadline = time.monotonic() + timeout_s
        credentials = Credentials.from_config(StageConfig.from_dict(self.configs[0]))
        with credentials.channel(self.head_endpoint, []) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                for cfg, proc in zip(self.configs, self.procs):
                    if proc.poll() is not None:
                        raise SkippyError(f"stage {cfg['stage_id']} exited with code {proc.returncode} during start-up")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise SkippyError(f"the pipeline was not SERVING within {timeout_s:.0f}s")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the head first and to each stage once the one above it has gone (within
        ``grace_s`` in all): the generations under way drain through a chain that still serves,
        and no stage sees the one below it close while it serves (a broken link, to it)."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.links is not None:
            self.links.close()
        for f in self.log_files:
            f.close()
        remove_launcher_locks(self.configs)
