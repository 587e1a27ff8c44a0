"""``pdserve launch`` / ``status`` / ``stop``: the Ray cluster from the command line.

A detached launch leaves its state (the router address, whether it started the Ray head) in
``launch.json`` of the cache directory (:func:`cli.models.cache_dir`), where ``stop`` finds it.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

from cli.engine_args import add_device_args
from cli.models import cache_dir, ensure_model

STATE_FILE = "launch.json"
RAY = str(Path(sys.executable).parent / "ray")  # the ray CLI of this environment


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--port", type=int, default=50050, help="router port (0 picks a free one)")
    p.add_argument("--address", default=None,
                   help="join an existing Ray cluster (HOST:PORT or 'auto'); default: start one")
    p.add_argument("--prefill-gpus", type=float, default=0.0)
    p.add_argument("--decode-gpus", type=float, default=0.0)
    p.add_argument("--prefill-resources", default="{}", metavar="JSON",
                   help='custom Ray resources per prefill worker, e.g. \'{"NPU": 1}\'')
    p.add_argument("--decode-resources", default="{}", metavar="JSON")
    p.add_argument("--worker-args", default="", metavar="'FLAGS'",
                   help="engine flags passed to every worker, e.g. '--num-pages 512'")
    add_device_args(p)  # passed to every worker as given: each resolves auto on its own node
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="EAGLE draft for every worker ('auto': MODEL/draft, if present)")
    p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K")
    p.add_argument("--detach", action="store_true",
                   help="start and return; stop later with `pdserve stop`")


def run_launch(args: argparse.Namespace) -> int:
    """Start the cluster; without ``--detach``, serve until SIGINT/SIGTERM and stop it."""
    from deploy import ray_launcher as rl
    from engine.device import parse_device_name

    parse_device_name(args.device)  # a misspelt device fails here, not in every worker
    model_dir = ensure_model(args.model)
    opts = rl.LaunchOptions(
        model=str(model_dir), prefill=args.prefill, decode=args.decode, port=args.port,
        address=args.address, prefill_gpus=args.prefill_gpus, decode_gpus=args.decode_gpus,
        prefill_resources=_resources(args.prefill_resources),
        decode_resources=_resources(args.decode_resources),
        worker_args=args.worker_args.split(), detached=args.detach,
        draft=_draft_dir(args.draft, model_dir), num_draft_tokens=args.num_draft_tokens,
        device=args.device, dtype=args.dtype, graphs=not args.no_graphs,
    )
    started_head = False
    if args.detach and not args.address:
        subprocess.run([RAY, "start", "--head", "--disable-usage-stats"], check=True,
                       capture_output=True)
        opts.address, started_head = "auto", True
    cluster = rl.launch(opts)
    print(f"router: {cluster.router_address}  (prefill {args.prefill}, decode {args.decode})")
    print(f"READY {cluster.router_address}", flush=True)
    if args.detach:
        state_dir = cache_dir()
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / STATE_FILE).write_text(json.dumps({
            "router": cluster.router_address, "started_head": started_head}))
        return 0
    _wait_for_signal()
    print("stopping ...", flush=True)
    rl.stop(cluster.actors())
    import ray

    ray.shutdown()
    print("stopped", flush=True)
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Report the running cluster; exit 1 when there is none or a server is dead."""
    from deploy import ray_launcher as rl

    rl.connect("auto")
    cluster = rl.find_cluster()
    if cluster is None:
        print("no pdserve cluster is running")
        return 1
    import ray

    alive = ray.get([a.alive.remote() for a in cluster.actors()])
    print(f"router: {cluster.router_address}")
    print(f"servers alive: {sum(alive)}/{len(alive)}")
    return 0 if all(alive) else 1


def run_stop(args: argparse.Namespace) -> int:
    """Stop the running cluster (and the Ray head a detached launch started); exit 1 if none."""
    from deploy import ray_launcher as rl

    state_path = cache_dir() / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    rl.connect("auto")
    cluster = rl.find_cluster()
    if cluster is not None:
        rl.stop(cluster.actors())
        print("stopped the pdserve cluster")
    import ray

    ray.shutdown()
    if state.get("started_head"):
        subprocess.run([RAY, "stop"], check=False, capture_output=True)
    state_path.unlink(missing_ok=True)
    return 0 if cluster is not None else 1


def _draft_dir(draft: str | None, model_dir: Path) -> str | None:
    if draft != "auto":
        return draft
    return str(model_dir / "draft") if (model_dir / "draft" / "config.json").is_file() else None


def _resources(text: str) -> dict[str, float]:
    from engine.errors import InvalidRequestError

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"resources must be a JSON object: {exc}") from exc
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise InvalidRequestError(f"resources must map names to numbers, got {text!r}")
    return {str(k): float(v) for k, v in value.items()}


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
