"""A pdserve cluster on test hosts: the router, the prefill and each decode are real ``pdserve``
processes, each in a host (network namespace) of its own, serving on and advertising the host's
address, so every call and every KV transfer between them crosses the hosts' links, which a test
can shape and cut (:mod:`bench.netns_hosts`).

Layout: host 0 runs the router, host 1 the prefill, host 2 + i decode ``i``. Every host has a
network stack of its own, so the ports are fixed (:data:`ROUTER_PORT`, ...). The nodes start as
:mod:`tests.cluster.harness` starts them (``ip netns exec`` in front), the workers concurrently,
then the router; :meth:`ServingHosts.wait_serving` waits until the router's health says SERVING.

The test process reaches each node through a door (:mod:`tests.netns.doors`: a Unix socket
relayed to the node's port inside its host), so it can call the router and check every node's
figures even while a node's link is cut; :meth:`ServingHosts.assert_idle` is the leak check of
:mod:`tests.cluster.stats` over every node. :meth:`ServingHosts.established` lists, with ``ss``
inside a host, the TCP connections that host has open toward another.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.netns_hosts import Host, Hosts
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node, start_each, start_node, stop_all
from tests.cluster.stats import assert_all_idle
from tests.netns.doors import open_door

ROUTER_PORT = 50050
PREFILL_PORT, BOOTSTRAP_PORT = 50051, 50052
DECODE_PORT = 50061


@dataclass
class Member:
    """One node of the cluster: its name (``router``, ``prefill``, ``decode0``, ...), its host,
    its process and the door the test process reaches it through."""

    name: str
    host: Host
    node: Node
    door: str  # gRPC target in the test process (unix:PATH)

    @property
    def address(self) -> str:
        """``HOST:PORT`` as the other nodes reach it."""
        return self.node.address


class ServingHosts:
    """A router, a prefill and ``decodes`` decodes on ``hosts`` (at least ``2 + decodes``) of
    ``model``; ``worker_flags`` go to the prefill and every decode, ``router_flags`` to the
    router. :meth:`close` stops them all (the hosts' own teardown kills what is left)."""

    def __init__(self, hosts: Hosts, model: Path, *, decodes: int = 1,
                 worker_flags: Sequence[str] = (), router_flags: Sequence[str] = ()) -> None:
        if len(hosts) < 2 + decodes:
            raise ValueError(f"{decodes} decodes need {2 + decodes} hosts, got {len(hosts)}")
        self._dir = tempfile.mkdtemp(prefix="pdsn-doors-")  # short: a socket path's limit
        self.members: dict[str, Member] = {}
        try:
            self._start(hosts, model, decodes, worker_flags, router_flags)
        except BaseException:
            self.close()
            raise
        self._channel = grpc.insecure_channel(self.router.door)

    def _start(self, hosts: Hosts, model: Path, decodes: int, worker_flags: Sequence[str],
               router_flags: Sequence[str]) -> None:
        engine = ["--model", str(model), *worker_flags]
        workers = {
            "prefill": (hosts[1], ["prefill", *engine, "--port", str(PREFILL_PORT),
                                   "--bootstrap-port", str(BOOTSTRAP_PORT)]),
            **{f"decode{i}": (hosts[2 + i], ["decode", *engine, "--port", str(DECODE_PORT)])
               for i in range(decodes)},
        }
        self._add(workers)
        decode_list = ",".join(self.members[f"decode{i}"].address for i in range(decodes))
        self._add({"router": (hosts[0], [
            "router", "--model", str(model), "--port", str(ROUTER_PORT),
            "--prefill", self.members["prefill"].address, "--decode", decode_list,
            *router_flags])})

    def _add(self, commands: dict[str, tuple[Host, list[str]]]) -> None:
        """Start ``commands`` (name: its host and its ``pdserve`` arguments, ``--host`` added)
        concurrently, each with a door."""
        names = list(commands)
        nodes = start_each([functools.partial(
            start_node, [*args, "--host", host.address], prefix=["ip", "netns", "exec",
                                                                 host.netns], host=host.address)
            for host, args in commands.values()])
        for name, node in zip(names, nodes, strict=True):
            host = commands[name][0]
            door = open_door(host, f"{self._dir}/{name}", node.port)
            self.members[name] = Member(name, host, node, door)

    @property
    def router(self) -> Member:
        return self.members["router"]

    @property
    def prefill(self) -> Member:
        return self.members["prefill"]

    def decode(self, i: int = 0) -> Member:
        return self.members[f"decode{i}"]

    def stub(self) -> generate_pb2_grpc.GenerationStub:
        """A ``Generation`` stub on the test process's channel to the router."""
        return generate_pb2_grpc.GenerationStub(self._channel)

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Wait until the router's health says SERVING (it reached a prefill and a decode)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError:
                status = health_pb2.HealthCheckResponse.UNKNOWN
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            assert time.monotonic() < deadline, f"the router is not serving:\n{self.logs()}"
            time.sleep(0.1)

    def assert_idle(self, timeout_s: float = 15.0) -> None:
        """The leak check on every node: no pages, aux slots, state slots, rooms or requests
        held (the router's room table included), within ``timeout_s``."""
        assert_all_idle([m.door for m in self.members.values()], timeout_s)

    def established(self, member: Member, peer: Member) -> list[str]:
        """The TCP connections ``member``'s host has ESTABLISHED toward ``peer``'s address
        (``ss`` lines, with the owning process)."""
        ip = peer.host.address
        out = member.host.run(["ss", "-Htnp", "state", "established", "dst", ip])
        return [line for line in out.splitlines() if line.strip()]

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` of every node's output, for a failure's message."""
        return "\n".join(f"--- {m.name} ---\n{''.join(m.node.log[-lines:])}"
                         for m in self.members.values())

    def close(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove the doors' sockets."""
        if hasattr(self, "_channel"):
            self._channel.close()
        stop_all([m.node for m in self.members.values()])
        shutil.rmtree(self._dir, ignore_errors=True)
