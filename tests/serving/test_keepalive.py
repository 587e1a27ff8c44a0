"""gRPC keepalive (:mod:`serving.keepalive`): the options of every channel and server, the flags
that set them on every node, and what the two sides do with them on a real connection: a client
pinging every second is served by a pdserve server (``start_server``) on an open stream and on
an idle connection alike, where a server with gRPC's defaults sends it away (GOAWAY
``too_many_pings``). What the pings find (a partitioned peer, its connections closed on both
sides) is tested across hosts: ``tests/netns/test_serving_partitions.py``.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cli.engine_args import keepalive
from cli.main import build_parser
from router.workers import WorkerPool
from serving.keepalive import Keepalive
from serving.server import start_server


def test_keepalive_refuses_what_servers_or_grpc_cannot_take() -> None:
    for bad in ({"time_s": 0.5}, {"time_s": float("nan")}, {"timeout_s": 0.0},
                {"timeout_s": float("inf")}, {"time_s": 1e9}):
        with pytest.raises(ValueError, match="--keepalive-"):
            Keepalive(**bad)


def test_options_of_channels_and_servers() -> None:
    ka = Keepalive(time_s=2.0, timeout_s=3.5)
    pings = {"grpc.keepalive_time_ms": 2000, "grpc.keepalive_timeout_ms": 3500,
             "grpc.keepalive_permit_without_calls": 1, "grpc.http2.max_pings_without_data": 0}
    assert dict(ka.channel_options()) == pings
    # a server accepts pings every second, the shortest period any node may be given
    assert dict(ka.server_options()) == {
        **pings, "grpc.http2.min_ping_interval_without_data_ms": 1000}

    async def pool_options() -> list[tuple[str, object]]:
        """The router's worker channels' options (its channels need a running loop)."""
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"], keepalive=ka)
        try:
            return list(pool.channel_options)
        finally:
            await pool.close()

    assert set(ka.channel_options()) <= set(asyncio.run(pool_options()))


@pytest.mark.parametrize("command", ["router", "prefill", "decode"])
def test_every_node_takes_the_flags(command: str) -> None:
    parser = build_parser()
    assert keepalive(parser.parse_args([command])) == Keepalive()
    args = parser.parse_args([command, "--keepalive-time-s", "3", "--keepalive-timeout-s", "0.5"])
    assert keepalive(args) == Keepalive(3.0, 0.5)


class Pinger:
    """A client of the server at ``port`` pinging as ``ka`` says on two connections: one with
    an open ``Watch`` stream (no data after its first message) and one with no call open."""

    def __init__(self, port: int, ka: Keepalive) -> None:
        target = f"127.0.0.1:{port}"
        self.busy = grpc.aio.insecure_channel(target, options=ka.channel_options())
        self.idle = grpc.aio.insecure_channel(target, options=ka.channel_options())
        self.states: list[str] = []  # the idle connection's, from its first call on

    async def open(self) -> None:
        """Make the idle connection's one call and open the stream; then watch both."""
        await health_pb2_grpc.HealthStub(self.idle).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        watch = health_pb2_grpc.HealthStub(self.busy).Watch(health_pb2.HealthCheckRequest())
        await watch.read()
        self.stream = asyncio.ensure_future(watch.read())  # ends only with the connection
        self.states.append(self.idle.get_state().name)
        self._follower = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            await self.idle.wait_for_state_change(self.idle.get_state())
            self.states.append(self.idle.get_state().name)

    async def close(self) -> None:
        self._follower.cancel()
        self.stream.cancel()
        await self.busy.close()
        await self.idle.close()


@pytest.mark.slow  # 4 s of pings; the partition tests' streams would break on a GOAWAY too
def test_servers_take_the_pings_a_default_server_refuses() -> None:
    ka = Keepalive(time_s=1.0, timeout_s=1.0)  # the shortest period the flags take

    async def main() -> None:
        ours, port, _ = await start_server([], keepalive=ka)
        default = grpc.aio.server()  # gRPC's defaults: pings without data every 5 minutes
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), default)
        default_port = default.add_insecure_port("127.0.0.1:0")
        await default.start()
        served, refused = Pinger(port, ka), Pinger(default_port, ka)
        try:
            await asyncio.gather(served.open(), refused.open())
            # the default server sends its pinger away after 3 pings (2 strikes allowed) ...
            with pytest.raises(grpc.aio.AioRpcError) as goaway:
                await asyncio.wait_for(refused.stream, 15.0)
            assert goaway.value.code() == grpc.StatusCode.UNAVAILABLE
            # ... by then, and a ping later, ours took as many on both connections
            await asyncio.sleep(ka.time_s)
            assert not served.stream.done() and served.states == ["READY"]
        finally:
            await served.close()
            await refused.close()
            await ours.stop(None)
            await default.stop(None)

    asyncio.run(main())
