"""``pdserve router``: flags and start-up of the router process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from cli.arg_types import port
from cli.engine_args import add_server_args, internal_token, keepalive
from cli.models import ensure_model

if TYPE_CHECKING:
    from serving.auth import ServerSecurity


def add_http_door_args(p: argparse.ArgumentParser, where: str) -> None:
    """``--http-port`` and ``--served-model-name`` (the router's and the launch's); ``where``
    says where the door listens."""
    p.add_argument("--http-port", type=port, default=None, metavar="N",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
                        f"/detokenize, /tokenizer_info) {where}; off by default")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id of the HTTP API (default: the --model directory's name)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (config.json, tokenizer.json, ...), or "
                   "builtin, builtin:qwen2-vl, builtin:hybrid (default: builtin)")
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
    p.add_argument("--max-running", type=int, default=1024, metavar="N",
                   help="live client streams; more are refused with RESOURCE_EXHAUSTED and a "
                        "retry-after-ms hint")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="PEM certificate chain: serve the public API over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="require 'authorization: Bearer <token>' metadata (the token is this "
                        "file's content) on every Generation and Admin call; health and "
                        "reflection stay open")
    add_http_door_args(p, "on --host:N (0 = a free port; prints 'HTTP <port>' before 'READY'); "
                          "HTTPS with --tls-cert, and all but /health and /metrics require the "
                          "--auth-token-file token")
    p.add_argument("--kv-failure-policy", choices=["retry", "recompute", "fail"],
                   default="retry",
                   help="a prompt whose KV transfer failed (or whose prefill is unusable): "
                        "'retry' runs it again on a prefill up to --kv-retries times, then on "
                        "the decode; 'recompute' runs it on the decode at once; 'fail' ends the "
                        "request (default: retry)")
    p.add_argument("--kv-retries", type=int, default=2, metavar="N",
                   help="prefill re-runs of a failed prompt before recomputing (default: 2)")
    p.add_argument("--decode-failovers", type=int, default=2, metavar="N",
                   help="times a stream whose decode failed mid-generation moves to another "
                        "decode with the tokens streamed so far (0: never; default: 2)")
    p.add_argument("--policy", choices=["least-loaded", "cache-aware"], default="least-loaded",
                   help="how a prefill and a decode worker are picked: 'least-loaded', or "
                        "'cache-aware': the worker holding the longest prefix of the prompt in "
                        "its prefix cache, unless the loads are imbalanced (default: "
                        "least-loaded)")
    p.add_argument("--kv-events", action="store_true",
                   help="cache-aware: follow each worker's cache events (SubscribeKvEvents) "
                        "instead of guessing its cache from the prompts sent to it")
    p.add_argument("--balance-abs-threshold", type=int, default=32, metavar="N",
                   help="cache-aware: the loads are imbalanced (the least loaded worker wins) "
                        "when they differ by more than N requests (default: 32) ...")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5, metavar="X",
                   help="... and the largest is more than X times the smallest (default: 1.5)")
    p.add_argument("--max-tree-blocks", type=int, default=1 << 16, metavar="N",
                   help="cache-aware without --kv-events: blocks (pages) remembered per worker, "
                        "least recently used dropped first (default: 65536)")
    add_server_args(p, default_port=50051)


def router_security(args: argparse.Namespace) -> ServerSecurity:
    """TLS and the bearer-token rule of the public port; ValueError on unusable flags."""
    from router.server import SERVICE_NAME as GENERATION
    from serving.admin import SERVICE_NAME as ADMIN
    from serving.auth import ServerSecurity, TlsFiles, bearer, read_secret

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("give both --tls-cert and --tls-key, or neither")
    tls = TlsFiles.read(args.tls_cert, args.tls_key) if args.tls_cert else None
    token = read_secret(args.auth_token_file)
    rules = (bearer(token, (GENERATION, ADMIN)),) if token else ()
    return ServerSecurity(tls=tls, requirements=rules)


def run_router(args: argparse.Namespace) -> int:
    """Build the config from ``args`` and serve until SIGTERM; bad flags print one error line."""
    from router.config import RouterConfig, RoutingConfig, parse_addresses
    from router.recovery import KVFailurePolicy, RecoveryConfig
    from router.server import serve_router

    model_dir = ensure_model(args.model)
    try:
        config = RouterConfig(
            model_dir=model_dir,
            prefill=parse_addresses(args.prefill),
            decode=parse_addresses(args.decode),
            colocated=parse_addresses(args.colocated),
            max_new_tokens_default=args.max_new_tokens_default,
            local_prefill_threshold=args.local_prefill_threshold,
            max_running=args.max_running, internal_token=internal_token(args),
            http_port=args.http_port, served_model_name=args.served_model_name,
            recovery=RecoveryConfig(KVFailurePolicy(args.kv_failure_policy), args.kv_retries,
                                    args.decode_failovers),
            routing=RoutingConfig(args.policy, args.balance_abs_threshold,
                                  args.balance_rel_threshold, args.max_tree_blocks,
                                  args.kv_events),
            keepalive=keepalive(args),
        )
        security = router_security(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_router(config, args.host, args.port, security,
                             metrics_port=args.metrics_port))
    return 0
