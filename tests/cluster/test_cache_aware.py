"""Cache-aware routing on real processes (one prefill, two decodes, with their prefix caches on):

- behind ``pdserve router --policy cache-aware`` (approximate, and with ``--kv-events``), every
  request sharing a long prefix goes to the decode that served it first, even while that one is
  the busier, a request with another prefix goes to the idle one, and every output equals the
  in-process engine's greedy output;
- the prefill's ``SubscribeKvEvents`` stream carries the blocks of two prompts sharing a prefix,
  and an in-process router's trees (``--kv-events``) follow; when the prefill is killed its tree
  empties at once, and after its restart (a new instance id, an empty cache) it fills only with
  what the new instance stores; nothing is left held on the nodes afterwards.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from router.config import CACHE_AWARE, RouterConfig, RoutingConfig
from router.policy import CacheAware
from router.preprocess import ModelAssets
from router.service import GenerationService
from router.workers import WorkerPool
from tests.cluster.harness import Node, free_port, start_node
from tests.cluster.stats import assert_all_idle
from tests.cluster.streams import Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
PAGE = 8
NODE = ["--page-size", str(PAGE), "--num-pages", "1024", "--max-num-seqs", "8"]
LONG = 48  # new tokens of the requests compared with the engine
BUSY = 1900  # new tokens of the streams that keep a decode busy (three fit its 1,024 pages)
T = TypeVar("T")


@pytest.fixture(scope="module")
def nodes(tiny_dir: Path) -> Iterator[dict[str, Node]]:
    """``p``, ``d0``, ``d1`` and two routers: ``approx`` (``--policy cache-aware``) and
    ``events`` (with ``--kv-events``); on fixed ports, so that a node can come back."""
    model = ["--model", str(tiny_dir)]
    ports = {name: free_port() for name in ("p", "d0", "d1", "approx", "events")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    workers = ["--prefill", addr["p"], "--decode", f"{addr['d0']},{addr['d1']}"]
    router = ["router", *model, *workers, "--policy", CACHE_AWARE]
    commands = {"p": ["prefill", *model, *NODE], "d0": ["decode", *model, *NODE],
                "d1": ["decode", *model, *NODE], "approx": router,
                "events": [*router, "--kv-events"]}
    started: dict[str, Node] = {}
    try:  # the workers first: a router that started with them could still count one unreachable
        for names in (("p", "d0", "d1"), ("approx", "events")):  # (its first GetLoad failed)
            started.update(zip(names, start_all([[*commands[n], "--port", str(ports[n])]
                                                 for n in names]), strict=True))
        yield started
    finally:
        stop_all(list(started.values()))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    """The in-process engine whose greedy outputs the cluster's must equal."""
    return LLMEngine(tiny_dir, EngineConfig(page_size=PAGE, num_pages=128))


def greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return [r.token_ids for r in engine.generate([Prompt(token_ids=p) for p in prompts], params)]


def request(rid: str, ids: list[int], new: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=rid, token_ids=gpb.TokenIds(ids=ids),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


def decode_of(router: Node, rid: str) -> str:
    """The decode address in the router's log line of request ``rid``."""
    def line() -> dict[str, Any] | None:
        lines = [json.loads(x) for x in list(router.log) if x.startswith("{")]
        return next((x for x in lines if x.get("request_id") == rid), None)

    wait_for(lambda: line() is not None, f"no log line of {rid}", 10.0)
    found = line()
    assert found is not None
    return str(found["decode"])


@pytest.mark.parametrize("router", ["approx", "events"])
def test_a_shared_prefix_sticks_to_its_decode(nodes: dict[str, Node], router: str,
                                              engine: LLMEngine) -> None:
    base = 100 if router == "approx" else 200  # prefixes no cache holds yet
    prefix = [base + i for i in range(40)]  # five blocks
    shared = [prefix + [7, i, 3] for i in range(4)]
    other = [base + 50 + i for i in range(43)]
    want = greedy(engine, [*shared, other], LONG)
    r = nodes[router]
    with grpc.insecure_channel(r.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        first = Stream(stub, request(f"{router}-a0", shared[0], LONG)).join()
        assert first.tokens == want[0]
        home = decode_of(r, f"{router}-a0")
        if router == "events":  # the decode's blocks reach the router through its stream
            time.sleep(0.5)
        # streams of 1,900 tokens, cancelled once the lone request has started: their decode is
        # the busier one when it is placed (a fast machine finished 300-token streams before)
        streams = [Stream(stub, request(f"{router}-a{i}", ids, BUSY))
                   for i, ids in enumerate(shared[1:], 1)]
        wait_for(lambda: all(len(s.tokens) >= LONG for s in streams),
                 "the shared streams stalled")
        lone = Stream(stub, request(f"{router}-b", other, LONG))
        wait_for(lambda: bool(lone.tokens) or not lone.running, "the lone request never started")
        # the lone request was placed while the shared streams ran (else the check is void)
        assert all(s.running for s in streams)
        for s in streams:
            s.cancel()
        lone.join()
        assert lone.tokens == want[-1]
        for s, exp in zip(streams, want[1:-1], strict=True):
            assert s.tokens[:LONG] == exp  # a greedy prefix of the engine's longer output
    assert [decode_of(r, f"{router}-a{i}") for i in range(1, 4)] == [home] * 3
    assert decode_of(r, f"{router}-b") != home  # no match: the idle decode
    assert_all_idle([nodes[n].address for n in ("p", "d0", "d1", router)])


class InProcessRouter:
    """A router with ``--policy cache-aware --kv-events`` on a thread of its own (its pool
    polls every 0.2 s), whose trees the test reads."""

    def __init__(self, tiny_dir: Path, prefill: str, decodes: tuple[str, ...]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = RouterConfig(tiny_dir, prefill=(prefill,), decode=decodes,
                              routing=RoutingConfig(CACHE_AWARE, kv_events=True))
        self.policy = CacheAware(config.routing)

        async def make() -> WorkerPool:  # channels belong to the loop they are made in
            pool = WorkerPool(config.prefill, config.decode, refresh_s=0.2)
            await pool.start()
            await self.policy.start(pool)
            return pool

        self.pool = self.run(make())
        self.service = GenerationService(config, ModelAssets.from_dir(tiny_dir), self.pool,
                                         self.policy)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call())

    def generate(self, ids: list[int], new: int) -> list[int]:
        async def collect() -> list[int]:
            return [t async for m in self.service.generate(request("", ids, new), 60)
                    for t in m.token_ids]

        return self.run(collect())

    def matched(self, kind: str, ids: list[int]) -> list[tuple[int, int]]:
        """``(blocks in its tree, tokens of ids it holds)`` per worker of ``kind``."""
        def read() -> list[tuple[int, int]]:
            assert self.policy.feeds is not None
            workers = self.pool.prefill if kind == "prefill" else self.pool.decode
            trees = [self.policy.feeds.tree(w) for w in workers]
            return [(len(t), t.match(ids)) if t is not None else (0, 0) for t in trees]

        return self.on_loop(read)

    def close(self) -> None:
        self.run(self.policy.close())
        self.run(self.pool.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def collect(stub: worker_pb2_grpc.PrefillWorkerStub, into: list[wpb.KvEvent]) -> None:
    """Read a ``SubscribeKvEvents`` stream into ``into`` until it ends (in a thread)."""
    def read() -> None:
        try:
            for batch in stub.SubscribeKvEvents(wpb.SubscribeKvEventsRequest()):
                into.extend(batch.events)
        except grpc.RpcError:
            pass  # the node went away

    threading.Thread(target=read, daemon=True).start()


def test_prefill_events_build_the_tree_and_a_restart_empties_it(
        nodes: dict[str, Node], tiny_dir: Path, engine: LLMEngine) -> None:
    prefix = [300 + i for i in range(24)]  # three blocks
    one, two = prefix + list(range(6)), prefix + list(range(10, 20))  # two has a 4th block
    want = greedy(engine, [one, two], 4)
    p = nodes["p"]
    router = InProcessRouter(tiny_dir, p.address, (nodes["d0"].address, nodes["d1"].address))
    try:
        events: list[wpb.KvEvent] = []
        with grpc.insecure_channel(p.address) as ch:
            collect(worker_pb2_grpc.PrefillWorkerStub(ch), events)
            assert router.generate(one, 4) == want[0]
            assert router.generate(two, 4) == want[1]
            # after the snapshot (what earlier tests left cached), four blocks
            wait_for(lambda: sum(e.seq > events[0].seq for e in events) >= 4, "no 4 blocks")
        assert events[0].HasField("cleared")
        stored = [e.stored for e in events if e.seq > events[0].seq]
        blocks = [one[0:8], one[8:16], one[16:24], two[24:32]]
        assert [list(s.token_ids) for s in stored] == blocks
        assert [s.parent_hash for s in stored] == [b""] + [s.block_hash for s in stored[:3]]
        wait_for(lambda: router.matched("prefill", two)[0][1] == 32, "the tree lags")
        assert max(m for _, m in router.matched("decode", two)) == 32

        before = router.on_loop(lambda: router.pool.prefill[0].cache_epoch)
        p.proc.kill()  # its cache is gone with it
        p.proc.wait()
        wait_for(lambda: router.matched("prefill", two) == [(0, 0)], "a dead worker's tree")
        nodes["p"] = start_node(["prefill", "--model", str(tiny_dir), *NODE,
                                 "--port", str(p.port)])
        wait_for(lambda: router.on_loop(lambda: router.pool.prefill[0].cache_epoch) > before,
                 "the router did not see the new instance", 10.0)
        assert router.matched("prefill", two) == [(0, 0)]
        assert router.generate(one, 4) == want[0]
        wait_for(lambda: router.matched("prefill", two) == [(3, 24)], "the new instance's tree")
    finally:
        router.close()
    assert_all_idle([nodes[n].address for n in ("p", "d0", "d1")])
