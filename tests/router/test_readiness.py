"""The router's readiness rule and its on-demand probe, with fake workers (no model, no node
processes): :func:`router.workers.readiness`, the flips :class:`WorkerPool` reports, the HTTP
door's ``/health``, and a prefill that comes up after the router's first poll failed."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, cast

import grpc
from aiohttp import web

from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from router.http_door import HttpDoor
from router.workers import DECODE, PREFILL, Readiness, Worker, WorkerPool, readiness

BOOT = "10.0.0.1:7000"


def worker(address: str, kind: str, healthy: bool, bootstrap: str = "",
           error: str = "") -> Worker:
    return Worker(address, kind, cast(Any, None), cast(Any, None),
                  report=wpb.LoadReport(bootstrap=bootstrap), healthy=healthy, error=error)


def test_rule_needs_a_reachable_decode_and_a_prefill_with_bootstrap() -> None:
    down_d = worker("d:1", DECODE, False, error="GetLoad failed: UNAVAILABLE")
    up_d = worker("d:2", DECODE, True)
    no_boot = worker("p:1", PREFILL, True)
    down_p = worker("p:2", PREFILL, False, BOOT, error="GetLoad failed: UNAVAILABLE")
    up_p = worker("p:3", PREFILL, True, BOOT)

    state = readiness([up_p], [down_d], need_prefill=True)
    assert not state.ready and "decode" in state.reason and "d:1: GetLoad failed" in state.reason
    assert not readiness([up_p], [], need_prefill=True).ready
    assert "none known yet" in readiness([], [], need_prefill=False).reason
    state = readiness([no_boot, down_p], [up_d], need_prefill=True)
    assert not state.ready
    assert "p:1: no bootstrap address" in state.reason and "p:2: GetLoad failed" in state.reason
    assert readiness([no_boot, down_p, up_p], [down_d, up_d], need_prefill=True).ready
    assert readiness([], [up_d], need_prefill=False).ready  # colocated: a decode is enough
    assert not readiness([], [down_d], need_prefill=False).ready


class FakeStub:
    """``GetLoad`` of a worker that is up (answers ``report``) or down (UNAVAILABLE)."""

    def __init__(self, bootstrap: str = "") -> None:
        self.up = False
        self.bootstrap = bootstrap
        self.calls: list[bool] = []  # wait_for_ready of each call

    async def GetLoad(self, request: wpb.GetLoadRequest, *, timeout: float,  # noqa: N802
                      metadata: Any, wait_for_ready: bool) -> wpb.LoadReport:
        self.calls.append(wait_for_ready)
        if not self.up:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "connection refused")
        return wpb.LoadReport(bootstrap=self.bootstrap)


def test_pool_reports_each_flip_once_and_probes_on_demand() -> None:
    async def main() -> None:
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"])
        p, d = FakeStub(BOOT), FakeStub()
        pool.prefill[0].stub, pool.decode[0].stub = cast(Any, p), cast(Any, d)
        flips: list[bool] = []

        async def note(state: Readiness) -> None:
            flips.append(state.ready)

        pool.on_change = note
        await pool.refresh()  # both down
        assert not pool.readiness.ready and flips == []
        d.up = True
        await pool.refresh()
        assert not pool.readiness.ready and "prefill" in pool.readiness.reason
        p.up = True
        await pool.refresh()
        assert pool.readiness.ready and flips == [True]
        await pool.refresh()
        assert flips == [True]  # no flip, no call
        p.up = False
        await pool.refresh()
        assert not pool.readiness.ready and flips == [True, False]
        # a request picking the down prefill asks it at once (waiting for its connection)
        p.up = True
        p.calls.clear()
        await pool.ensure(pool.prefill[0])
        assert p.calls == [True] and pool.prefill[0].report.bootstrap == BOOT
        assert pool.readiness.ready and flips == [True, False, True]
        d.calls.clear()
        await pool.ensure(pool.decode[0])  # healthy: nothing to ask
        assert d.calls == []
        await pool.close()

    asyncio.run(main())


def test_http_health_mirrors_readiness() -> None:
    async def main() -> None:
        pool = WorkerPool([], ["127.0.0.1:2"])
        assets = type("Assets", (), {"tokenizer": None})()
        door = HttpDoor(cast(Any, type("Service", (), {"pool": pool, "assets": assets})()), "tiny")
        answer = await door.health(cast(web.Request, None))
        assert answer.status == 503
        body = json.loads(cast(bytes, answer.body))
        assert body == {"status": "not ready", "reason": pool.readiness.reason}
        pool.decode[0].stub = cast(Any, FakeStub())
        cast(FakeStub, pool.decode[0].stub).up = True
        await pool.refresh()
        answer = await door.health(cast(web.Request, None))
        assert answer.status == 200 and json.loads(cast(bytes, answer.body)) == {"status": "ok"}
        await pool.close()

    asyncio.run(main())


class Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    async def GetLoad(self, request: wpb.GetLoadRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> wpb.LoadReport:
        return wpb.LoadReport(bootstrap=BOOT)


def test_prefill_up_after_a_failed_poll_is_found_on_demand() -> None:
    """The router polled before the prefill listened (its channel is now backing off); a
    request that picks it right after it comes up must reach it, not fail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])

    async def main() -> None:
        pool = WorkerPool([f"127.0.0.1:{port}"], [], refresh_s=3600.0)
        await pool.refresh()
        w = pool.prefill[0]
        assert not w.healthy and not pool.readiness.ready
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(Prefill(), server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        try:
            await pool.ensure(w)
            assert w.healthy and w.report.bootstrap == BOOT, w.error
        finally:
            await server.stop(None)
            await pool.close()

    asyncio.run(main())
