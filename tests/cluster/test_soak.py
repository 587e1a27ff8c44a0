"""Soak: bounded load in bursts on a real cluster (one prefill, two decodes, one router) with
random client cancels, injected transfer failures (``--fault-transfer-fail-p`` on the prefill),
idle gaps between bursts (Mooncake's TCP transport has been reported to fail the first transfer
after an idle pause), the prefill killed (``kill -9``) in the first burst and a decode killed in
the second, each restarted on its address by the test.

The router's default recovery (:mod:`router.recovery`) must hide every fault: every request that
was not cancelled completes, equal to the in-process engine; the router counts its retries
(recomputes and failovers too, when a kill's timing causes them); the restarted nodes serve
again (no sticky failure); and every node holds nothing at the end (the
leak check).

Small by default (CI): ``PDSERVE_SOAK_REQUESTS`` (200) in ``PDSERVE_SOAK_BURSTS`` (2) bursts
``PDSERVE_SOAK_IDLE_S`` (5) seconds apart, at ``PDSERVE_SOAK_CONCURRENCY`` (32) streams, with
``PDSERVE_SOAK_CANCEL_P`` (0.1) and ``PDSERVE_SOAK_FAIL_P`` (0.01 per engine write).
``PDSERVE_SOAK_MINUTES=30`` runs bursts of ``REQUESTS / BURSTS`` requests until that time has
passed and records every node's resident memory and open file descriptors after each burst: after
the warm-up (the bursts with kills, and one more) memory may grow less than 5% and descriptors
not at all. Run with ``-s`` to see the figures, e.g.
``PDSERVE_SOAK_REQUESTS=2000 python -m pytest tests/cluster/test_soak.py -s``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from router.workers import COOLDOWN_MAX_S
from tests.cluster.harness import Node, free_port
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all

MINUTES = float(os.environ.get("PDSERVE_SOAK_MINUTES", "0"))  # 0: just BURSTS bursts
# a long run outlives the suite's per-test timeout by its length
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600 + 60 * MINUTES)]
REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "200"))
BURSTS = int(os.environ.get("PDSERVE_SOAK_BURSTS", "2"))
IDLE_S = float(os.environ.get("PDSERVE_SOAK_IDLE_S", "5"))
CONCURRENCY = int(os.environ.get("PDSERVE_SOAK_CONCURRENCY", "32"))
CANCEL_P = float(os.environ.get("PDSERVE_SOAK_CANCEL_P", "0.1"))
FAIL_P = os.environ.get("PDSERVE_SOAK_FAIL_P", "0.01")
PAGE_SIZE = 8
NUM_VARIANTS = 64  # distinct (prompt, length) pairs, each checked against the engine
KILLS = ("prefill", "decode0")  # killed in burst 0 and burst 1, after KILL_AFTER of it is done
KILL_AFTER = 0.3
WARMUP_BURSTS = len(KILLS) + 1  # memory and descriptors are compared from the end of these
MAX_RSS_GROWTH = 0.05


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


@dataclass
class Cluster:
    """The soak's nodes by name, and the command that (re)starts each on its fixed port."""

    commands: dict[str, list[str]]
    nodes: dict[str, Node] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def kill_and_restart(self, name: str) -> None:
        """``kill -9`` the node, then start it again on the same ports (blocking)."""
        node = self.nodes[name]
        node.proc.kill()
        node.proc.wait()
        [self.nodes[name]] = start_all([self.commands[name]])


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    common = ["--model", str(tiny_dir), "--page-size", str(PAGE_SIZE), "--num-pages", "1024",
              "--quarantine-s", "1", "--heartbeat-interval-s", "1",
              "--max-waiting", str(4 * CONCURRENCY)]
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode0", "decode1")}
    decodes = f"127.0.0.1:{ports['decode0']},127.0.0.1:{ports['decode1']}"
    c = Cluster({
        "prefill": ["prefill", *common, "--port", str(ports["prefill"]), "--bootstrap-port",
                    str(ports["bootstrap"]), "--max-num-batched-tokens", "64",
                    "--fault-transfer-fail-p", FAIL_P, "--fault-seed", "1"],
        "decode0": ["decode", *common, "--port", str(ports["decode0"])],
        "decode1": ["decode", *common, "--port", str(ports["decode1"])],
        "router": ["router", "--model", str(tiny_dir), "--port", "0", "--prefill",
                   f"127.0.0.1:{ports['prefill']}", "--decode", decodes],
    })
    try:
        workers = ("prefill", "decode0", "decode1")
        c.nodes.update(zip(workers, start_all([c.commands[n] for n in workers]), strict=True))
        [c.nodes["router"]] = start_all([c.commands["router"]])
        yield c
    finally:
        stop_all(list(c.nodes.values()))


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


async def _burst(c: Cluster, vs: list[Variant], size: int, rng: random.Random,
                 kill: str | None) -> list[Outcome]:
    """``size`` requests at ``CONCURRENCY`` streams; ``kill``: the node killed (and restarted)
    once ``KILL_AFTER`` of them are done. Returns once the restarted node serves again."""
    plan = [(rng.randrange(len(vs)), rng.random() < CANCEL_P) for _ in range(size)]
    gate = asyncio.Semaphore(CONCURRENCY)
    done = 0
    due = asyncio.Event()
    async with grpc.aio.insecure_channel(c.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        async def run(index: int, cancel: bool) -> Outcome:
            nonlocal done
            async with gate:
                out = await _one(stub, vs[index], index, cancel, rng)
            done += 1
            if done >= KILL_AFTER * size:
                due.set()
            return out

        async def chaos() -> None:
            if kill is not None:
                await due.wait()
                await asyncio.to_thread(c.kill_and_restart, kill)

        outs, _ = await asyncio.gather(asyncio.gather(*(run(i, x) for i, x in plan)), chaos())
        return list(outs)


def _restarted_nodes_serve(c: Cluster, vs: list[Variant], expected: list[list[int]]) -> None:
    """No sticky failure: the restarted nodes take requests again once the router has seen them
    answer and their cool-down is over (at most ``COOLDOWN_MAX_S``; a second or two here), and
    answer them right. Batches of 16 (wider than one decode's share) until both did."""
    before = {name: get_stats(c.address(name)).requests_total for name in KILLS}

    async def batch() -> list[Outcome]:
        async with grpc.aio.insecure_channel(c.address("router")) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            rng = random.Random(2)
            return list(await asyncio.gather(*(_one(stub, vs[i], i, False, rng)
                                               for i in range(16))))

    deadline = time.monotonic() + COOLDOWN_MAX_S + 10
    while True:
        outs = asyncio.run(batch())
        assert [(o.code, o.tokens) for o in outs] == [(None, expected[i]) for i in range(16)]
        after = {name: get_stats(c.address(name)).requests_total for name in KILLS}
        if all(after[name] > before[name] for name in KILLS):
            return
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.5)


def _usage(pid: int) -> tuple[int, int]:
    """(resident memory in KiB, open file descriptors) of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines()
               if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def test_soak(cluster: Cluster, expected: list[list[int]]) -> None:
    c = cluster
    vs = variants()
    rng = random.Random(1)
    size = max(1, REQUESTS // BURSTS)
    outs: list[Outcome] = []
    samples: list[dict[str, tuple[int, int]]] = []  # per burst: node -> (RSS KiB, fds)
    t0 = time.monotonic()
    burst = 0
    while burst < BURSTS or time.monotonic() - t0 < MINUTES * 60:
        if burst:
            time.sleep(IDLE_S)  # idle: the next burst's first transfers follow a pause
        kill = KILLS[burst] if burst < len(KILLS) else None
        outs += asyncio.run(_burst(c, vs, size, rng, kill))
        samples.append({name: _usage(n.proc.pid) for name, n in c.nodes.items()})
        burst += 1
    wall = time.monotonic() - t0
    done = [o for o in outs if o.code is None]
    cancelled = [o for o in outs if o.code is grpc.StatusCode.CANCELLED and o.cancel]
    failed = [o for o in outs if o.code is not None and o not in cancelled]
    wrong = [o.variant for o in done if o.tokens != expected[o.variant]]
    router = get_stats(c.address("router"))
    injected = get_stats(c.address("prefill")).faults_injected  # since its restart
    latencies = sorted(o.seconds for o in done)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    print(f"\nsoak: {len(outs)} requests in {burst} bursts {IDLE_S:.0f}s apart at concurrency "
          f"{CONCURRENCY} in {wall:.1f}s, {' then '.join(KILLS[:burst])} killed: "
          f"{len(done)} complete, {len(cancelled)} cancelled, {len(failed)} failed, "
          f"{len(wrong)} wrong; router: {router.kv_retries} retries, {router.kv_recomputes} "
          f"recomputes, {router.decode_failovers} failovers; {injected} injected transfer "
          f"failures since the prefill's restart; e2e p50 {latencies[len(latencies) // 2]:.3f}s "
          f"p99 {p99:.3f}s; failed codes {Counter(o.code.name for o in failed if o.code)}")
    _print_usage(samples)
    assert not failed, [(o.code, o.details) for o in failed[:5]]
    assert not wrong, wrong[:10]
    assert len(done) + len(cancelled) == len(outs)
    # Which recoveries a kill causes depends on its timing, so only retries are required here:
    # the decode kill may catch every one of its streams before their first token (retries, not
    # failovers), and when the killed prefill is back within a request's retries nothing is
    # recomputed (a fresh-clone CI run saw 49 retries and 0 recomputes). Recompute and mid-stream
    # failover are asserted in tests/cluster/test_faults.py and test_failover.py.
    assert router.kv_retries > 0
    assert injected > 0
    _restarted_nodes_serve(c, vs, expected)
    assert_all_idle([n.address for n in c.nodes.values()], 20.0)  # the leak check
    print("soak: leak check passed: every node holds 0 pages, aux slots, rooms and requests")
    if len(samples) > WARMUP_BURSTS:
        _check_usage(samples[WARMUP_BURSTS - 1], samples[-1])


def _print_usage(samples: list[dict[str, tuple[int, int]]]) -> None:
    for name in samples[0]:
        series = " ".join(f"{s[name][0] / 1024:.0f}/{s[name][1]}" for s in samples)
        print(f"soak: {name} RSS MiB/fds after each burst: {series}")


def _check_usage(base: dict[str, tuple[int, int]], last: dict[str, tuple[int, int]]) -> None:
    """After the warm-up, resident memory grows under ``MAX_RSS_GROWTH`` and descriptors stay
    flat on every node."""
    for name, (rss0, fds0) in base.items():
        rss1, fds1 = last[name]
        assert rss1 <= rss0 * (1 + MAX_RSS_GROWTH), (name, rss0, rss1)
        assert fds1 <= fds0, (name, fds0, fds1)
