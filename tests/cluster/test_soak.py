"""Soak: a bounded load on a real 1P1D cluster with random client cancels and injected transfer
failures (``--fault-transfer-fail-p`` on the prefill).

Ends with: every request that was neither cancelled nor hit by an injected failure complete and
equal to the in-process engine; every failed request explained by an injected failure (its
status names the injected engine error code, and there are no more of them than the prefill
counted); zero resources held on every node.

Small by default (CI). Larger by environment: ``PDSERVE_SOAK_REQUESTS`` (default 400),
``PDSERVE_SOAK_CONCURRENCY`` (32), ``PDSERVE_SOAK_CANCEL_P`` (0.1), ``PDSERVE_SOAK_FAIL_P``
(0.01 per engine write). Run with ``-s`` to see the figures, e.g.
``PDSERVE_SOAK_REQUESTS=2000 python -m pytest tests/cluster/test_soak.py -s``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.request import SamplingParams
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all
from transfer.faults import INJECTED_ERROR_CODE

pytestmark = pytest.mark.slow
REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "400"))
CONCURRENCY = int(os.environ.get("PDSERVE_SOAK_CONCURRENCY", "32"))
CANCEL_P = float(os.environ.get("PDSERVE_SOAK_CANCEL_P", "0.1"))
FAIL_P = os.environ.get("PDSERVE_SOAK_FAIL_P", "0.01")
PAGE_SIZE = 8
NUM_VARIANTS = 64  # distinct (prompt, length) pairs, each checked against the engine
INJECTED = f"failed with code {INJECTED_ERROR_CODE}"


@dataclass(frozen=True)
class Variant:
    ids: list[int]
    new: int


@dataclass
class Outcome:
    variant: int
    cancel: bool  # the client meant to cancel it (it may have finished first)
    tokens: list[int]
    code: grpc.StatusCode | None = None
    details: str = ""
    seconds: float = 0.0


def variants() -> list[Variant]:
    rng = random.Random(0)
    return [Variant([rng.randrange(500) for _ in range(rng.randint(4, 200))], rng.randint(4, 32))
            for _ in range(NUM_VARIANTS)]


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> list[list[int]]:
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=4096, page_size=PAGE_SIZE))
    vs = variants()
    params = [SamplingParams(max_new_tokens=v.new, ignore_eos=True) for v in vs]
    return [r.token_ids for r in engine.generate([Prompt(token_ids=v.ids) for v in vs], params)]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[list[Node]]:
    common = ["--model", str(tiny_dir), "--page-size", str(PAGE_SIZE), "--num-pages", "1024",
              "--port", "0", "--quarantine-s", "1", "--heartbeat-interval-s", "1",
              "--max-waiting", str(4 * CONCURRENCY)]
    nodes: list[Node] = []
    try:
        nodes += start_all([["prefill", *common, "--max-num-batched-tokens", "64",
                             "--fault-transfer-fail-p", FAIL_P, "--fault-seed", "1"],
                            ["decode", *common]])
        nodes += start_all([["router", "--model", str(tiny_dir), "--port", "0",
                             "--prefill", nodes[0].address, "--decode", nodes[1].address]])
        yield nodes
    finally:
        stop_all(nodes)


async def _one(stub: generate_pb2_grpc.GenerationStub, v: Variant, index: int, cancel: bool,
               rng: random.Random) -> Outcome:
    out = Outcome(index, cancel, [])
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=v.ids), sampling=gpb.SamplingParams(
        max_new_tokens=v.new, ignore_eos=True))
    t0 = time.monotonic()
    call = stub.Generate(req, timeout=120)
    if cancel:
        asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.3), call.cancel)
    try:
        async for msg in call:
            out.tokens.extend(msg.token_ids)
    except asyncio.CancelledError:
        out.code = grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code(), exc.details() or ""
    out.seconds = time.monotonic() - t0
    return out


async def _load(address: str, vs: list[Variant]) -> list[Outcome]:
    rng = random.Random(1)
    plan = [(rng.randrange(len(vs)), rng.random() < CANCEL_P) for _ in range(REQUESTS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def run(index: int, cancel: bool) -> Outcome:
            async with gate:
                return await _one(stub, vs[index], index, cancel, rng)

        return list(await asyncio.gather(*(run(i, c) for i, c in plan)))


def test_soak(cluster: list[Node], expected: list[list[int]]) -> None:
    prefill, decode, router = cluster
    t0 = time.monotonic()
    outs = asyncio.run(_load(router.address, variants()))
    wall = time.monotonic() - t0
    done = [o for o in outs if o.code is None]
    cancelled = [o for o in outs if o.code is grpc.StatusCode.CANCELLED and o.cancel]
    failed = [o for o in outs if o.code is not None and o not in cancelled]
    injected_failed = [o for o in failed
                       if o.code is grpc.StatusCode.UNAVAILABLE and INJECTED in o.details]
    lost = [o for o in failed if o not in injected_failed]
    wrong = [o.variant for o in done if o.tokens != expected[o.variant]]
    injected = get_stats(prefill.address).faults_injected
    latencies = sorted(o.seconds for o in done)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    print(f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} in {wall:.1f}s: "
          f"{len(done)} complete, {len(cancelled)} cancelled, {len(injected_failed)} failed by "
          f"{injected} injected transfer failures, {len(lost)} lost, {len(wrong)} wrong; "
          f"e2e p50 {latencies[len(latencies) // 2]:.3f}s p99 {p99:.3f}s; "
          f"lost codes {Counter(o.code.name for o in lost if o.code)}")
    assert not lost, [(o.code, o.details) for o in lost[:5]]
    assert not wrong, wrong[:10]
    assert 0 < len(injected_failed) <= injected
    assert len(done) + len(cancelled) + len(injected_failed) == REQUESTS
    assert_all_idle([n.address for n in cluster], 20.0)  # the leak check
    print("soak: leak check passed: every node holds 0 pages, aux slots, rooms and requests")
