"""``pdserve router``: flags and start-up of the router process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from deploy.engine_args import add_server_args


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (config.json, tokenizer.json, ...)")
    p.add_argument("--prefill", metavar="HOST:PORT[,...]",
                   help="prefill workers; an entry dns:NAME:PORT means every A record of NAME "
                        "(e.g. a Kubernetes headless service), re-resolved every 5 s")
    p.add_argument("--decode", metavar="HOST:PORT[,...]",
                   help="decode workers (HOST:PORT or dns:NAME:PORT entries)")
    p.add_argument("--colocated", metavar="HOST:PORT[,...]",
                   help="colocated workers (decode workers that prefill locally; HOST:PORT or "
                        "dns:NAME:PORT entries)")
    p.add_argument("--max-new-tokens-default", type=int, default=128,
                   help="max_new_tokens of requests that leave it 0")
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="T",
                   help="prompts shorter than T tokens prefill on the decode worker (0 = off)")
    add_server_args(p, default_port=50051)


def run_router(args: argparse.Namespace, model_dir: Path) -> int:
    """Build the config from ``args`` and serve until SIGTERM; bad flags print one error line."""
    from router.config import RouterConfig, parse_addresses
    from router.server import serve_router

    try:
        config = RouterConfig(
            model_dir=model_dir,
            prefill=parse_addresses(args.prefill),
            decode=parse_addresses(args.decode),
            colocated=parse_addresses(args.colocated),
            max_new_tokens_default=args.max_new_tokens_default,
            local_prefill_threshold=args.local_prefill_threshold,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_router(config, args.host, args.port))
    return 0
