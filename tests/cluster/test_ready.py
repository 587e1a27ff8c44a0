"""Ready before serving: a router started before its workers says NOT_SERVING (gRPC health and
the HTTP door's ``/health``) until it has a usable prefill/decode pair, serves the very first
request it takes once it says SERVING, goes back to NOT_SERVING when the pair is gone, and never
fails a request for a worker that is up even when it does not know the prefill's bootstrap
address yet (an in-process router whose only poll ran before the workers listened).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from router.config import RouterConfig
from router.preprocess import ModelAssets
from router.service import GenerationService
from router.workers import WorkerPool
from tests.cluster.harness import Node, start_node, stop_node

pytestmark = pytest.mark.slow
ARGS = ["--num-pages", "64", "--page-size", "8"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request() -> gpb.GenerateRequest:
    return gpb.GenerateRequest(text="ready when you are",
                               sampling=gpb.SamplingParams(max_new_tokens=8, ignore_eos=True))


def _tokens(msgs: list[gpb.GenerateResponse]) -> list[int]:
    assert msgs and msgs[-1].finished
    return [t for m in msgs for t in m.token_ids]


def _health(ch: grpc.Channel, service: str = "") -> int:
    reply = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


def _http_health(port: int) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class InProcessRouter:
    """A router in a thread of its own whose one poll ran before the workers listened, so it
    knows no bootstrap address and both channels are backing off; :meth:`generate` then runs
    one request through it (the pool's background poll never runs again)."""

    def __init__(self, tiny_dir: Path, prefill: str, decode: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = RouterConfig(tiny_dir, prefill=(prefill,), decode=(decode,))

        async def make() -> WorkerPool:  # channels belong to the loop they are made in
            pool = WorkerPool(config.prefill, config.decode, refresh_s=3600.0)
            await pool.start()
            return pool

        self.pool: WorkerPool = self._run(make())  # type: ignore[assignment]
        self.service = GenerationService(config, ModelAssets.from_dir(tiny_dir), self.pool)

    def _run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)  # type: ignore[arg-type]

    def generate(self, request: gpb.GenerateRequest) -> list[gpb.GenerateResponse]:
        async def collect() -> list[gpb.GenerateResponse]:
            return [m async for m in self.service.generate(request, deadline_s=60)]

        return self._run(collect())  # type: ignore[return-value]

    def close(self) -> None:
        self._run(self.pool.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_router_is_ready_only_when_it_can_serve(tiny_dir: Path) -> None:
    p_addr, d_addr = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    workers = [["prefill", "--model", str(tiny_dir), "--port", p_addr.split(":")[1], *ARGS],
               ["decode", "--model", str(tiny_dir), "--port", d_addr.split(":")[1], *ARGS]]
    threads = ThreadPoolExecutor(2)
    started: list[Future[Node]] = [threads.submit(start_node, cmd) for cmd in workers]
    router: Node | None = None
    inproc: InProcessRouter | None = None
    try:  # all three start at once
        router = start_node(["router", "--model", str(tiny_dir), "--port", "0",
                             "--http-port", "0", "--prefill", p_addr, "--decode", d_addr])
        http_port = int(next(x for x in router.log if x.startswith("HTTP ")).split()[1])
        inproc = InProcessRouter(tiny_dir, p_addr, d_addr)
        with grpc.insecure_channel(router.address) as ch:
            health, status, body = _health(ch), *_http_health(http_port)
            if not all(f.done() for f in started):  # a worker is still loading: observable
                assert health == NOT_SERVING
                assert _health(ch, "pdserve.v1.Generation") == NOT_SERVING
                assert status == 503 and body["status"] == "not ready" and body["reason"]

            _wait(lambda: _health(ch) == SERVING, 90.0, "router never became SERVING")
            stub = generate_pb2_grpc.GenerationStub(ch)
            first = _tokens(list(stub.Generate(_request(), timeout=60)))  # at once: must work
            nodes = [f.result(90) for f in started]
            assert _tokens(list(stub.Generate(_request(), timeout=60))) == first
            assert _http_health(http_port) == (200, {"status": "ok"})

            # bootstrap address unknown, channels backing off, workers up: still served
            if inproc.pool.prefill[0].report.bootstrap == "":  # its one poll ran too early
                assert not inproc.pool.readiness.ready
            assert _tokens(inproc.generate(_request())) == first
            assert inproc.pool.readiness.ready

            nodes[0].proc.kill()  # the only prefill dies: no usable pair is left
            _wait(lambda: _health(ch) == NOT_SERVING, 30.0, "router stayed SERVING")
            status, body = _http_health(http_port)
            assert status == 503 and p_addr in body["reason"]
    finally:
        if inproc is not None:
            inproc.close()
        nodes = [f.result() for f in started if f.exception() is None]
        list(threads.map(stop_node, [*nodes, *([router] if router else [])]))
        threads.shutdown()
