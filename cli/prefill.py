"""``pdserve prefill``: run a prefill worker (gRPC ``PrefillWorker``), or one stage of a
pipeline-parallel prefill, until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import sys

from cli.arg_types import port
from cli.engine_args import (
    add_draft_args,
    add_engine_args,
    add_server_args,
    add_tp_args,
    add_transfer_args,
    add_worker_args,
    advertise_host,
    bootstrap_config,
    draft_dir,
    engine_config,
    keepalive,
    worker_security,
)
from cli.models import ensure_model
from serving.process_exit import exit_process


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_tp_args(p)
    add_server_args(p, default_port=50051)
    add_transfer_args(p)
    add_worker_args(p)
    add_draft_args(p, decode=False)
    p.add_argument("--bootstrap-port", type=port, default=0,
                   help="port of the KV transfer bootstrap endpoint (0 picks a free one)")
    p.add_argument("--pp-size", type=int, default=1,
                   help="pipeline-parallel prefill: number of stages; stage r owns layers "
                        "[r*L/S, (r+1)*L/S). Start the last stage first. The router talks "
                        "to stage 0 only; its load report lists every stage's bootstrap "
                        "address, and decode nodes push destinations to each stage")
    p.add_argument("--pp-rank", type=int, default=0,
                   help="this process's stage, 0..pp-size-1 (0 serves the router)")
    p.add_argument("--pp-next", default=None, metavar="HOST:PORT",
                   help="gRPC address of stage pp-rank+1 (every stage but the last needs it)")


def _pipeline_error(args: argparse.Namespace) -> str | None:
    """Why the ``--pp-*`` and ``--draft`` flags do not fit together, or None."""
    from prefill_node.pipeline.layout import DRAFT_ON_EARLY_STAGE

    if not 0 <= args.pp_rank < args.pp_size:
        return f"--pp-rank {args.pp_rank} is outside 0..{args.pp_size - 1}"
    if bool(args.pp_next) != (args.pp_rank < args.pp_size - 1):
        return ("every pipeline stage but the last needs --pp-next HOST:PORT, and the "
                "last takes none")
    if args.draft and args.pp_rank < args.pp_size - 1:
        return DRAFT_ON_EARLY_STAGE
    return None


def run_prefill(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; pipeline flags that do not fit print one error line (exit 2)."""
    from prefill_node.server import serve_prefill

    error = _pipeline_error(args)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model_dir = ensure_model(args.model)
    asyncio.run(serve_prefill(
        model_dir, engine_config(args), args.host, args.port,
        bootstrap_port=args.bootstrap_port, transfer_backend=args.transfer_backend,
        advertise_host=advertise_host(args), pp_size=args.pp_size, pp_rank=args.pp_rank,
        pp_next=args.pp_next, draft=draft_dir(args, model_dir),
        max_waiting=args.max_waiting, security=worker_security(args),
        bootstrap_config=bootstrap_config(args), metrics_port=args.metrics_port,
        keepalive=keepalive(args),
    ))
    return exit_process(0)
