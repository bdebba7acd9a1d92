"""The ``skippy-stage`` command: one stage daemon, local pipelines, and what measures and proves them.

Subcommands: serve, up, generate, demo, bench, profile, floor, ab, plan, slice, package, make-projector, verify,
replay, check, info.

Logs go to stderr, results (generated text, the head endpoint) to stdout. A failure at
start exits non-zero with one line that names the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from skippy_stage import logs
from skippy_stage.cli.client import add_speculative_flags, client_credentials, generate, speculative_flags
from skippy_stage.cli.local import (
    LocalPipeline,
    add_link_flags,
    emulate_links,
    even_split,
    free_ports,
    parse_layers,
    pipeline_configs,
)
from skippy_stage.cli.settings import apply_settings
from skippy_stage.config import WIRE_DTYPES, StageConfig
from skippy_stage.errors import SkippyError

if TYPE_CHECKING:
    from skippy_stage.cli.bench import BenchPlan

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


def _start_pipeline(args: argparse.Namespace, workdir: Path) -> LocalPipeline:
    from skippy_stage.model.slicing import read_model_info

    extra: dict[str, object] = {"lane_count": args.lanes}
    if getattr(args, "package", None):
        model, block_count = "", _package_fields(args, extra)
    else:
        model, block_count = str(args.model), read_model_info(args.model).block_count
    ranges = parse_layers(args.layers) if args.layers else even_split(block_count, args.stages)
    ports = [args.base_port + i for i in range(len(ranges))] if args.base_port else free_ports(args.host, len(ranges))
    if args.ctx_size is not None:
        extra["ctx_size"] = args.ctx_size
    if args.wire_dtype:
        extra["wire_dtype"] = args.wire_dtype
    if args.cpu_wake_latency_us is not None:
        extra["cpu_wake_latency_us"] = args.cpu_wake_latency_us
    # Local stages share this machine's cores. With GOMP_SPINCOUNT bounded (LocalPipeline
    # sets it) an idle stage's threads sleep, so each stage may use every core while it
    # computes: on 2 cores, 3 stages decode in 15.3 ms/token with 2 threads each vs 19.6 with
    # 1, and prefill twice as fast (`skippy-stage bench`, SKIPPY_BENCH_STAGE_THREADS).
    extra["n_threads"] = args.threads or (os.cpu_count() or 1)
    configs = pipeline_configs(model, ranges, host=args.host, ports=ports, extra=extra,
                               return_path=args.return_path)
    if getattr(args, "http_port", None) is not None:
        configs[0]["http_port"] = args.http_port
    if getattr(args, "speculative", None) is not None or getattr(args, "draft_model", None):
        configs[0]["speculative"] = speculative_flags(args)
    configs = apply_settings(configs, args.settings)
    links = emulate_links(configs, args)
    pipeline = LocalPipeline(configs, workdir, log_level=getattr(args, "stage_log_level", None), links=links)
    try:
        pipeline.wait_serving(args.start_timeout)
    except BaseException:
        pipeline.stop()
        raise
    return pipeline


def _package_fields(args: argparse.Namespace, extra: dict[str, object]) -> int:
    """``up --package``: the stages' package fields in ``extra`` (the manifest pinned as it is now,
    unless ``--manifest-sha256`` names one); the model's block count."""
    from skippy_stage.model.package_fetch import open_package, read_manifest

    ref = args.package
    if "://" not in ref:
        ref = str(Path(ref).resolve())  # the stages may start elsewhere
    manifest, sha256 = read_manifest(open_package(ref))
    if args.manifest_sha256 and args.manifest_sha256.lower() != sha256:
        raise SkippyError(f"--manifest-sha256 {args.manifest_sha256} does not match the package: {ref}'s manifest.json "
                          f"has sha256 {sha256}")
    print(f"# package {manifest.source_file} ({manifest.architecture}, {manifest.block_count} layers), manifest "
          f"sha256 {sha256}", file=sys.stderr, flush=True)
    extra.update(package_ref=ref, manifest_sha256=sha256, load_mode="artifact-slice")
    return manifest.block_count


def _say_native_paths() -> None:
    """The first line on stderr: whether the stages about to start load the compiled parts."""
    from skippy_stage.cli.native import probe, summary

    print(f"# {summary(probe())}", file=sys.stderr, flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from skippy_stage.cli.local import die_with_parent
    from skippy_stage.config import load_config, several_teams_openmp, stage_openmp_places

    die_with_parent()
    config = load_config(args.config)
    # Before the server's import loads llama.cpp, and with it libgomp, which reads its places then.
    os.environ.update(stage_openmp_places(config.stage_index, max(config.n_threads, config.n_threads_batch or 0),
                                          os.environ, os.sched_getaffinity(0)))
    os.environ.update(several_teams_openmp(config.max_inflight, config.include_embeddings, os.environ))
    from skippy_stage.server.server import serve

    if args.http_port is not None:
        config = config.replace(http_port=args.http_port)
    flags = speculative_flags(args)
    if flags:
        config = StageConfig.from_dict({**config.to_dict(), "speculative": {**config.to_dict()["speculative"], **flags}})
    logs.configure(args.log_level, static={"stage_id": config.stage_id, "run_id": config.run_id})
    return serve(config, grace_s=args.grace)


def cmd_up(args: argparse.Namespace) -> int:
    stop = {"now": False}

    def on_signal(_signum: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _say_native_paths()
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
    try:
        media = [Path(image).read_bytes() for image in args.image]
    except OSError as exc:
        print(f"skippy-stage generate: error: cannot read --image {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    generate(args.endpoint, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
              seed=args.seed, chat=args.chat, credentials=client_credentials(args),
              speculative={**speculative_flags(args), **({"window_depth": args.window_depth} if args.window_depth else {})},
              record_schedule=args.record_schedule, media=media)
    if sys.stdout.isatty():
        sys.stdout.write("\n")  # only for people: piped output is exactly the generated text
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from skippy_stage.model.packaged import smollm2_path

    args.model = str(smollm2_path())
    args.layers = None
    args.stages = 3
    args.stage_log_level = "warning"  # the answer, not the stages' request logs, on the terminal
    _say_native_paths()
    with tempfile.TemporaryDirectory(prefix="skippy-demo-") as tmp:
        started = time.perf_counter()
        pipeline = _start_pipeline(args, Path(tmp))
        print(f"# 3-stage SmolLM2-135M pipeline up in {time.perf_counter() - started:.1f}s; head at "
              f"{pipeline.head_endpoint}", file=sys.stderr)
        try:
            print(f"> {args.prompt}", flush=True)
            figures = generate(pipeline.head_endpoint, args.prompt, max_tokens=args.max_tokens,
                                temperature=0.0, seed=None, chat=True)
            print(flush=True)
            print(f"# time to first token {figures['ttft_s'] * 1e3:.0f} ms, "
                  f"{figures['completion_tokens']} tokens at {figures['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        finally:
            pipeline.stop()
    return 0


def bench_plan(args: argparse.Namespace) -> BenchPlan:
    """What ``bench``'s flags ask for. ``--link-delay-ms D`` asks about a link: the wan section at D
    (and at 0, the floor's), and only that section unless ``--only`` says otherwise. ``--mtp-model``
    is the mtp section's: refused without it, or naming no file."""
    from skippy_stage.cli.bench import SECTIONS, BenchPlan, WanSetup

    wan = WanSetup.from_flags(args.wan_delays_ms, args.link_delay_ms, args.link_mbit)
    sections = args.only or (("wan",) if args.link_delay_ms is not None else SECTIONS)
    link_flags = args.link_delay_ms is not None or args.wan_delays_ms is not None or args.link_mbit is not None
    if "wan" not in sections and link_flags:
        raise SkippyError("--link-delay-ms, --wan-delays-ms and --link-mbit set the wan section, which --only leaves out")
    if args.mtp_model is not None:
        if "mtp" not in sections:
            raise SkippyError("--mtp-model sets the mtp section, which --only leaves out")
        if not Path(args.mtp_model).is_file():
            raise SkippyError(f"--mtp-model {args.mtp_model}: no such file")
    return BenchPlan(sections=sections, settings=tuple(args.settings), wan=wan, mtp_model=args.mtp_model)


def cmd_bench(args: argparse.Namespace) -> int:
    from skippy_stage.cli.bench import format_table, run

    report = run(args.json, bench_plan(args))
    print(format_table(report))
    if args.json:
        print(f"# JSON written to {args.json}", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from skippy_stage.model.preflight import effective_config, stage_memory

    config, ctx_reason = effective_config(args.config)
    print(f"# {args.config}: stage {config.stage_id} would serve layers {config.layer_start}:{config.layer_end}; "
          f"ctx_size from {ctx_reason}", file=sys.stderr)
    memory = stage_memory(config)
    print(f"# stage {config.stage_id}: " + (memory.describe() if memory is not None else
          f"checkpoint_quantization {config.checkpoint_quantization}; weights as the package's parts hold them"),
          file=sys.stderr)
    print(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from skippy_stage.cli.native import native_paths, summary
    from skippy_stage.model.preflight import format_info, info_report

    report = info_report()
    report["native"] = native_paths()  # what a `serve` started as this process was loads
    print(json.dumps(report, indent=2) if args.json else f"{format_info(report)}\nnative            {summary(report['native'])}")
    return 0


def cmd_slice(args: argparse.Namespace) -> int:
    from skippy_stage.model.slicing import read_model_info, stage_file, write_slice

    (start, end), = parse_layers(args.layers)
    final = args.final or end == read_model_info(args.model).block_count
    if args.out:
        write_slice(args.model, args.out, start, end, final=final)
        print(args.out)
    else:
        print(stage_file(args.model, start, end, final=final).path)
    return 0


def cmd_package(args: argparse.Namespace) -> int:
    from skippy_stage.model.package import write_package

    written = write_package(args.model, args.out, layers_per_part=args.layers_per_part)
    manifest = written.manifest
    size = sum(p.bytes for p in manifest.parts)
    print(f"# {args.out}: {len(manifest.parts)} parts, {size / 1e6:.1f} MB, of {manifest.source_file} "
          f"({manifest.architecture}, {manifest.block_count} layers); stages name it with package_ref and this "
          f"manifest_sha256:", file=sys.stderr)
    print(written.manifest_sha256)
    return 0


def cmd_make_projector(args: argparse.Namespace) -> int:
    from skippy_stage.model.projector_fixture import write_projector

    try:
        written = write_projector(args.model, args.out, seed=args.seed, kind=args.kind)
    except OSError as exc:
        print(f"skippy-stage make-projector: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    rows = (f"{written.n_image_tokens} image tokens per image" if written.n_image_tokens is not None
            else "an image's tokens depend on its size")
    print(f"{written.path}: {written.n_bytes} bytes, a random-weight {written.kind} projector (seed {written.seed}); "
          f"{rows}, {written.n_embd} floats each (the text model's n_embd)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from skippy_stage.model.verify import format_report, parse_split, verify

    report = verify(args.model, parse_split(args.layers), tokens=args.tokens, seed=args.seed,
                    n_threads=args.threads or None)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.exact else 1


def cmd_replay(args: argparse.Namespace) -> int:
    from skippy_stage.model.replay import format_report, replay
    from skippy_stage.model.schedule import Schedule

    report = replay(Schedule.from_json(Path(args.schedule).read_text()), args.model, n_threads=args.threads or None)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.exact else 1


def _sections(text: str) -> tuple[str, ...]:
    """--only: section names separated by commas."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("names no section")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skippy-stage", description="One pipeline stage of a split model, local pipelines, and what measures and proves them.")
    parser.add_argument("--log-level", default=os.environ.get("SKIPPY_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one stage daemon")
    p.add_argument("--config", required=True, help="StageConfig JSON file")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to drain in-flight work on SIGTERM")
    p.add_argument("--http-port", type=int, default=None, help="serve the OpenAI-compatible API here (head only)")
    add_speculative_flags(p, model=True)
    p.set_defaults(func=cmd_serve)

    def pipeline_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--base-port", type=int, default=0, help="first stage's port (default: free ports)")
        p.add_argument("--ctx-size", type=int, default=None,
                       help="KV cells per stage (default: the model's training context, capped by memory)")
        p.add_argument("--lanes", type=int, default=4)
        p.add_argument("--threads", type=int, default=0, help="llama.cpp threads per stage (default: all cores)")
        p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=None)
        p.add_argument("--cpu-wake-latency-us", type=int, default=None,
                       help="hold this host's idle CPUs to waking within this many us while the stages run "
                            "(0: they poll; needs write access to /dev/cpu_dma_latency)")
        p.add_argument("--start-timeout", type=float, default=300.0)
        p.add_argument("--return-path", choices=("relay", "direct"), default="direct",
                       help="sampled tokens back to the head through every stage (relay) or also straight "
                            "from the final stage (direct)")
        add_set_flag(p)

    def add_set_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", dest="settings", action="append", default=[], metavar="[STAGE_ID.]FIELD=VALUE",
                       help="set any StageConfig field on every stage (or on STAGE_ID only), after the other flags; "
                            "VALUE is JSON where it parses, else a string (repeatable; e.g. --set repack=true, "
                            "--set stage-1.cache_type_k=q8_0)")

    p = sub.add_parser("up", help="start one serve process per stage on loopback")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="the whole model's GGUF")
    source.add_argument("--package", metavar="REF", help="a layer package (directory, file:// or http(s):// URL) "
                        "each stage fetches its own parts of")
    p.add_argument("--manifest-sha256", default=None, help="with --package: the manifest the stages must find "
                   "(default: the package's manifest as it is now)")
    p.add_argument("--http-port", type=int, default=None, help="the head's OpenAI-compatible API port")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--stages", type=int)
    group.add_argument("--layers", help="e.g. 0:10,10:20,20:30")
    pipeline_args(p)
    add_speculative_flags(p, model=True)
    add_link_flags(p)
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
    p.add_argument("--window-depth", type=int, default=None, metavar="N",
                   help="most speculative windows in flight for this generation (at most the head's "
                        "verify_window_depth; 1: one per trip)")
    p.add_argument("--record-schedule", metavar="FILE", default=None,
                   help="record the batch schedule the pipeline runs and write it here (JSON), for replay")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image (PNG, JPEG, ...) for the prompt's media markers, in order (repeat for more; a "
                        "head with a projector_path). A prompt without markers gets one per image before its text")
    add_speculative_flags(p, model=False)
    p.add_argument("prompt")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the packaged SmolLM2 in 3 local stages, one generation")
    p.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    pipeline_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="measure the split's cost against the unsplit model, in one run")
    p.add_argument("--json", help="also write the figures as JSON here")
    p.add_argument("--only", type=_sections, default=None, metavar="SECTION[,SECTION]",
                   help="run these sections only: decode, batched, chat, speculative, images, mtp, repack, "
                        "floors, wan (default: all)")
    p.add_argument("--mtp-model", default=None, metavar="FILE",
                   help="the mtp section's model: a GGUF with multi-token-prediction (next-n) layers (default: a "
                        "random-weight fixture, from a source checkout's tests; skipped without one)")
    delays = p.add_mutually_exclusive_group()
    delays.add_argument("--wan-delays-ms", default=None, metavar="D[,D...]",
                        help="the wan section's one-way delays per edge, in ms (default 0,2,10; 0 is always "
                             "measured: the floor is 3 x D + the zero-delay decode)")
    delays.add_argument("--link-delay-ms", type=float, default=None, metavar="D",
                        help="the wan section at D ms one-way per edge (and at 0, for the floor); only the wan "
                             "section runs unless --only says otherwise. Links are emulated by a relay in this "
                             "process: a test tool")
    p.add_argument("--link-mbit", type=float, default=None, metavar="M",
                   help="the wan section: cap each edge at M Mbit/s each way, at every delay (0 included)")
    add_set_flag(p)
    p.set_defaults(func=cmd_bench)

    from skippy_stage.cli.ab import add_ab_parser
    from skippy_stage.cli.floor import add_floor_parser
    from skippy_stage.cli.plan import add_plan_parser
    from skippy_stage.cli.profile import add_profile_parser

    add_profile_parser(sub)
    add_floor_parser(sub)
    add_ab_parser(sub)
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

    p = sub.add_parser("package", help="cut a GGUF into a layer package: a part per layer group, the embeddings, "
                                       "the output head and the metadata, and a manifest; prints its sha256")
    p.add_argument("model")
    p.add_argument("--out", required=True, help="the package's directory (created)")
    p.add_argument("--layers-per-part", type=int, default=1, metavar="N", help="blocks per layer part")
    p.set_defaults(func=cmd_package)

    p = sub.add_parser("make-projector", help="write a small random-weight vision projector (mmproj GGUF) that "
                                              "libmtmd loads beside MODEL: a fixture for tests and for smoke-testing "
                                              "a deployment's image path")
    p.add_argument("model", help="the text model's GGUF (the projector's rows are as wide as its n_embd)")
    p.add_argument("--out", required=True, help="the projector's GGUF file (replaced if it exists)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights: the same seed and model give the same bytes")
    p.add_argument("--kind", choices=("mlp", "qwen2vl"), default="mlp",
                   help="mlp: llava-style, 16 rows an image (default); qwen2vl: Qwen2-VL's merger, for an M-RoPE "
                        "text model (an image a grid of rows whose size the image decides)")
    p.set_defaults(func=cmd_make_projector)

    p = sub.add_parser("verify", help="prove a split of MODEL computes exactly what llama-cpp-python computes on "
                                      "the unsplit model (exit 0 only when bit-exact)")
    p.add_argument("model")
    p.add_argument("--layers", required=True, help="the split, e.g. 0:10,10:20,20:30")
    p.add_argument("--tokens", type=int, default=8, help="positions compared: half one prefill, half decoded")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt's random token ids")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: all cores)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("replay", help="run a schedule `generate --record-schedule` wrote on the unsplit MODEL and "
                                      "check bit-identical logits and tokens (exit 0 only when exact, 1 naming the "
                                      "first step that differs)")
    p.add_argument("schedule", help="the schedule's JSON file")
    p.add_argument("--model", required=True, help="the whole model's GGUF (the pipeline's model_path)")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: the head's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_replay)
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
