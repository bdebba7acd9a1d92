"""``skippy-stage plan``: split a model over nodes by memory, and write the deployment files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from skippy_stage.config import CACHE_TYPES
from skippy_stage.ops.deploy import (
    DEFAULT_FRAME_PORT,
    DEFAULT_IMAGE,
    DEFAULT_MODEL_DIR,
    DEFAULT_PORT,
    TOKEN_FILE,
    kubectl_create_secret,
    write_plan,
)
from skippy_stage.ops.plan import DEFAULT_OVERHEAD_MIB, make_plan, parse_nodes


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``skippy-stage`` subcommand parser."""
    p = subparsers.add_parser(
        "plan", help="split a model's layers over nodes by memory; optionally write configs, Compose and Kubernetes",
        description="Assign contiguous layer ranges to nodes (in the order given; the first is the head) by "
                    "their memory budgets, and optionally write the deployment files.",
    )
    p.add_argument("--model", required=True, help="the GGUF file to read tensor sizes from")
    p.add_argument("--nodes", required=True, help="NAME=MEM_GIB[,NAME=MEM_GIB...] in pipeline order")
    p.add_argument("--ctx-size", type=int, default=4096, help="tokens of context per lane (default 4096)")
    p.add_argument("--lanes", type=int, default=4, help="concurrent sessions per stage (default 4)")
    p.add_argument("--cache-type", choices=CACHE_TYPES, default="f16", help="KV cache type for K and V (default f16)")
    p.add_argument("--overhead-mib", type=float, default=DEFAULT_OVERHEAD_MIB,
                   help=f"fixed per-node cost: runtime, compute buffers, Python (default {DEFAULT_OVERHEAD_MIB})")
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
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    nodes = parse_nodes(args.nodes)
    plan = make_plan(args.model, nodes, ctx_size=args.ctx_size, lanes=args.lanes, cache_type=args.cache_type,
                     overhead_mib=args.overhead_mib)
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
