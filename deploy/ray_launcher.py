"""``pdserve launch``: a router, prefill and decode workers as Ray actors, on one machine or many.

Each actor owns one ``pdserve`` server process on the node Ray placed it on (placement follows the
role's resources: ``--prefill-gpus``, ``--decode-gpus``, custom resources such as ``NPU``).
Workers reach each other by the node IPs Ray reports; on a single-node cluster every server binds
to and is reached on 127.0.0.1, so no traffic leaves the machine. With ``http_port`` the router
also serves the OpenAI-compatible HTTP door on its host; its actor reads the port from the
router's ``HTTP PORT`` line (0 picks a free one), and :attr:`Cluster.openai_url` is the door's URL.

Several pdserve clusters can share one Ray cluster: each has a name, and its actors are named
``NAME/router``, ``NAME/prefill-0``, ... in the Ray namespace ``pdserve``. A server process dies
with its actor (it gets SIGTERM when the actor's process ends, however it ends), so killing the
actors, or ``ray stop``, leaves no server behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

# find_gcs_addresses: what `ray status` uses to find a cluster; GcsClient: Ray's own client of
# a head's GCS
from ray._private.services import GcsClient, find_gcs_addresses
from ray._private.utils import read_ray_address

from engine.errors import EngineError
from serving.hosts import host_port

NAMESPACE = "pdserve"
READY_TIMEOUT_S = 180.0
HEAD_RESOURCE = "node:__internal_head__"  # a resource only Ray's head node has
RAY = str(Path(sys.executable).parent / "ray")  # the ray CLI of this environment
PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent ends


class LaunchError(EngineError):
    """A launch that cannot go on (a server that did not start, a name already taken, a Ray head
    that did not start); the message is one line meant for the user."""


@ray.remote(num_cpus=0)
class ServerActor:
    """Runs ``pdserve ROLE ARGS`` on this actor's node and reports its address, or why the server
    did not start (:meth:`failure`)."""

    def __init__(self, role: str, args: list[str], bind_host: str, port: int = 0,
                 members: Sequence[str] = ()) -> None:
        self.role = role
        self._members = list(members)
        self.node_ip = ray.util.get_node_ip_address()
        advertise = "127.0.0.1" if bind_host == "127.0.0.1" else self.node_ip
        extra = ["--advertise-host", advertise] if role in ("prefill", "decode") else []
        cmd = [sys.executable, "-m", "cli.main", role, *args, "--host", bind_host,
               "--port", str(port), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, preexec_fn=_die_with_parent)
        self.advertise = advertise
        self.log_tail: list[str] = []
        self.http_port: int | None = None  # the router's HTTP door, from its ``HTTP PORT`` line
        self.port, self.why_not = self._wait_ready()
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self) -> tuple[int, str]:
        """Read the server's output up to its ``READY PORT`` line (noting the ``HTTP PORT`` line
        a router with an HTTP door prints before it): ``(port, "")``, or, when the server ends
        or times out first, ``(0, its last output line)``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log_tail.append(line)
            if line.startswith("HTTP "):
                self.http_port = int(line.split()[1])
            if line.startswith("READY "):
                return int(line.split()[1]), ""
        self.proc.kill()
        last = next((ln.strip() for ln in reversed(self.log_tail) if ln.strip()), "")
        return 0, last.removeprefix("error: ") or f"no READY line in {READY_TIMEOUT_S:.0f} s"

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_tail = [*self.log_tail[-199:], line]

    def failure(self) -> str:
        """Why the server did not start (its last output line), or "" when it serves."""
        return self.why_not

    def address(self) -> str:
        """``HOST:PORT`` (``[ADDRESS]:PORT`` when the node's address is an IPv6 one)."""
        return host_port(self.advertise, self.port)

    def http_address(self) -> str | None:
        """``HOST:PORT`` of the router's OpenAI-compatible HTTP door; None when it has none."""
        return None if self.http_port is None else host_port(self.advertise, self.http_port)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def members(self) -> list[str]:
        """The router's: the labels of every worker server its launch started (``prefill-0``,
        ``prefill-0-stage-1``, ``decode-0``, ...), so a server whose actor is gone (its node
        left the Ray cluster) is still counted; [] for a worker."""
        return self._members

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


def _die_with_parent() -> None:
    """In a server process before it runs: ask Linux for SIGTERM when the actor's process ends,
    so a killed actor (``ray.kill``, ``ray stop``, a failed launch) takes its server with it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LaunchOptions:
    model: str
    name: str = "pdserve"  # the cluster's name: its actors are NAME/router, NAME/prefill-0, ...
    prefill: int = 1
    decode: int = 1
    port: int = 0  # the router's port; 0 picks a free one
    http_port: int | None = None  # the router's OpenAI-compatible HTTP door (0: a free port)
    served_model_name: str | None = None  # the door's model id (default: the model dir's name)
    address: str | None = None  # join an existing Ray cluster ("auto" included)
    prefill_gpus: float = 0.0
    decode_gpus: float = 0.0
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    worker_args: list[str] = field(default_factory=list)  # engine flags for both worker roles
    prefill_tp: int = 1  # --tp-size of every prefill worker (prefill_gpus covers its processes)
    # pipeline stages of every prefill worker, one actor each (prefill_gpus and
    # prefill_resources are per stage); the draft goes to the last stage
    prefill_pp: int = 1
    decode_tp: int = 1  # --tp-size of every decode worker (its processes; decode_gpus covers all)
    draft: str | None = None  # EAGLE draft directory for both roles
    num_draft_tokens: int = 3
    draft_topk: int = 1  # the decode's EAGLE-2 tree: children per node, and its depth
    draft_steps: int | None = None
    device: str = "auto"  # --device of both worker roles, resolved by each worker on its node
    dtype: str = "auto"
    graphs: bool = True  # False: --no-graphs
    cuda_graph_sizes: tuple[int, ...] = ()  # --cuda-graph-sizes of the decode workers (): default
    detached: bool = False


@dataclass
class Cluster:
    router: Any
    workers: list[Any]
    router_address: str
    http_address: str | None = None  # the router's HTTP door, when it has one

    def actors(self) -> list[Any]:
        return [self.router, *self.workers]

    @property
    def openai_url(self) -> str | None:
        """The base URL OpenAI clients take (``http://HOST:PORT/v1``); None without a door."""
        return None if self.http_address is None else f"http://{self.http_address}/v1"


# ray.remote(...) is typed as returning the class itself; it returns an actor class
_ACTOR: Any = ServerActor


def connect(address: str | None) -> None:
    """Join ``address`` (``"local"``: start a Ray instance of this process) in our namespace.
    Ray's own log lines are kept to errors, so the command's output stays its own. A
    ``HOST:PORT`` nothing listens on raises ConnectionError at once (Ray retries it for
    minutes)."""
    if not ray.is_initialized():
        if address:
            _check_listening(address)
            _check_token(address)
        logging.getLogger("ray").setLevel(logging.ERROR)
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)


def _check_listening(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError when ``address``, if ``HOST:PORT``, takes no TCP connection."""
    if not _host_port(address):
        return  # "auto", "local", "ray://...": Ray's to judge
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address}: {exc}") from exc


def _check_token(address: str) -> None:
    """Raise ConnectionError at once when the Ray cluster at ``address``, if ``HOST:PORT``,
    refuses this process's token (or its lack of one). Ray (2.60 here) turns token
    authentication on for a head started where a token exists (``~/.ray/auth_token``, which
    a local ``ray.init`` writes), but a driver that joins by address sends one only with
    ``RAY_AUTH_MODE=token``; ``ray.init`` then retries for 20 s and fails without the reason."""
    if not _host_port(address):
        return
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return
    try:
        with _native_stderr_silenced():  # Ray's C++ client logs the refusal too
            GcsClient(address=address)
    except AuthenticationError as exc:
        raise ConnectionError(
            f"the Ray cluster at {address} refused this process's token: it uses token "
            "authentication, so set RAY_AUTH_MODE=token here and give the cluster's token (the "
            "RAY_AUTH_TOKEN environment variable, a file named by RAY_AUTH_TOKEN_PATH, or "
            "~/.ray/auth_token)") from exc


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send what this process writes to file descriptor 2 (native code's logs included) to
    /dev/null meanwhile."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _host_port(address: str) -> bool:
    """Whether ``address`` is ``HOST:PORT`` (not ``auto``, ``local`` or ``ray://...``)."""
    host, sep, port = address.rpartition(":")
    return "://" not in address and bool(sep and host) and port.isdigit()


def bind_host() -> str:
    """127.0.0.1 on a single-node cluster, else every interface (peers use node IPs)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    return "127.0.0.1" if len(alive) <= 1 else "0.0.0.0"


def launch(opts: LaunchOptions) -> Cluster:
    """Start workers, then the router pointing at them; returns once all serve. A cluster of the
    same name on this Ray cluster is a :class:`LaunchError`; on any failure (a server that does
    not start, Ctrl-C) the actors started so far are killed, their servers with them."""
    connect(opts.address)
    if opts.name in cluster_names():
        raise LaunchError(f"a pdserve cluster named {opts.name!r} is already running on this Ray "
                          f"cluster: stop it (pdserve stop --name {opts.name}) or pick another "
                          "--name")
    started: list[Any] = []
    try:
        return _start(opts, started)
    except BaseException:
        kill(started)
        raise


def _start(opts: LaunchOptions, started: list[Any]) -> Cluster:
    """:func:`launch`'s body; every actor it creates goes into ``started`` at once.

    The decode workers and each prefill's last pipeline stage (the whole prefill without
    stages) start first; then each earlier stage, last to first, pointed at the stage after it
    (a stage waits for its next one to serve)."""
    host = bind_host()
    lifetime = {"lifetime": "detached"} if opts.detached else {}
    labels: list[str] = []

    def start(label: str, role: str, args: list[str]) -> None:
        gpus, res = ((opts.decode_gpus, opts.decode_resources) if role == "decode"
                     else (opts.prefill_gpus, opts.prefill_resources))
        labels.append(label)
        started.append(_ACTOR.options(name=actor_name(opts.name, label), num_gpus=gpus,
                                      resources=res, **lifetime).remote(role, args, host))

    pp = opts.prefill_pp
    for i in range(opts.prefill):
        start(stage_label(i, pp - 1), "prefill", worker_argv("prefill", opts, stage=pp - 1))
    for i in range(opts.decode):
        start(f"decode-{i}", "decode", worker_argv("decode", opts))
    _wait_started(opts.name, labels, started)
    for stage in range(pp - 2, -1, -1):
        after = {i: started[labels.index(stage_label(i, stage + 1))] for i in range(opts.prefill)}
        nexts = ray.get([after[i].address.remote() for i in range(opts.prefill)])
        for i, nxt in enumerate(nexts):
            start(stage_label(i, stage), "prefill",
                  worker_argv("prefill", opts, stage=stage, pp_next=nxt))
        _wait_started(opts.name, labels[-opts.prefill:], started[-opts.prefill:])
    addresses = dict(zip(labels, ray.get([a.address.remote() for a in started]), strict=True))
    router_args = ["--model", opts.model, "--prefill", _joined(addresses, "prefill"),
                   "--decode", _joined(addresses, "decode"), *http_args(opts)]
    # the router runs on the head node, where users (and `pdserve status`) look for it
    started.append(_ACTOR.options(name=actor_name(opts.name, "router"),
                                  resources={HEAD_RESOURCE: 0.001}, **lifetime)
                   .remote("router", router_args, host, opts.port, labels))
    _wait_started(opts.name, ["router"], started[-1:])
    return _cluster(started[-1], started[:-1])


def _cluster(router: Any, workers: list[Any]) -> Cluster:
    """The :class:`Cluster` of a serving ``router`` actor and its ``workers``."""
    address, http = ray.get([router.address.remote(), router.http_address.remote()])
    return Cluster(router, workers, address, http)


def http_args(opts: LaunchOptions) -> list[str]:
    """The router's ``--http-port`` / ``--served-model-name`` flags, as far as given."""
    port = [] if opts.http_port is None else ["--http-port", str(opts.http_port)]
    name = [] if opts.served_model_name is None else ["--served-model-name",
                                                      opts.served_model_name]
    return [*port, *name]


def _wait_started(name: str, labels: list[str], actors: list[Any]) -> None:
    """Wait until every server of ``actors`` serves; the first that does not start is a
    :class:`LaunchError` naming it and its last output line (the others are not waited for)."""
    pending = {a.failure.remote(): label for label, a in zip(labels, actors, strict=True)}
    while pending:
        [done], _ = ray.wait(list(pending), num_returns=1)
        label = pending.pop(done)
        failure = ray.get(done)
        if failure:
            raise LaunchError(f"{actor_name(name, label)} did not start: {failure}")


def stage_label(worker: int, stage: int) -> str:
    """The label of stage ``stage`` of prefill worker ``worker``: ``prefill-I`` for the first
    (the whole worker without stages: it serves the router), ``prefill-I-stage-K`` after it."""
    return f"prefill-{worker}" if stage == 0 else f"prefill-{worker}-stage-{stage}"


def _joined(addresses: dict[str, str], role: str) -> str:
    """The addresses of the ``role`` servers (labels ``ROLE-I``: a prefill's first stage),
    comma-separated."""
    return ",".join(a for label, a in addresses.items() if label.rsplit("-", 1)[0] == role)


def actor_name(cluster: str, label: str) -> str:
    """The Ray actor name of server ``label`` (``router``, ``prefill-0``, ...) of ``cluster``."""
    return f"{cluster}/{label}"


def worker_argv(role: str, opts: LaunchOptions, stage: int = 0,
                pp_next: str | None = None) -> list[str]:
    """The ``pdserve ROLE`` flags of a worker (its server flags come from :class:`ServerActor`):
    model, device flags, the role's ``--tp-size``, a prefill's pipeline flags (``stage`` of
    ``opts.prefill_pp``, ``pp_next`` the address of the stage after it), then ``worker_args``
    (so a flag given there wins), then the draft's (on a prefill's last stage only)."""
    size = opts.decode_tp if role == "decode" else opts.prefill_tp
    tp = ["--tp-size", str(size)] if size > 1 else []
    pp: list[str] = []
    if role == "prefill" and opts.prefill_pp > 1:
        pp = ["--pp-size", str(opts.prefill_pp), "--pp-rank", str(stage)]
        pp += ["--pp-next", pp_next] if pp_next is not None else []
    last = role != "prefill" or stage == opts.prefill_pp - 1
    return ["--model", opts.model, *device_args(opts), *tp, *pp, *opts.worker_args,
            *(draft_args(role, opts) if last else [])]


def device_args(opts: LaunchOptions) -> list[str]:
    """``--device`` / ``--dtype`` / ``--no-graphs`` / ``--cuda-graph-sizes`` as given: each
    worker resolves ``auto`` on the node Ray placed it on."""
    sizes = ["--cuda-graph-sizes", *map(str, opts.cuda_graph_sizes)] if opts.cuda_graph_sizes \
        else []
    return ["--device", opts.device, "--dtype", opts.dtype,
            *([] if opts.graphs else ["--no-graphs"]), *sizes]


def draft_args(role: str, opts: LaunchOptions) -> list[str]:
    """The EAGLE flags of a worker role (the decode also gets the draft length and tree)."""
    if not opts.draft:
        return []
    if role == "decode":
        steps = [] if opts.draft_steps is None else ["--draft-steps", str(opts.draft_steps)]
        return ["--draft", opts.draft, "--num-draft-tokens", str(opts.num_draft_tokens),
                "--draft-topk", str(opts.draft_topk), *steps]
    return ["--draft", opts.draft]


def stop(actors: Sequence[Any]) -> None:
    """Stop every server process (it drains), then the actors themselves."""
    for ref in [a.stop.remote() for a in actors]:
        try:
            ray.get(ref, timeout=60)
        except Exception:  # noqa: S110 - the actor or its node is already gone
            pass
    kill(actors)


def kill(actors: Sequence[Any]) -> None:
    """Kill actors at once, even those still starting; their servers get SIGTERM."""
    for a in actors:
        ray.kill(a)


def cluster_names() -> list[str]:
    """The names of the pdserve clusters on this Ray cluster."""
    return sorted({n.split("/", 1)[0] for n in ray.util.list_named_actors() if "/" in n})


def cluster_actors(name: str) -> dict[str, Any]:
    """Every actor of cluster ``name`` (router and workers, serving or still starting), by label
    (``router``, ``prefill-0``, ...)."""
    actors = {}
    for actor in ray.util.list_named_actors():
        if actor.startswith(f"{name}/"):
            try:
                actors[actor.split("/", 1)[1]] = ray.get_actor(actor)
            except ValueError:  # it ended since it was listed
                continue
    return actors


def find_cluster(name: str) -> Cluster | None:
    """Cluster ``name`` of this Ray cluster, once its router serves; None if it has no router."""
    actors = cluster_actors(name)
    router = actors.pop("router", None)
    if router is None:
        return None
    return _cluster(router, [actors[k] for k in sorted(actors)])


@dataclass(frozen=True)
class ClusterStatus:
    """What ``pdserve status`` reports of a cluster: its router's addresses and, for every
    server its launch started (by label), whether it runs."""

    router_address: str
    openai_url: str | None
    running: dict[str, bool]


def cluster_status(name: str, timeout_s: float = 10.0) -> ClusterStatus | None:
    """The status of cluster ``name``; None if it has no router. A server counts as not running
    when its process ended, and when its actor does not answer within ``timeout_s``: it died,
    its node left the Ray cluster (Ray lists a dead actor no more; the router remembers every
    worker its launch started) or cannot be reached."""
    actors = cluster_actors(name)
    if "router" not in actors:
        return None
    cluster = _cluster(actors["router"], [])
    labels = ["router", *ray.get(cluster.router.members.remote(), timeout=timeout_s)]
    asked = {label: actors[label].alive.remote() for label in labels if label in actors}
    deadline = time.monotonic() + timeout_s
    running = {}
    for label in labels:
        try:
            running[label] = label in asked and bool(
                ray.get(asked[label], timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.RayError:  # the actor died, is unreachable, or did not answer
            running[label] = False
    return ClusterStatus(cluster.router_address, cluster.openai_url, running)


def local_cluster() -> str | None:
    """The Ray cluster a launch without ``--address`` joins: ``$RAY_ADDRESS`` if set, else the
    one ``ray start`` left running on this machine if its GCS process is alive, else None."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    address = read_ray_address()
    return address if address and address in find_gcs_addresses() else None


def start_head() -> str:
    """``ray start --head`` on this machine; its GCS address. A failure is a :class:`LaunchError`
    with ``ray``'s last output line; Ctrl-C during the start stops what was started."""
    try:
        subprocess.run([RAY, "start", "--head", "--disable-usage-stats"], check=True,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        last = next((ln for ln in reversed(exc.stderr.splitlines()) if ln.strip()), "")
        raise LaunchError(f"`ray start --head` failed: {last.strip()}") from exc
    except KeyboardInterrupt:
        stop_head()
        raise
    return str(read_ray_address())


def stop_head() -> None:
    """``ray stop``: ends every Ray process of this machine (used on a head pdserve started)."""
    subprocess.run([RAY, "stop"], check=False, capture_output=True)


def current_address() -> str:
    """The GCS address of the Ray cluster this process is connected to."""
    return str(ray.get_runtime_context().gcs_address)


def disconnect(stop_head_if_unused: bool = False, ignore: str | None = None) -> list[str]:
    """Leave the Ray cluster; with ``stop_head_if_unused``, also stop its head (``ray stop``)
    unless a pdserve cluster other than ``ignore`` still runs on it. Returns the names of those
    still running."""
    left = [n for n in cluster_names() if n != ignore] if ray.is_initialized() else []
    ray.shutdown()
    if stop_head_if_unused and not left:
        stop_head()
    return left
