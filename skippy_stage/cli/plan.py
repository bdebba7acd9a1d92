"""``skippy-stage plan``: split a model over nodes by memory, and write the deployment files.

With link latencies (``--link-ms``, or ``--measure`` to ask running stages what they measured), it
first chooses the stage count and the order of nodes with the lowest estimated time per output token
(``ops.placement``), prints every candidate, and plans the one chosen. Without them it splits over
every node in the order given, as it always has.

``--quantization TYPE`` plans every stage at ``checkpoint_quantization`` TYPE (its weights' bytes from
the dry-run plan of llama.cpp's quantizer, ``model.quant_bytes``); ``--quantization auto`` picks per
node the highest precision that fits (``ops.plan.plan_quantized``). The configs written carry each
stage's ``checkpoint_quantization``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from skippy_stage.config import CACHE_TYPES, CHECKPOINT_QUANTIZATIONS, IMATRIX_QUANTIZATIONS
from skippy_stage.errors import PlanError
from skippy_stage.ops.deploy import (
    DEFAULT_FRAME_PORT,
    DEFAULT_IMAGE,
    DEFAULT_MODEL_DIR,
    DEFAULT_PORT,
    TOKEN_FILE,
    kubectl_create_secret,
    write_plan,
)
from skippy_stage.ops.footprint import read_footprint, read_footprints
from skippy_stage.ops.placement import (
    HOP_OVERHEAD_MS,
    Links,
    choose_placement,
    measured_links,
    parse_links,
    parse_speeds,
)
from skippy_stage.ops.plan import (
    AUTO_QUANTIZATIONS,
    DEFAULT_OVERHEAD_MIB,
    NodeSpec,
    Plan,
    make_plan,
    parse_nodes,
    plan_quantized,
    quantization_ladder,
)

# How long ``--measure`` waits for each stage's GetStatus.
MEASURE_TIMEOUT_S = 5.0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``skippy-stage`` subcommand parser."""
    p = subparsers.add_parser(
        "plan", help="split a model's layers over nodes by memory; optionally write configs, Compose and Kubernetes",
        description="Assign contiguous layer ranges to nodes (in the order given; the first is the head) by "
                    "their memory budgets, and optionally write the deployment files. With --link-ms or --measure, "
                    "first choose how many of the nodes to use and in which order: the candidate with the lowest "
                    "estimated time per output token that fits in memory.",
    )
    p.add_argument("--model", required=True, help="the GGUF file to read tensor sizes from")
    p.add_argument("--nodes", required=True, help="NAME=MEM_GIB[,NAME=MEM_GIB...] in pipeline order")
    p.add_argument("--ctx-size", type=int, default=4096, help="tokens of context per lane (default 4096)")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions per stage (default 4)")
    p.add_argument("--cache-type", choices=CACHE_TYPES, default="f16", help="KV cache type for K and V (default f16)")
    p.add_argument("--overhead-mib", type=float, default=DEFAULT_OVERHEAD_MIB,
                   help=f"fixed per-node cost: runtime, compute buffers, Python (default {DEFAULT_OVERHEAD_MIB})")
    p.add_argument("--quantization", metavar="TYPE|auto",
                   help="plan every stage at checkpoint_quantization TYPE (preserve, Q8_0, Q4_K_M, ...), or 'auto': "
                        "per node the highest precision that fits, of the GGUF's own types and "
                        f"{', '.join(AUTO_QUANTIZATIONS)} (default: the GGUF's own, with no checkpoint_quantization "
                        "in the configs)")
    p.add_argument("--out", help="write configs/, compose.yaml, k8s/ and (unless one is there) the chain's token here")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                   help=f"where the nodes see the model file (default {DEFAULT_MODEL_DIR}, the volume the files mount)")
    p.add_argument("--run-id", default="skippy")
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port of every stage (default {DEFAULT_PORT})")
    p.add_argument("--frame-port", type=int, default=DEFAULT_FRAME_PORT,
                   help=f"TCP frame listener port of every stage, exposed by each Service (default {DEFAULT_FRAME_PORT})")
    p.add_argument("--pin-nodes", action="store_true",
                   help="pin each Kubernetes Deployment to the node of the same name (kubernetes.io/hostname)")
    latency = p.add_argument_group("choosing by latency", "with --link-ms or --measure: every stage count and "
                                   "order of the nodes that fits is estimated, and the fastest is planned")
    latency.add_argument("--link-ms", metavar="MS|A-B=MS,...",
                         help="one-way link latency in ms: one number for every pair of nodes, A-B=MS per pair "
                              "(the same both ways), or both (5,a-b=0.5)")
    latency.add_argument("--measure", metavar="ENDPOINT,...",
                         help="ask these running stages (host:port) for the round trips they measure to their "
                              "downstream and back to the head (GetStatus); half of each is a pair's latency, by "
                              "stage_id. A pair in --link-ms overrides a measured one")
    latency.add_argument("--speed", metavar="NAME=FACTOR,...", default="",
                         help="relative decode speed of nodes (default 1 each): a node of speed 2 computes its "
                              "layers in half the time")
    latency.add_argument("--token-ms", type=float, default=None,
                         help="the whole model's decode time per token on a node of speed 1 (default: its "
                              "weights read at 10 GB/s; bench's single-process ms/token measures it)")
    latency.add_argument("--hop-overhead-ms", type=float, default=HOP_OVERHEAD_MS,
                         help=f"time an edge adds besides the link's latency (default {HOP_OVERHEAD_MS}: "
                              f"bench's hop on one host)")
    latency.add_argument("--tls-ca", help="with --measure: CA certificate to verify the stages with")
    latency.add_argument("--tls-cert", help="with --measure: client certificate (mutual TLS)")
    latency.add_argument("--tls-key", help="with --measure: client key (mutual TLS)")
    latency.add_argument("--token-file", help="with --measure: file holding the bearer token")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    nodes = parse_nodes(args.nodes)
    check_quantization(args.quantization)
    sizing = {"ctx_size": args.ctx_size, "lanes": args.lanes, "cache_type": args.cache_type,
              "overhead_mib": args.overhead_mib}
    if args.link_ms is None and args.measure is None:
        for flag, value in (("--speed", args.speed), ("--token-ms", args.token_ms),
                            ("--hop-overhead-ms", args.hop_overhead_ms != HOP_OVERHEAD_MS)):
            if value:
                raise PlanError(f"{flag} weighs the candidates by latency: give --link-ms or --measure with it")
        plan = quantized_plan(args, nodes, sizing) if args.quantization else make_plan(args.model, nodes, **sizing)
    else:
        if args.quantization == "auto":
            raise PlanError("--quantization auto chooses types for one order of the nodes: give a type, or drop "
                            "--link-ms/--measure")
        plan = choose(args, nodes, sizing)
    print(plan.format_table(), flush=True)
    if args.out:
        model_path = f"{args.model_dir.rstrip('/')}/{Path(args.model).name}"
        written = write_plan(plan, args.out, model_path, run_id=args.run_id, port=args.port,
                             frame_port=args.frame_port, image=args.image, pin_nodes=args.pin_nodes)
        print(f"# wrote {len(written)} files under {args.out}: configs/, compose.yaml, k8s/", file=sys.stderr)
        token = Path(args.out) / TOKEN_FILE
        if token in written:
            print(f"# a new bearer token for the chain in {token} (mode 0600); load it into the cluster with:\n"
                  f"#   {kubectl_create_secret(token)}", file=sys.stderr)
        else:
            print(f"# kept the chain's bearer token already in {token}", file=sys.stderr)
    return 0


def check_quantization(value: str | None) -> None:
    """``--quantization`` is unset, auto, or a type a stage makes without an importance matrix."""
    if value is None or value == "auto":
        return
    if value not in CHECKPOINT_QUANTIZATIONS:
        raise PlanError(f"--quantization {value!r} is not 'auto' or one of {', '.join(CHECKPOINT_QUANTIZATIONS)}")
    if value in IMATRIX_QUANTIZATIONS:
        raise PlanError(f"--quantization {value} needs an importance matrix (checkpoint_imatrix): plan another "
                        "type, or write the configs yourself with checkpoint_imatrix and its sha256")


def quantized_plan(args: argparse.Namespace, nodes: list[NodeSpec], sizing: dict[str, Any]) -> Plan:
    """The plan at ``--quantization``: one type on every node, or per node the highest that fits."""
    if args.quantization != "auto":
        return make_plan(args.model, nodes, quantization=args.quantization, **sizing)
    ladder = quantization_ladder(read_footprints(args.model, ("preserve", *AUTO_QUANTIZATIONS)))
    plan = plan_quantized(ladder, nodes, **sizing)
    print(f"# --quantization auto (highest first: {' > '.join(m.quantization for m in ladder)}): "
          + ", ".join(f"{s.node}={s.quantization}" for s in plan.stages), file=sys.stderr)
    return plan


def choose(args: argparse.Namespace, nodes: list[NodeSpec], sizing: dict[str, Any]) -> Plan:
    """The candidates table, printed, and the plan of the one chosen."""
    links = parse_links(args.link_ms, nodes) if args.link_ms is not None else Links()
    if args.measure is not None:
        measured = measure(args)
        names = {n.name for n in nodes}
        strangers = sorted({name for pair in measured for name in pair} - names)
        if strangers:
            print(f"# measured stages {', '.join(strangers)} are not among --nodes: their links are not used",
                  file=sys.stderr)
        links = Links(default_ms=links.default_ms, given=links.given, measured=measured)
    placement = choose_placement(read_footprint(args.model, args.quantization or "preserve"), nodes, links, speeds=parse_speeds(args.speed, nodes),
                                 token_ms=args.token_ms, hop_overhead_ms=args.hop_overhead_ms, **sizing)
    print(placement.format_table(), end="\n\n", flush=True)
    return placement.plan


def measure(args: argparse.Namespace) -> dict[frozenset[str], float]:
    """The one-way latencies the running stages at ``--measure`` have measured (``measured_links``)."""
    import grpc

    from skippy_stage.cli.client import client_credentials
    from skippy_stage.stage.codec import report_from_pb
    from skippy_stage.v1 import stage_pb2 as pb
    from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

    creds = client_credentials(args)
    reports = []
    for endpoint in (e.strip() for e in args.measure.split(",") if e.strip()):
        with creds.channel(endpoint, []) as channel:
            try:
                reports.append(report_from_pb(pb_grpc.StageServiceStub(channel).GetStatus(
                    pb.GetStatusRequest(), timeout=MEASURE_TIMEOUT_S, metadata=creds.call_metadata())))
            except grpc.RpcError as err:
                raise PlanError(f"--measure: stage at {endpoint} did not answer GetStatus: "
                                f"{err.code().name}: {err.details()}") from None
    if not reports:
        raise PlanError("--measure names no endpoint")
    return measured_links(reports)
