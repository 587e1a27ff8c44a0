"""The ``pdserve`` command line.

Subcommands: ``make-tiny-model DIR`` writes the built-in tiny checkpoint; ``generate`` runs the
engine in one process over one or many prompts. User errors print one ``error:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from cli.engine_args import (
    add_draft_args,
    add_engine_args,
    add_server_args,
    add_transfer_args,
    add_worker_args,
    advertise_host,
    bootstrap_config,
    engine_config,
    worker_security,
)
from engine.builtin import builtin_model_dir
from engine.errors import EngineError


def default_model_dir() -> Path:
    """Where a random tiny model is written when the package ships no trained one
    (``$PDSERVE_CACHE`` or ``~/.cache/pdserve``); also where launch keeps its state."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "tiny-qwen2-vl"


def ensure_model(model: str | None) -> Path:
    """``model`` if given, else the shipped trained tiny model, else a random tiny model
    written on first use."""
    if model:
        return Path(model)
    if (builtin_model_dir() / "config.json").is_file():
        return builtin_model_dir()
    from engine.tiny_model import write_tiny_model

    path = default_model_dir()
    if not (path / "config.json").is_file():
        write_tiny_model(path)
    return path


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import write_tiny_model

    path = write_tiny_model(args.dir, seed=args.seed)
    print(f"wrote tiny Qwen2-VL checkpoint to {path}")
    if args.with_draft:
        from engine.tiny_model import write_tiny_draft

        draft = write_tiny_draft(path / "draft", seed=args.seed + 1)
        print(f"wrote its EAGLE draft to {draft}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from cli.generate import run_generate

    return run_generate(args, ensure_model(args.model))


def _cmd_decode(args: argparse.Namespace) -> int:
    from decode_node.server import serve_decode

    config = engine_config(args)
    if args.draft:
        config = replace(config, lookahead_tokens=args.num_draft_tokens)
    asyncio.run(serve_decode(
        ensure_model(args.model), config, args.host, args.port,
        transfer_backend=args.transfer_backend, advertise_host=advertise_host(args),
        draft=Path(args.draft) if args.draft else None, num_draft_tokens=args.num_draft_tokens,
        max_waiting=args.max_waiting, security=worker_security(args),
        bootstrap_config=bootstrap_config(args), metrics_port=args.metrics_port,
    ))
    return 0


def _cmd_prefill(args: argparse.Namespace) -> int:
    from prefill_node.server import serve_prefill

    if not 0 <= args.pp_rank < args.pp_size:
        print(f"error: --pp-rank {args.pp_rank} is outside 0..{args.pp_size - 1}", file=sys.stderr)
        return 2
    if bool(args.pp_next) != (args.pp_rank < args.pp_size - 1):
        print("error: every pipeline stage but the last needs --pp-next HOST:PORT, and the "
              "last takes none", file=sys.stderr)
        return 2
    if args.draft and args.pp_size > 1:
        print("error: --draft is not supported with a pipeline-parallel prefill yet",
              file=sys.stderr)
        return 2
    asyncio.run(serve_prefill(
        ensure_model(args.model), engine_config(args), args.host, args.port,
        bootstrap_port=args.bootstrap_port, transfer_backend=args.transfer_backend,
        advertise_host=advertise_host(args), pp_size=args.pp_size, pp_rank=args.pp_rank,
        pp_next=args.pp_next, draft=Path(args.draft) if args.draft else None,
        max_waiting=args.max_waiting, security=worker_security(args),
        bootstrap_config=bootstrap_config(args), metrics_port=args.metrics_port,
    ))
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from cli.router import run_router

    return run_router(args, ensure_model(args.model))


def _cmd_client(args: argparse.Namespace) -> int:
    from cli.client import run_client

    return run_client(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("make-tiny-model", help="write the built-in tiny random checkpoint")
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--with-draft", action="store_true",
                      help="also write an EAGLE draft to DIR/draft")
    tiny.set_defaults(func=_cmd_make_tiny_model)

    from cli.generate import add_generate_args

    gen = sub.add_parser("generate", help="run the engine in this process (no servers)")
    add_generate_args(gen)
    gen.set_defaults(func=_cmd_generate)

    dec = sub.add_parser("decode", help="run a decode worker (gRPC DecodeWorker)")
    add_engine_args(dec)
    add_server_args(dec, default_port=50061)
    add_transfer_args(dec)
    add_worker_args(dec)
    add_draft_args(dec, decode=True)
    dec.set_defaults(func=_cmd_decode)

    pre = sub.add_parser("prefill", help="run a prefill worker (gRPC PrefillWorker)")
    add_engine_args(pre)
    add_server_args(pre, default_port=50051)
    add_transfer_args(pre)
    add_worker_args(pre)
    add_draft_args(pre, decode=False)
    pre.add_argument("--bootstrap-port", type=int, default=0,
                     help="port of the KV transfer bootstrap endpoint (0 picks a free one)")
    pre.add_argument("--pp-size", type=int, default=1,
                     help="pipeline-parallel prefill: number of stages; stage r owns layers "
                          "[r*L/S, (r+1)*L/S). Start the last stage first. The router talks "
                          "to stage 0 only; its load report lists every stage's bootstrap "
                          "address, and decode nodes push destinations to each stage")
    pre.add_argument("--pp-rank", type=int, default=0,
                     help="this process's stage, 0..pp-size-1 (0 serves the router)")
    pre.add_argument("--pp-next", default=None, metavar="HOST:PORT",
                     help="gRPC address of stage pp-rank+1 (every stage but the last needs it)")
    pre.set_defaults(func=_cmd_prefill)

    from cli.client import add_client_args
    from cli.router import add_router_args

    rtr = sub.add_parser("router", help="run the router (public gRPC Generation API)")
    add_router_args(rtr)
    rtr.set_defaults(func=_cmd_router)

    cli = sub.add_parser("client", help="stream one answer from a router")
    add_client_args(cli)
    cli.set_defaults(func=_cmd_client)
    _add_cluster_commands(sub)
    return parser


def _add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    from cli.launch import add_launch_args

    launch = sub.add_parser("launch", help="start router, prefill and decode workers on Ray")
    add_launch_args(launch)
    launch.set_defaults(func=_cmd_launch)
    status = sub.add_parser("status", help="show the detached cluster started by launch")
    status.set_defaults(func=_cmd_status)
    stop = sub.add_parser("stop", help="stop the detached cluster started by launch")
    stop.set_defaults(func=_cmd_stop)

    from cli.bench import add_bench_args

    bench = sub.add_parser("bench", help="load-test routers, or --compare setups it starts")
    add_bench_args(bench)
    bench.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cli.bench import run_bench

    try:
        return run_bench(args)
    except RuntimeError as exc:  # a cluster that did not start, a missing baseline library
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_launch(args: argparse.Namespace) -> int:
    from cli.launch import run_launch

    return run_launch(args, ensure_model(args.model), default_model_dir().parent)


def _cmd_status(args: argparse.Namespace) -> int:
    from cli.launch import run_status

    return run_status(default_model_dir().parent)


def _cmd_stop(args: argparse.Namespace) -> int:
    from cli.launch import run_stop

    return run_stop(default_model_dir().parent)


def main(argv: Sequence[str] | None = None) -> int:
    try:  # building the parser reads PDSERVE_FAULT_* defaults, which may be malformed
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
