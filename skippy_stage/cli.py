"""The ``skippy-stage`` command: serve, up, generate, demo, slice, check, info.

Logs go to stderr, results (generated text, the head endpoint) to stdout. A failure at
start exits non-zero with one line that names the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from skippy_stage import logs
from skippy_stage.errors import SkippyError

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def _parse_layers(text: str) -> list[tuple[int, int]]:
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


def _free_ports(host: str, n: int) -> list[int]:
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def pipeline_configs(model: str, ranges: list[tuple[int, int]], *, host: str, ports: list[int],
                     extra: dict[str, object], return_path: str = "direct") -> list[dict[str, object]]:
    """One StageConfig dict per range, chained upstream to downstream on the given ports.

    ``return_path="direct"``: the final stage also sends sampled tokens straight to the head.
    """
    configs = []
    for i, (start, end) in enumerate(ranges):
        endpoint = lambda j: f"{host}:{ports[j]}"  # noqa: E731
        cfg: dict[str, object] = {
            "run_id": extra.get("run_id", "local"), "model_path": model, "stage_id": f"stage-{i}", "stage_index": i,
            "layer_start": start, "layer_end": end, "bind_addr": endpoint(i),
        }
        cfg.update({k: v for k, v in extra.items() if k != "run_id"})
        if i > 0:
            cfg["upstream"] = {"stage_id": f"stage-{i - 1}", "stage_index": i - 1, "endpoint": endpoint(i - 1)}
        if i + 1 < len(ranges):
            cfg["downstream"] = {"stage_id": f"stage-{i + 1}", "stage_index": i + 1, "endpoint": endpoint(i + 1)}
        elif i > 0 and return_path == "direct":
            cfg["return_to"] = {"stage_id": "stage-0", "stage_index": 0, "endpoint": endpoint(0)}
        configs.append(cfg)
    return configs


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies (Linux), so a crashed or killed
    ``up``/``bench`` never leaves stages running, holding ports and its output pipes open.
    (Linux sends it when the *thread* that started the child ends: start stages from a
    thread that outlives them, as the CLI and the tests do.)"""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class LocalPipeline:
    """``serve`` processes for a split on loopback; stopped together."""

    def __init__(self, configs: list[dict[str, object]], workdir: Path, *, log_dir: Path | None = None,
                 log_level: str | None = None) -> None:
        """``log_dir``: write each stage's stderr to ``<stage_id>.log`` there instead of ours."""
        self.configs = configs
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
                [sys.executable, "-m", "skippy_stage", *(["--log-level", log_level] if log_level else []),
                 "serve", "--config", str(path)],
                stdin=subprocess.DEVNULL, stderr=stderr, preexec_fn=_die_with_parent,
            ))

    def restart(self, index: int) -> None:
        """Start stage ``index`` again with its config (after it died or was killed)."""
        old = self.procs[index]
        if old.poll() is None:
            raise SkippyError(f"stage {self.configs[index]['stage_id']} is still running")
        self.procs[index] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                             stderr=self.log_files[index] if self.log_files else None)

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
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self.log_files:
            f.close()


def _start_pipeline(args: argparse.Namespace, workdir: Path) -> LocalPipeline:
    from skippy_stage.slicing import read_model_info

    info = read_model_info(args.model)
    ranges = _parse_layers(args.layers) if args.layers else even_split(info.block_count, args.stages)
    ports = [args.base_port + i for i in range(len(ranges))] if args.base_port else _free_ports(args.host, len(ranges))
    extra: dict[str, object] = {"lane_count": args.lanes}
    if args.ctx_size is not None:
        extra["ctx_size"] = args.ctx_size
    if args.wire_dtype:
        extra["wire_dtype"] = args.wire_dtype
    # Local stages share this machine's cores. With GOMP_SPINCOUNT bounded (skippy_stage
    # sets it) an idle stage's threads sleep, so each stage may use every core while it
    # computes: on 2 cores, 3 stages decode in 15.3 ms/token with 2 threads each vs 19.6 with
    # 1, and prefill twice as fast (`skippy-stage bench`, SKIPPY_BENCH_STAGE_THREADS).
    extra["n_threads"] = args.threads or (os.cpu_count() or 1)
    configs = pipeline_configs(str(args.model), ranges, host=args.host, ports=ports, extra=extra,
                               return_path=args.return_path)
    if getattr(args, "http_port", None) is not None:
        configs[0]["http_port"] = args.http_port
    pipeline = LocalPipeline(configs, workdir, log_level=getattr(args, "stage_log_level", None))
    try:
        pipeline.wait_serving(args.start_timeout)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline


def _client_credentials(args: argparse.Namespace):  # noqa: ANN202
    """TLS material and token for a client, from --tls-ca/--tls-cert/--tls-key/--token-file."""
    from skippy_stage.security import Credentials

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    cert = read(args.tls_cert)
    ca = read(args.tls_ca)
    return Credentials(cert=cert, key=read(args.tls_key), ca=ca, token=token)


def _generate(endpoint: str, prompt: str, *, max_tokens: int, temperature: float, seed: int | None,
              chat: bool, out=sys.stdout, credentials=None) -> dict[str, float]:  # noqa: ANN001
    import grpc

    from skippy_stage.security import Credentials
    from skippy_stage.v1 import stage_pb2 as pb
    from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    request = pb.GenerateRequest(max_tokens=max_tokens, sampling=sampling)
    if chat:
        request.messages.append(pb.ChatMessage(role="user", content=prompt))
    else:
        request.prompt = prompt
    started = time.perf_counter()
    first = None
    final = None
    credentials = credentials or Credentials()
    with credentials.channel(endpoint, []) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        try:
            for msg in stub.Generate(request, timeout=600, metadata=credentials.call_metadata()):
                if msg.text:
                    if first is None:
                        first = time.perf_counter() - started
                    out.write(msg.text)
                    out.flush()
                if msg.done:
                    final = msg
        except grpc.RpcError as err:
            raise SkippyError(f"Generate failed: {err.code().name}: {err.details()}") from None
    elapsed = time.perf_counter() - started
    n = final.completion_tokens if final else 0
    return {"ttft_s": first or elapsed, "seconds": elapsed, "completion_tokens": n,
            "tokens_per_s": (n - 1) / max(elapsed - (first or 0), 1e-9) if n > 1 else 0.0}


def cmd_serve(args: argparse.Namespace) -> int:
    from skippy_stage.config import load_config
    from skippy_stage.service import serve

    config = load_config(args.config)
    if args.http_port is not None:
        config = config.replace(http_port=args.http_port)
    logs.configure(args.log_level, static={"stage_id": config.stage_id, "run_id": config.run_id})
    return serve(config, grace_s=args.grace)


def cmd_up(args: argparse.Namespace) -> int:
    stop = {"now": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="skippy-up-") as tmp:
        pipeline = _start_pipeline(args, Path(tmp))
        print(pipeline.head_endpoint, flush=True)
        if args.http_port is not None:
            print(f"# OpenAI-compatible API at http://{args.host}:{args.http_port}/v1", file=sys.stderr, flush=True)
        try:
            while not stop["now"]:
                for cfg, proc in zip(pipeline.configs, pipeline.procs):
                    if proc.poll() is not None:
                        raise SkippyError(f"stage {cfg['stage_id']} exited with code {proc.returncode}")
                time.sleep(0.5)
        finally:
            pipeline.stop()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    _generate(args.endpoint, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
              seed=args.seed, chat=args.chat, credentials=_client_credentials(args))
    if sys.stdout.isatty():
        sys.stdout.write("\n")  # only for people: piped output is exactly the generated text
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from skippy_stage.models import smollm2_path

    args.model = str(smollm2_path())
    args.layers = None
    args.stages = 3
    args.stage_log_level = "warning"  # the answer, not the stages' request logs, on the terminal
    with tempfile.TemporaryDirectory(prefix="skippy-demo-") as tmp:
        started = time.perf_counter()
        pipeline = _start_pipeline(args, Path(tmp))
        print(f"# 3-stage SmolLM2-135M pipeline up in {time.perf_counter() - started:.1f}s; head at "
              f"{pipeline.head_endpoint}", file=sys.stderr)
        try:
            print(f"> {args.prompt}", flush=True)
            figures = _generate(pipeline.head_endpoint, args.prompt, max_tokens=args.max_tokens,
                                temperature=0.0, seed=None, chat=True)
            print(flush=True)
            print(f"# time to first token {figures['ttft_s'] * 1e3:.0f} ms, "
                  f"{figures['completion_tokens']} tokens at {figures['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        finally:
            pipeline.stop()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from skippy_stage.bench import format_table, run

    report = run(args.json)
    print(format_table(report))
    if args.json:
        print(f"# JSON written to {args.json}", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from skippy_stage.preflight import effective_config

    config, ctx_reason = effective_config(args.config)
    print(f"# {args.config}: stage {config.stage_id} would serve layers {config.layer_start}:{config.layer_end}; "
          f"ctx_size from {ctx_reason}", file=sys.stderr)
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from skippy_stage.preflight import format_info, info_report

    report = info_report()
    print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 0


def cmd_slice(args: argparse.Namespace) -> int:
    from skippy_stage.slicing import read_model_info, stage_file, write_slice

    (start, end), = _parse_layers(args.layers)
    final = args.final or end == read_model_info(args.model).block_count
    if args.out:
        write_slice(args.model, args.out, start, end, final=final)
        print(args.out)
    else:
        print(stage_file(args.model, start, end, final=final).path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skippy-stage", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("SKIPPY_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one stage daemon")
    p.add_argument("--config", required=True, help="StageConfig JSON file")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain in-flight work on SIGTERM")
    p.add_argument("--http-port", type=int, default=None, help="serve the OpenAI-compatible API here (head only)")
    p.set_defaults(func=cmd_serve)

    def pipeline_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--base-port", type=int, default=0, help="first stage's port (default: free ports)")
        p.add_argument("--ctx-size", type=int, default=None,
                       help="KV cells per stage (default: the model's training context, capped by memory)")
        p.add_argument("--lanes", type=int, default=4)
        p.add_argument("--threads", type=int, default=0, help="llama.cpp threads per stage (default: all cores)")
        p.add_argument("--wire-dtype", choices=("f32", "f16", "bf16", "int8"), default=None)
        p.add_argument("--start-timeout", type=float, default=300.0)
        p.add_argument("--return-path", choices=("relay", "direct"), default="direct",
                       help="sampled tokens back to the head through every stage (relay) or also straight "
                            "from the final stage (direct)")

    p = sub.add_parser("up", help="start one serve process per stage on loopback")
    p.add_argument("--model", required=True)
    p.add_argument("--http-port", type=int, default=None, help="the head's OpenAI-compatible API port")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--stages", type=int)
    group.add_argument("--layers", help="e.g. 0:10,10:20,20:30")
    pipeline_args(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("generate", help="stream a generation from a head stage")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat user message")
    p.add_argument("--tls-ca", help="CA certificate to verify the head with (TLS)")
    p.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", help="client key (mutual TLS)")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the packaged SmolLM2 in 3 local stages, one generation")
    p.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    pipeline_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="measure the split's cost against the unsplit model, in one run")
    p.add_argument("--json", help="also write the figures as JSON here")
    p.set_defaults(func=cmd_bench)

    from skippy_stage.planner import add_plan_parser

    add_plan_parser(sub)

    p = sub.add_parser("check", help="validate a stage config here and print it with every default filled in")
    p.add_argument("--config", required=True, help="StageConfig JSON file")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("info", help="versions, CPU features, devices and loader policy, for bug reports")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("slice", help="write the GGUF of one layer range")
    p.add_argument("model")
    p.add_argument("--layers", required=True, help="START:END")
    p.add_argument("--final", action="store_true", help="keep the output head (implied when END is the last layer)")
    p.add_argument("--out", help="write here instead of the cache")
    p.set_defaults(func=cmd_slice)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        return args.func(args)
    except SkippyError as exc:
        print(f"skippy-stage {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
