"""``pdserve decode``: run a decode worker (gRPC ``DecodeWorker``) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

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


def add_decode_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_tp_args(p)
    add_server_args(p, default_port=50061)
    add_transfer_args(p)
    add_worker_args(p)
    add_draft_args(p, decode=True)


def run_decode(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (with ``--draft``, the engine looks ahead as far as a round of K
    draft tokens writes: K, or a draft tree's scratch)."""
    from decode_node.server import serve_decode
    from decode_node.spec.tree import TreeShape

    config = engine_config(args)
    if config.state_slots is None:  # slots for a full batch running and as many in transfer
        config = replace(config, state_slots=2 * config.max_num_seqs)
    shape = TreeShape(args.num_draft_tokens, args.draft_topk, args.draft_steps)  # checks flags
    if args.draft:
        config = replace(config, lookahead_tokens=shape.lookahead)
    model_dir = ensure_model(args.model)
    asyncio.run(serve_decode(
        model_dir, config, args.host, args.port,
        transfer_backend=args.transfer_backend, advertise_host=advertise_host(args),
        draft=draft_dir(args, model_dir), num_draft_tokens=args.num_draft_tokens,
        draft_topk=args.draft_topk, draft_steps=args.draft_steps,
        max_waiting=args.max_waiting, security=worker_security(args),
        bootstrap_config=bootstrap_config(args), metrics_port=args.metrics_port,
        keepalive=keepalive(args),
    ))
    return exit_process(0)
