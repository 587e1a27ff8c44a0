"""Two routers in front of the same workers (``docs/deploy.md``, "Two routers"): real prefill and
decode processes on the built-in tiny model, shared by router processes and, where a test must
pick the room ids, by routers in this process.

- Streams through both routers at once equal the in-process engine's greedy output.
- A router killed (SIGKILL) while its streams run, some mid-decode and one mid-prefill: the
  client (:class:`router.client.RouterClient`) hands each to the other router, which runs it
  again (the tokens already received are checked and dropped), and every stream equals the
  engine's output. The dead router's rooms are freed on the workers: nothing stays held.
- A room id drawn by both routers: the workers refuse the second room (``ALREADY_EXISTS``) and
  leave the first alone, even when the refused router aborts its room; that router draws a new
  id and its request completes.

Every scenario ends with the leak check on every worker and every router still alive.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

import router.service
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from router.client import RouterClient
from router.config import RouterConfig
from router.preprocess import ModelAssets
from router.service import GenerationService
from router.workers import WorkerPool
from tests.cluster.harness import Node, start_node, stop_node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.streams import Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
PAGE_SIZE = 8
NUM_PAGES = 1024
LONG = 1200  # prompt tokens of a slow prefill: 75 chunks of 16


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + j * 7) % 380 for j in range(n)]


def request(prompt: list[int], new: int, request_id: str = "") -> gpb.GenerateRequest:
    """A greedy request (``temperature`` 0 set: its output is pinned, a client may replay it)."""
    return gpb.GenerateRequest(
        request_id=request_id, token_ids=gpb.TokenIds(ids=prompt),
        sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_dir, EngineConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE))


def greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return [r.token_ids for r in engine.generate([Prompt(token_ids=p) for p in prompts], params)]


@pytest.fixture(scope="module")
def nodes(tiny_dir: Path) -> Iterator[dict[str, Node]]:
    """One prefill (16-token chunks, so a long prompt stays in prefill a while), one decode, and
    routers ``a`` and ``b`` over both."""
    model = ["--model", str(tiny_dir), "--port", "0", "--page-size", str(PAGE_SIZE),
             "--num-pages", str(NUM_PAGES)]
    started: dict[str, Node] = {}
    try:
        p, d = start_all([["prefill", *model, "--max-num-batched-tokens", "16"],
                          ["decode", *model]])
        started.update(p=p, d=d)
        started["a"], started["b"] = start_all([router_args(tiny_dir, p, d)] * 2)
        yield started
    finally:
        stop_all(list(started.values()))


def router_args(tiny_dir: Path, p: Node, d: Node) -> list[str]:
    return ["router", "--model", str(tiny_dir), "--port", "0", "--prefill", p.address,
            "--decode", d.address]


class ClientDoor:
    """A :class:`RouterClient` where :class:`tests.cluster.streams.Stream` wants a stub."""

    def __init__(self, client: RouterClient) -> None:
        self.client = client

    def Generate(self, req: gpb.GenerateRequest,  # noqa: N802 - the stub's method name
                 timeout: float) -> Iterator[gpb.GenerateResponse]:
        return self.client.generate(req, timeout)


def test_streams_through_both_routers_equal_the_engine(nodes: dict[str, Node],
                                                       engine: LLMEngine) -> None:
    prompts = [ids(i, 10 + 9 * i) for i in range(8)]
    want = greedy(engine, prompts, 40)
    before = [get_stats(nodes[r].address).requests_total for r in ("a", "b")]
    channels = [grpc.insecure_channel(nodes[r].address) for r in ("a", "b")]
    try:
        stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in channels]
        streams = [Stream(stubs[i % 2], request(p, 40)) for i, p in enumerate(prompts)]
        for s in streams:
            s.join()
    finally:
        for ch in channels:
            ch.close()
    assert [s.error for s in streams] == [None] * len(streams)
    assert [s.tokens for s in streams] == want
    after = [get_stats(nodes[r].address).requests_total for r in ("a", "b")]
    assert [n - m for n, m in zip(after, before, strict=True)] == [4, 4]
    assert_all_idle([nodes[n].address for n in ("p", "d", "a", "b")])


def test_a_killed_router_hands_its_streams_to_the_other(nodes: dict[str, Node],
                                                        engine: LLMEngine,
                                                        tiny_dir: Path) -> None:
    new = 200  # long enough that the streams still run when their router dies
    prompts = [ids(20 + i, 12 + 11 * i) for i in range(4)]
    slow = ids(30, LONG)
    want = greedy(engine, [*prompts, slow], new)
    doomed = start_node(router_args(tiny_dir, nodes["p"], nodes["d"]))
    b = nodes["b"].address
    before_b = get_stats(b).requests_total
    try:
        with RouterClient([doomed.address, b]) as client:
            door = ClientDoor(client)
            streams = [Stream(door, request(p, new)) for p in prompts]
            wait_for(lambda: all(len(s.tokens) >= 3 for s in streams), "the streams never started")
            late = Stream(door, request(slow, new))
            wait_for(lambda: get_stats(nodes["p"].address).waiting_tokens > 0,
                     "the long prompt never reached the prefill")
            assert get_stats(doomed.address).requests_running == len(prompts) + 1
            assert get_stats(nodes["d"].address).requests_running >= len(prompts)
            assert not late.tokens  # it dies mid-prefill
            doomed.proc.kill()
            doomed.proc.wait()
            killed_at = time.monotonic()
            for s in [*streams, late]:
                s.join()
            assert client.order == [b, doomed.address]
    finally:
        stop_node(doomed)  # when the test failed before the kill
    assert [s.error for s in [*streams, late]] == [None] * (len(prompts) + 1)
    assert [s.tokens for s in [*streams, late]] == want
    assert all(s.ended_at > killed_at for s in [*streams, late])  # they were mid-stream
    assert get_stats(b).requests_total == before_b + len(prompts) + 1  # every one replayed
    assert_all_idle([nodes[n].address for n in ("p", "d", "a", "b")])


def test_workers_refuse_a_running_room_and_keep_it(nodes: dict[str, Node]) -> None:
    """What a room id drawn twice meets on the workers: the second call is refused with
    ``ALREADY_EXISTS``, and an ``AbortRoom`` naming the second request finds nothing, while the
    first request's room runs on until an abort names it."""
    room = 4242
    with grpc.insecure_channel(nodes["p"].address) as pch, \
            grpc.insecure_channel(nodes["d"].address) as dch:
        pstub, dstub = worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)

        def worker_request(rid: str) -> wpb.WorkerRequest:
            return wpb.WorkerRequest(room=room, request_id=rid, token_ids=ids(40, 16),
                                     sampling=gpb.SamplingParams(max_new_tokens=3000,
                                                                 ignore_eos=True))

        # the decode: a local room streaming
        first = dstub.Decode(wpb.DecodeRequest(request=worker_request("one"), local_prefill=True),
                             timeout=60)
        got = [next(first)]
        with pytest.raises(grpc.RpcError) as err:
            list(dstub.Decode(wpb.DecodeRequest(request=worker_request("two"),
                                                local_prefill=True), timeout=10))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert not dstub.AbortRoom(wpb.AbortRoomRequest(room=room, request_id="two")).found
        got.append(next(first))
        assert not got[-1].finished  # the first room runs on
        assert dstub.AbortRoom(wpb.AbortRoomRequest(room=room, request_id="one")).found
        assert [m.finish_reason for m in first][-1] == "abort"

        # the prefill: a room waiting at its gate for a destination that never comes
        pending = pstub.Prefill.future(wpb.PrefillRequest(request=worker_request("one")),
                                       timeout=60)
        wait_for(lambda: get_stats(nodes["p"].address).rooms_active == 1, "no room gated")
        with pytest.raises(grpc.RpcError) as err:
            pstub.Prefill(wpb.PrefillRequest(request=worker_request("two")), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert not pstub.AbortRoom(wpb.AbortRoomRequest(room=room, request_id="two")).found
        assert not pending.done()
        assert pstub.AbortRoom(wpb.AbortRoomRequest(room=room, request_id="one")).found
        with pytest.raises(grpc.RpcError) as err:
            pending.result()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert_all_idle([nodes[n].address for n in ("p", "d")])


class InProcessRouters:
    """Two routers (services and pools) on one event loop, over the same workers."""

    def __init__(self, tiny_dir: Path, p: str, d: str) -> None:
        self.config = RouterConfig(tiny_dir, prefill=(p,), decode=(d,))
        self.assets = ModelAssets.from_dir(tiny_dir)
        self.services: list[GenerationService] = []

    async def start(self) -> list[GenerationService]:
        for _ in range(2):
            pool = WorkerPool(self.config.prefill, self.config.decode, refresh_s=0.2)
            await pool.start()
            self.services.append(GenerationService(self.config, self.assets, pool))
        return self.services

    async def close(self) -> None:
        for service in self.services:
            await service.pool.close()


async def tokens_of(stream: AsyncIterator[gpb.GenerateResponse],
                    first: asyncio.Event | None = None) -> tuple[list[int], str]:
    """Every token of ``stream`` and its finish reason; sets ``first`` at its first token."""
    out: list[int] = []
    reason = ""
    async for msg in stream:
        out.extend(msg.token_ids)
        reason = msg.finish_reason or reason
        if first is not None and out:
            first.set()
    return out, reason


def test_a_room_id_drawn_by_both_routers_is_redrawn(nodes: dict[str, Node], engine: LLMEngine,
                                                    tiny_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    room, other = 7777, 8888
    draws = iter([room, room, other])  # router A draws the room; B draws it too, then another
    lock = threading.Lock()

    def randbits(bits: int) -> int:
        with lock:
            return next(draws)

    monkeypatch.setattr(router.service, "secrets", SimpleNamespace(randbits=randbits))
    one, two = ids(50, 20), ids(51, 30)
    long_one = 250  # A's room still runs on the decode when B's request arrives
    [want_one], [want_two] = greedy(engine, [one], long_one), greedy(engine, [two], 60)
    routers = InProcessRouters(tiny_dir, nodes["p"].address, nodes["d"].address)

    async def scenario() -> tuple[tuple[list[int], str], tuple[list[int], str]]:
        a, b = await routers.start()
        try:
            started = asyncio.Event()
            first = asyncio.create_task(tokens_of(a.generate(request(one, long_one), 60),
                                                  started))
            await asyncio.wait_for(started.wait(), 60)  # A's room runs on the decode
            second = await tokens_of(b.generate(request(two, 60), 60))
            return await first, second
        finally:
            await routers.close()

    (got_one, why_one), (got_two, why_two) = asyncio.run(scenario())
    a, b = routers.services
    assert (got_one, why_one) == (want_one, "length")  # untouched by B's clean-up
    assert (got_two, why_two) == (want_two, "length")
    assert (a.metrics["room_collisions"], b.metrics["room_collisions"]) == (0, 1)
    assert (a.metrics["requests"], b.metrics["requests"]) == (1, 1)
    assert b.metrics["recovered_retry"] == 0  # no recovery budget spent, no worker blamed
    assert next(draws, None) is None
    for service in (a, b):
        assert {k: v for k, v in service.stats().items()
                if k in ("requests_running", "rooms_active")} == {"requests_running": 0,
                                                                  "rooms_active": 0}
    assert_all_idle([nodes[n].address for n in ("p", "d")])

