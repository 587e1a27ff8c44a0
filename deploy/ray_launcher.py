"""``pdserve launch``: a router, prefill and decode workers as Ray actors, on one machine or many.

Each actor owns one ``pdserve`` server process on the node Ray placed it on (placement follows the
role's resources: ``--prefill-gpus``, ``--decode-gpus``, custom resources such as ``NPU``).
Workers reach each other by the node IPs Ray reports; on a single-node cluster every server binds
to and is reached on 127.0.0.1, so no traffic leaves the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

NAMESPACE = "pdserve"
READY_TIMEOUT_S = 180.0
HEAD_RESOURCE = "node:__internal_head__"  # a resource only Ray's head node has


@ray.remote(num_cpus=0)
class ServerActor:
    """Runs ``pdserve ROLE ARGS`` on this actor's node and reports its address."""

    def __init__(self, role: str, args: list[str], bind_host: str, port: int = 0) -> None:
        self.role = role
        self.node_ip = ray.util.get_node_ip_address()
        advertise = "127.0.0.1" if bind_host == "127.0.0.1" else self.node_ip
        extra = ["--advertise-host", advertise] if role in ("prefill", "decode") else []
        cmd = [sys.executable, "-m", "cli.main", role, *args, "--host", bind_host,
               "--port", str(port), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.advertise = advertise
        self.port = self._wait_ready()
        self.log_tail: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self) -> int:
        assert self.proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY "):
                return int(line.split()[1])
        self.proc.kill()
        raise RuntimeError(f"{self.role} did not start:\n{''.join(lines[-40:])}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_tail = [*self.log_tail[-199:], line]

    def address(self) -> str:
        return f"{self.advertise}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (the server drains), then SIGKILL after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@dataclass
class LaunchOptions:
    model: str
    prefill: int = 1
    decode: int = 1
    port: int = 0  # the router's port; 0 picks a free one
    address: str | None = None  # join an existing Ray cluster ("auto" included)
    prefill_gpus: float = 0.0
    decode_gpus: float = 0.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)  # engine flags for both worker roles
    draft: str | None = None  # EAGLE draft directory for both roles
    num_draft_tokens: int = 3
    device: str = "auto"  # --device of both worker roles, resolved by each worker on its node
    dtype: str = "auto"
    graphs: bool = True  # False: --no-graphs
    detached: bool = False


@dataclass
class Cluster:
    router: Any
    workers: list[Any]
    router_address: str

    def actors(self) -> list[Any]:
        return [self.router, *self.workers]


# ray.remote(...) is typed as returning the class itself; it returns an actor class
_ACTOR: Any = ServerActor


def connect(address: str | None) -> None:
    """Join ``address`` (or start a local Ray instance) in our namespace."""
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)


def bind_host() -> str:
    """127.0.0.1 on a single-node cluster, else every interface (peers use node IPs)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(alive) <= 1 else "0.0.0.0"


def launch(opts: LaunchOptions) -> Cluster:
    """Start workers, then the router pointing at them; returns once all serve."""
    connect(opts.address)
    host = bind_host()
    lifetime = {"lifetime": "detached"} if opts.detached else {}
    model = ["--model", opts.model]
    workers = []
    for role, count, gpus, res in (("prefill", opts.prefill, opts.prefill_gpus,
                                    opts.prefill_resources),
                                   ("decode", opts.decode, opts.decode_gpus,
                                    opts.decode_resources)):
        args = worker_argv(role, opts)
        for i in range(count):
            actor = _ACTOR.options(name=f"{role}-{i}", num_gpus=gpus, resources=res,
                                   **lifetime).remote(role, args, host)
            workers.append((role, actor))
    try:
        addresses = ray.get([a.address.remote() for _, a in workers])
    except Exception:
        stop([a for _, a in workers])
        raise
    pre = ",".join(addr for (role, _), addr in zip(workers, addresses, strict=True)
                   if role == "prefill")
    dec = ",".join(addr for (role, _), addr in zip(workers, addresses, strict=True)
                   if role == "decode")
    router_args = [*model, "--prefill", pre, "--decode", dec]
    # the router runs on the head node, where users (and `pdserve status`) look for it
    router = _ACTOR.options(name="router", resources={HEAD_RESOURCE: 0.001},
                            **lifetime).remote("router", router_args, host, opts.port)
    try:
        router_address = ray.get(router.address.remote())
    except Exception:
        stop([a for _, a in workers] + [router])
        raise
    return Cluster(router, [a for _, a in workers], router_address)


def worker_argv(role: str, opts: LaunchOptions) -> list[str]:
    """The ``pdserve ROLE`` flags of a worker (its server flags come from :class:`ServerActor`):
    model, device flags, then ``worker_args`` (so a flag given there wins), then the draft's."""
    return ["--model", opts.model, *device_args(opts), *opts.worker_args, *draft_args(role, opts)]


def device_args(opts: LaunchOptions) -> list[str]:
    """``--device`` / ``--dtype`` / ``--no-graphs`` as given: each worker resolves ``auto`` on
    the node Ray placed it on."""
    return ["--device", opts.device, "--dtype", opts.dtype,
            *([] if opts.graphs else ["--no-graphs"])]


def draft_args(role: str, opts: LaunchOptions) -> list[str]:
    """The EAGLE flags of a worker role (the decode also gets the draft length)."""
    if not opts.draft:
        return []
    if role == "decode":
        return ["--draft", opts.draft, "--num-draft-tokens", str(opts.num_draft_tokens)]
    return ["--draft", opts.draft]


def stop(actors: Sequence[Any]) -> None:
    """Stop every server process, then the actors themselves."""
    for ref in [a.stop.remote() for a in actors]:
        try:
            ray.get(ref, timeout=60)
        except Exception:  # noqa: S110 - the actor or its node is already gone
            pass
    for a in actors:
        ray.kill(a)


def find_cluster() -> Cluster | None:
    """The detached cluster of this Ray cluster's ``pdserve`` namespace, if one runs."""
    try:
        router = ray.get_actor("router", namespace=NAMESPACE)
    except ValueError:
        return None
    workers = []
    for role in ("prefill", "decode"):
        i = 0
        while True:
            try:
                workers.append(ray.get_actor(f"{role}-{i}", namespace=NAMESPACE))
            except ValueError:
                break
            i += 1
    return Cluster(router, workers, ray.get(router.address.remote()))
