"""``pdserve launch`` / ``status`` / ``stop``: the Ray cluster from the command line.

Which Ray cluster a launch uses: ``--address`` if given; else the one already running on this
machine (``ray start``, or ``$RAY_ADDRESS``), reused as is and left running; else a new one: a
``ray start --head`` for ``--detach`` (pdserve's head, recorded in ``ray-head.json`` of the cache
directory, :func:`cli.models.cache_dir`), or a Ray instance of the launch's own process. A launch
that fails, or is interrupted (Ctrl-C, SIGTERM), kills every actor it created and stops the head
it started before the error, one line, reaches the user.

``--http-port`` also opens the router's OpenAI-compatible HTTP door (``--served-model-name``:
its model id); the launch prints the door's URL on an ``openai:`` line beside the ``router:``
one, and ``status`` shows it too.

Each cluster has a ``--name`` (default ``pdserve``), so several run on one Ray cluster; a detached
launch leaves ``launch-NAME.json`` (router, OpenAI and Ray addresses) in the cache directory,
where ``status`` and ``stop --name NAME`` find its Ray cluster. ``stop`` also stops pdserve's
head once no pdserve cluster is left on it.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.arg_types import non_negative_float, port, positive
from cli.engine_args import add_device_args, add_tree_args
from cli.models import cache_dir, ensure_model
from cli.router import add_http_door_args

if TYPE_CHECKING:
    from deploy.ray_launcher import LaunchOptions

HEAD_FILE = "ray-head.json"  # the address of the Ray head a detached launch started
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def add_status_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``status`` and ``stop``."""
    p.add_argument("--name", default="pdserve",
                   help="the cluster's name: several clusters with different names can run on "
                        "one Ray cluster (default: pdserve)")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory, or builtin, builtin:qwen2-vl, builtin:hybrid "
                   "(the shipped tiny models; default: builtin)")
    p.add_argument("--prefill", type=positive, default=1, help="prefill workers")
    p.add_argument("--decode", type=positive, default=1, help="decode workers")
    p.add_argument("--port", type=port, default=50050, help="router port (0 picks a free one)")
    add_http_door_args(p, "on the router's host, port N (0 picks a free one; not --port); its "
                          "URL is printed on the 'openai:' line")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (HOST:PORT or 'auto'); default: the one running "
                        "on this machine, else a new one")
    p.add_argument("--prefill-gpus", type=non_negative_float, default=0.0)
    p.add_argument("--decode-gpus", type=non_negative_float, default=0.0)
    p.add_argument("--prefill-resources", default="{}", metavar="JSON",
                   help='custom Ray resources per prefill worker, e.g. \'{"NPU": 1}\'')
    p.add_argument("--decode-resources", default="{}", metavar="JSON")
    p.add_argument("--prefill-tp-size", type=positive, default=1, metavar="N",
                   help="tensor-parallel processes of every prefill worker (its "
                        "--prefill-gpus cover them all)")
    p.add_argument("--decode-tp-size", type=positive, default=1, metavar="N",
                   help="tensor-parallel processes of every decode worker; the two sizes may "
                        "differ: each prefill rank sends each decode rank its KV heads")
    p.add_argument("--prefill-pp-size", type=positive, default=1, metavar="N",
                   help="pipeline stages of every prefill worker, one server each (the first "
                        "serves the router, the last runs the draft; --prefill-gpus and "
                        "--prefill-resources are per stage)")
    p.add_argument("--worker-args", default="", metavar="'FLAGS'",
                   help="engine flags passed to every worker, e.g. '--num-pages 512'")
    add_device_args(p)  # passed to every worker as given: each resolves auto on its own node
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="EAGLE draft for every worker ('auto': MODEL/draft, if present; "
                        "'mtp': the Qwen3.5 checkpoint's own MTP module)")
    p.add_argument("--num-draft-tokens", type=int, default=3, metavar="K")
    add_tree_args(p)
    p.add_argument("--detach", action="store_true",
                   help="start and return; stop later with `pdserve stop`")
    add_status_args(p)  # --name


def run_launch(args: argparse.Namespace) -> int:
    """Start the cluster; without ``--detach``, serve until SIGINT/SIGTERM and stop it."""
    name = _checked_name(args.name)
    _check_http_port(args.port, args.http_port)
    from deploy import ray_launcher as rl
    from engine.device import parse_device_name

    parse_device_name(args.device)  # a misspelt device fails here, not in every worker
    from decode_node.spec.tree import TreeShape

    TreeShape(args.num_draft_tokens, args.draft_topk, args.draft_steps)  # bad flags fail here too
    model_dir = ensure_model(args.model)
    opts = rl.LaunchOptions(
        model=str(model_dir), name=name, prefill=args.prefill, decode=args.decode,
        port=args.port, http_port=args.http_port, served_model_name=args.served_model_name,
        address=args.address, prefill_gpus=args.prefill_gpus,
        decode_gpus=args.decode_gpus, prefill_resources=_resources(args.prefill_resources),
        decode_resources=_resources(args.decode_resources),
        worker_args=args.worker_args.split(), prefill_tp=args.prefill_tp_size,
        decode_tp=args.decode_tp_size, prefill_pp=args.prefill_pp_size,
        detached=args.detach,
        draft=_draft_dir(args.draft, model_dir), num_draft_tokens=args.num_draft_tokens,
        draft_topk=args.draft_topk, draft_steps=args.draft_steps,
        device=args.device, dtype=args.dtype, graphs=not args.no_graphs,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes or ()),
    )
    _interrupt_on_sigterm()
    started_head = _choose_ray(opts)
    try:
        rl.connect(opts.address)
        _interrupt_on_sigterm()  # again: ray.init installs a SIGTERM handler of its own
        cluster = rl.launch(opts)
    except BaseException:
        _leave_ray(started_head, opts.name)
        raise
    print(f"router: {cluster.router_address}  (prefill {args.prefill}, decode {args.decode})")
    if cluster.openai_url:
        print(f"openai: {cluster.openai_url}")
    print(f"READY {cluster.router_address}", flush=True)
    if args.detach:
        _state_path(name).write_text(json.dumps({"router": cluster.router_address,
                                                 "openai": cluster.openai_url,
                                                 "ray": opts.address}))
        rl.disconnect()
        return 0
    _wait_for_signal()
    print("stopping ...", flush=True)
    rl.stop(cluster.actors())
    rl.disconnect()
    print("stopped", flush=True)
    return 0


def _choose_ray(opts: LaunchOptions) -> bool:
    """Set ``opts.address`` to the Ray cluster to use (see the module docstring); True when
    this launch started a Ray head for it. A cluster found on this machine is joined as
    ``auto``, which is how Ray lets a local driver use the cluster's token."""
    from deploy import ray_launcher as rl

    if opts.address:
        return False
    running = rl.local_cluster()
    if running:
        print(f"using the Ray cluster at {running}, already running; it stays up after this "
              "cluster stops", flush=True)
        opts.address = "auto"
        return False
    if not opts.detached:
        opts.address = "local"  # a Ray instance of this process, gone when it exits
        return False
    _head_path().write_text(json.dumps({"address": rl.start_head()}))
    opts.address = "auto"
    return True


def _leave_ray(started_head: bool, name: str) -> None:
    """After a failed launch of cluster ``name``: disconnect, and stop the head it started
    unless a pdserve cluster of someone else runs on it (``name``'s own actors, just killed, may
    still be listed: ``ray.kill`` is asynchronous)."""
    from deploy import ray_launcher as rl

    left = rl.disconnect(stop_head_if_unused=started_head, ignore=name)
    if started_head and not left:
        _head_path().unlink(missing_ok=True)


def run_status(args: argparse.Namespace) -> int:
    """Report cluster ``--name``; exit 1 when it does not run or one of its servers does not
    (named on a ``not running:`` line: it ended, or its Ray node left)."""
    name = _checked_name(args.name)
    from deploy import ray_launcher as rl

    if (why := _join(name)) is not None:
        return _not_running(name, [], why)
    status = rl.cluster_status(name)
    if status is None:
        return _not_running(name, rl.cluster_names())
    print(f"router: {status.router_address}")
    if status.openai_url:
        print(f"openai: {status.openai_url}")
    alive = status.running.values()
    print(f"servers alive: {sum(alive)}/{len(alive)}")
    down = [label for label, up in status.running.items() if not up]
    if down:
        print(f"not running: {', '.join(down)} (a server that ended, or whose Ray node left or "
              "does not answer)")
    return 0 if not down else 1


def run_stop(args: argparse.Namespace) -> int:
    """Stop cluster ``--name`` (exit 1 if it does not run), then the Ray head a detached launch
    started, once no pdserve cluster is left on it."""
    name = _checked_name(args.name)
    from deploy import ray_launcher as rl

    if (why := _join(name)) is not None:
        return _not_running(name, [], why)
    actors = rl.cluster_actors(name)
    if actors:
        rl.stop(list(actors.values()))
        print(f"stopped the pdserve cluster {name!r}")
    head = json.loads(_head_path().read_text()) if _head_path().is_file() else {}
    ours = head.get("address") == rl.current_address()
    left = rl.disconnect(stop_head_if_unused=ours, ignore=name)  # its actors were just killed
    if ours and not left:
        _head_path().unlink()
        print("stopped the Ray head pdserve started")
    _state_path(name).unlink(missing_ok=True)
    return 0 if actors else _not_running(name, left)


def _join(name: str) -> str | None:
    """Connect to the Ray cluster ``name``'s launch used (else the one on this machine); when
    none answers, say so (Ray's own error names only its ``--address`` flag)."""
    from deploy import ray_launcher as rl

    address = _state(name).get("ray", "auto")
    if address == "auto" and rl.local_cluster() is None:  # not even a stale address file's
        return "no Ray cluster runs here"
    try:
        rl.connect(address)
    except ConnectionError as exc:
        return "no Ray cluster runs here" if address == "auto" else str(exc)
    return None


def _not_running(name: str, others: list[str], why: str = "") -> int:
    detail = f"running: {', '.join(others)}" if others else why
    suffix = f" ({detail})" if detail else ""
    print(f"error: no pdserve cluster named {name!r} is running{suffix}", file=sys.stderr)
    return 1


def _check_http_port(port: int, http_port: int | None) -> None:
    """Refuse an HTTP door on the router's own gRPC port (0 for both is two free ports)."""
    from engine.errors import InvalidRequestError

    if http_port is not None and http_port != 0 and http_port == port:
        raise InvalidRequestError(f"--http-port {http_port} is the router's --port: give the "
                                  "HTTP door a port of its own")


def _checked_name(name: str) -> str:
    from engine.errors import InvalidRequestError

    if not NAME.fullmatch(name):
        raise InvalidRequestError(f"--name {name!r}: use 1 to 63 letters, digits, '.', '_' or "
                                  "'-', starting with a letter or digit")
    return name


def _state(name: str) -> dict[str, Any]:
    """What the detached launch of ``name`` recorded, or {}."""
    path = _state_path(name)
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _state_path(name: str) -> Path:
    cache_dir().mkdir(parents=True, exist_ok=True)
    return cache_dir() / f"launch-{name}.json"


def _head_path() -> Path:
    cache_dir().mkdir(parents=True, exist_ok=True)
    return cache_dir() / HEAD_FILE


def _interrupt_on_sigterm() -> None:
    """Make SIGTERM act as Ctrl-C (KeyboardInterrupt), so a stopped start-up cleans up too."""
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


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
