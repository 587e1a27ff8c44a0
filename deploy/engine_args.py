"""Command-line flags shared by every command that builds an engine."""

from __future__ import annotations

import argparse
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pool pages (default: as many as --kv-budget-mb buys)")
    p.add_argument("--kv-budget-mb", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget per step (also the prefill chunk size)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from engine.llm_engine import EngineConfig  # torch: only for commands that run an engine

    return EngineConfig(
        page_size=args.page_size, num_pages=args.num_pages, kv_budget_bytes=args.kv_budget_mb << 20,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, dtype=args.dtype,
    )


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 to serve other machines)")
    p.add_argument("--port", type=int, default=default_port, help="0 picks a free port")


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "ascend"])
    p.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this node's transfer engine and bootstrap "
                        "(default: --host, or this machine's address when --host is 0.0.0.0)")


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host not in ("0.0.0.0", "::", ""):
        return str(args.host)
    return socket.gethostbyname(socket.gethostname())


def add_draft_args(p: argparse.ArgumentParser, *, decode: bool) -> None:
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="EAGLE draft directory (e.g. MODEL/draft from make-tiny-model "
                        "--with-draft); prefill and decode nodes of a cluster must agree")
    if decode:
        p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K",
                       help="draft tokens per speculative round (with --draft)")
