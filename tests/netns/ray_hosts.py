"""A Ray cluster across test hosts, ``pdserve`` commands run on them, and a client inside one.

- :class:`RayHosts`: a Ray head on host 0 (``ray start --head --node-ip-address=ADDRESS``) and
  Ray worker nodes joining it from other hosts (``ray start --address=HEAD``), each node with a
  temp dir of its own under one short directory (Ray's unix socket paths must stay under 108
  characters) and with token authentication on, its own token (Ray 2.60 turns tokens on for a
  head wherever ``~/.ray/auth_token`` exists, and a worker node or a driver that joins by
  address then needs ``RAY_AUTH_MODE=token`` and the token). :meth:`RayHosts.pdserve` runs a
  ``pdserve`` command inside a host with that environment. Nothing here runs ``ray stop``: it
  ends every Ray process of the machine (it finds them by name, in every namespace), other runs'
  too; :meth:`RayHosts.leave` and :meth:`RayHosts.close` kill a host's processes instead.
- :func:`servers`: the ``pdserve`` server processes inside each host (role, pid, flags).
- :class:`Client`: a process inside a host that streams ``Generate`` calls to a router and runs
  the leak check (``tests/cluster/stats``'s) on nodes only the hosts can reach.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.netns_hosts import Host, Hosts

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")  # the ray CLI of this environment
GCS_PORT = 6379
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's least is 75 MiB; nothing here uses the store
RAY_START_TIMEOUT_S = 120.0
# Ray's head checks every node's health each second and marks it dead after 3 failed checks in
# a row (Ray's defaults: every 3 s, 5 failures): a killed raylet fails each check at once, one
# slowed by the load of the tests' 2 cores only after the 5 s timeout
RAY_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "5000",
                     "RAY_health_check_failure_threshold": "3"}
_WAIT_LEFT = """
import sys, time, ray
head, node_ip, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
ray.init(address=head, log_to_driver=False, configure_logging=False)
deadline = time.monotonic() + timeout_s
while any(n["Alive"] and n["NodeManagerAddress"] == node_ip for n in ray.nodes()):
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.2)
"""


@dataclass(frozen=True)
class Server:
    """A ``pdserve ROLE`` server process inside a host."""

    role: str  # "router", "prefill" or "decode"
    pid: int
    argv: list[str]

    def flag(self, name: str) -> str:
        """The value of flag ``name`` on the server's command line."""
        return self.argv[self.argv.index(name) + 1]


def netns_pids(host: Host) -> list[int]:
    """Every process inside ``host``'s namespace."""
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                         check=True).stdout
    return [int(p) for p in out.split()]


def servers(host: Host) -> list[Server]:
    """The ``pdserve`` server processes (``python -m cli.main ROLE ...``) inside ``host``."""
    found = []
    for pid in netns_pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:  # it ended since it was listed
            continue
        if argv[1:3] == ["-m", "cli.main"] and argv[3:4] in (["router"], ["prefill"], ["decode"]):
            found.append(Server(argv[3], pid, argv))
    return found


class RayHosts:
    """A Ray cluster whose nodes are test hosts: the head on ``hosts[0]`` (0 CPUs: only
    pdserve's actors, which ask for none, run on these nodes), more nodes by :meth:`join`."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        self.head = f"{hosts[0].address}:{GCS_PORT}"
        self.dir = Path(tempfile.mkdtemp(prefix="pdray-", dir="/tmp"))
        self.env = {**os.environ, **RAY_HEALTH_CHECKS, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "PDSERVE_CACHE": str(self.dir / "cache"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT)}
        try:
            self._ray_start(hosts[0], ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"],
                            hosts[0].address, {})
        except BaseException:
            self.close()
            raise

    def join(self, i: int, resources: Mapping[str, float], node_ip: str | None = None) -> None:
        """Start a Ray worker node on host ``i`` that joins the head, with custom ``resources``;
        its node IP is ``node_ip`` (default: the host's address)."""
        host = self.hosts[i]
        self._ray_start(host, [f"--address={self.head}"], node_ip or host.address, resources)

    def _ray_start(self, host: Host, args: Sequence[str], node_ip: str,
                   resources: Mapping[str, float]) -> None:
        host_dir = self.dir / host.netns.rsplit("-", 1)[1]  # h0, h1, ...
        cmd = [RAY, "start", *args, f"--node-ip-address={node_ip}", f"--temp-dir={host_dir}",
               "--num-cpus=0", f"--object-store-memory={OBJECT_STORE_BYTES}",
               f"--resources={json.dumps(dict(resources))}", "--disable-usage-stats"]
        proc = host.popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
        out, _ = proc.communicate(timeout=RAY_START_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on {host.netns} failed: {out[-2000:]}")

    def pdserve(self, i: int, *args: str, env: Mapping[str, str] | None = None,
                timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """Run ``pdserve ARGS`` inside host ``i`` to the end, with the cluster's environment
        (or ``env``)."""
        proc = self.hosts[i].popen([sys.executable, "-m", "cli.main", *args],
                                   env=self.env if env is None else env, cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def wait_left(self, node_ip: str, timeout_s: float = 60.0) -> None:
        """Wait until Ray's head lists the node of ``node_ip`` as dead (a driver on host 0
        asks it); TimeoutError after ``timeout_s``."""
        proc = self.hosts[0].popen([sys.executable, "-c", _WAIT_LEFT, self.head, node_ip,
                                    str(timeout_s)], env=self.env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=timeout_s + 60)
        if proc.returncode != 0:
            raise TimeoutError(f"Ray still lists node {node_ip} alive: {out[-2000:]}")

    def leave(self, i: int) -> None:
        """Host ``i`` leaves as a machine that fails: every process inside it is killed
        (its Ray node, pdserve's actors and servers) at once."""
        for pid in netns_pids(self.hosts[i]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def close(self) -> None:
        """Kill every process on the hosts (the hosts' own close does it too) and delete the
        nodes' temp dirs."""
        for i in range(len(self.hosts)):
            self.leave(i)
        shutil.rmtree(self.dir, ignore_errors=True)


def _client(conn: Any) -> None:
    """The client process (inside a host): answers ``(name, args)`` calls until ``stop``."""
    import grpc

    from proto.pdserve.v1 import generate_pb2 as gpb
    from proto.pdserve.v1 import generate_pb2_grpc
    from tests.cluster.stats import assert_all_idle, get_stats
    from tests.cluster.streams import Stream

    streams: list[Stream] = []
    channels: list[grpc.Channel] = []

    def start(router: str, prompts: list[list[int]], new_tokens: int) -> None:
        channel = grpc.insecure_channel(router)
        channels.append(channel)
        stub = generate_pb2_grpc.GenerationStub(channel)
        for ids in prompts:
            req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids), sampling=gpb.SamplingParams(
                max_new_tokens=new_tokens, ignore_eos=True))
            streams.append(Stream(stub, req))

    def progress() -> list[int]:
        return [len(s.tokens) for s in streams]

    def finish(timeout_s: float) -> list[tuple[list[int], str, float]]:
        """Each stream's tokens, its error's code name ("" when none) and when it ended."""
        done = [s.join(timeout_s) for s in streams]
        streams.clear()
        for channel in channels:
            channel.close()
        channels.clear()
        return [(s.tokens, s.error.code().name if s.error else "", s.ended_at) for s in done]

    def stats(address: str) -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        return MessageToDict(get_stats(address), preserving_proto_field_name=True)

    calls = {"start": start, "progress": progress, "finish": finish, "stats": stats,
             "idle": assert_all_idle}
    conn.send("ready")
    while True:
        name, args = conn.recv()
        if name == "stop":
            return
        try:
            conn.send(("ok", calls[name](*args)))
        except Exception as exc:  # noqa: BLE001 - the test gets it as a RuntimeError
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Client:
    """A gRPC client in a process inside ``host`` (the test's own process is outside every
    host and reaches none of their addresses)."""

    def __init__(self, host: Host) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = host.spawn(_client, child)
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError(f"the client on {host.netns} did not start")
        self.conn.recv()

    def call(self, name: str, *args: Any, timeout: float = 180.0) -> Any:
        """Call ``name`` in the client process: ``start(router, prompts, new_tokens)`` opens
        greedy streams, ``progress()`` is each one's token count, ``finish(timeout_s)`` waits
        for them (tokens, error code name, end time on ``time.monotonic``'s clock, which every
        process of the machine shares), ``stats(address)`` is a node's Admin stats as a dict,
        ``idle(addresses, timeout_s)`` the leak check."""
        self.conn.send((name, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer to {name} in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"client call {name} failed: {value}")
        return value

    def stop(self) -> None:
        """End the client process."""
        if self.proc.is_alive():
            self.conn.send(("stop", ()))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
