"""Injected faults on a real cluster (``--fault-*`` flags on real processes, real Mooncake TCP):
a network error from the engine, a destination that never arrives, a status that never comes, a
slow peer, and a router killed (``kill -9``) with streams open.

With ``--kv-failure-policy fail`` every failure reaches the client as ``UNAVAILABLE`` with a
message naming the cause within a bounded time, every node ends holding nothing (the leak check),
every request the faults spared equals the in-process engine, and the nodes keep serving. With the
default policy (retry, then recompute) the same faults cost no request: every one completes equal
to the engine, and the router counts its retries.

The flaky nodes fail each fault draw with a fixed probability and seed, so a few sequential
requests see both failures and successes on the same nodes. Every scenario runs on the built-in
tiny model and on a hybrid Qwen3.5 (``fault_model``), whose state slots the leak check covers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.streams import Stream
from tests.cluster.test_cluster import start_all, stop_all
from transfer.faults import INJECTED_ERROR_CODE

pytestmark = pytest.mark.slow
TIMEOUTS = ["--bootstrap-timeout-s", "3", "--waiting-timeout-s", "4",
            "--heartbeat-interval-s", "0.5", "--quarantine-s", "1"]
FAIL_WITHIN_S = 10.0  # the largest timeout above plus slack
NEW = 8
PROMPTS = [[(i * 37 + j * 11) % 380 for j in range(5 + 7 * i)] for i in range(16)]
WORKERS = {  # name -> fault flags
    "p_err": ["--fault-transfer-fail-p", "0.3", "--fault-seed", "1"],  # engine network errors
    "p_slow": ["--fault-slow-peer-s", "0.05", "--fault-status-delay-s", "0.3"],
    "p_mute": ["--fault-drop-handshake-p", "0.5", "--fault-seed", "2"],  # lost statuses
    "d": [],
    "d_deaf": ["--fault-drop-handshake-p", "0.5", "--fault-seed", "3"],  # lost destinations
}
ROUTERS = {"r_err": ("p_err", "d"), "r_slow": ("p_slow", "d"), "r_mute": ("p_mute", "d"),
           "r_deaf": ("p_slow", "d_deaf"), "r_retry": ("p_err", "d")}
RECOVERING = {"r_retry"}  # routers with the default --kv-failure-policy; the others: fail


@dataclass
class Cluster:
    nodes: dict[str, Node]
    model: Path

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def router_command(self, prefill: str, decode: str, policy: str = "fail") -> list[str]:
        return ["router", "--model", str(self.model), "--port", "0",
                "--prefill", self.address(prefill), "--decode", self.address(decode),
                "--kv-failure-policy", policy]


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[Cluster]:
    model = ["--model", str(fault_model), "--page-size", "8", "--num-pages", "1024", "--port", "0",
             *TIMEOUTS]
    c = Cluster({}, fault_model)
    try:
        kinds = ["prefill" if name.startswith("p") else "decode" for name in WORKERS]
        nodes = start_all([[kind, *model, *flags]
                           for kind, flags in zip(kinds, WORKERS.values(), strict=True)])
        c.nodes.update(zip(WORKERS, nodes, strict=True))
        routers = start_all([c.router_command(p, d, "retry" if name in RECOVERING else "fail")
                             for name, (p, d) in ROUTERS.items()])
        c.nodes.update(zip(ROUTERS, routers, strict=True))
        yield c
    finally:
        stop_all(list(c.nodes.values()))


@pytest.fixture(scope="module")
def expected(fault_model: Path) -> list[list[int]]:
    """The in-process engine's greedy output for every prompt."""
    engine = LLMEngine(fault_model, EngineConfig(num_pages=512, page_size=8))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return [r.token_ids for r in engine.generate([Prompt(token_ids=p) for p in PROMPTS], params)]


def _req(ids: Sequence[int], new: int = NEW) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=list(ids)),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


@dataclass
class Outcome:
    prompt: int
    tokens: list[int]
    error: grpc.RpcError | None
    seconds: float


def _one(stub: generate_pb2_grpc.GenerationStub, i: int) -> Outcome:
    t0 = time.monotonic()
    try:
        msgs = list(stub.Generate(_req(PROMPTS[i]), timeout=60))
        return Outcome(i, [t for m in msgs for t in m.token_ids], None, time.monotonic() - t0)
    except grpc.RpcError as exc:
        return Outcome(i, [], exc, time.monotonic() - t0)


def _flaky(cluster: Cluster, router: str, nodes: Sequence[str], expected: list[list[int]],
           cause: str) -> None:
    """Sequential requests through ``router`` until both a failure and a success were seen:
    every failure is UNAVAILABLE naming ``cause`` within the bound, every success is correct,
    and the nodes hold nothing afterwards."""
    seen_ok = seen_failed = False
    with grpc.insecure_channel(cluster.address(router)) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        for i in range(len(PROMPTS)):
            out = _one(stub, i)
            if out.error is None:
                assert out.tokens == expected[i], f"prompt {i}"
                seen_ok = True
            else:
                assert out.error.code() == grpc.StatusCode.UNAVAILABLE, out.error
                assert cause in (out.error.details() or ""), out.error
                assert out.seconds < FAIL_WITHIN_S, out
                seen_failed = True
            assert_all_idle([cluster.address(n) for n in (router, *nodes)], FAIL_WITHIN_S)
            if seen_ok and seen_failed and i >= 3:
                break
    assert seen_ok and seen_failed, "the faults never (or always) hit in 16 requests"
    faulty = [get_stats(cluster.address(n)).faults_injected for n in nodes]
    assert any(faulty), faulty


def test_network_error_from_the_engine(cluster: Cluster, expected: list[list[int]]) -> None:
    _flaky(cluster, "r_err", ["p_err", "d"], expected, f"failed with code {INJECTED_ERROR_CODE}")


def test_destination_that_never_arrives(cluster: Cluster, expected: list[list[int]]) -> None:
    _flaky(cluster, "r_deaf", ["p_slow", "d_deaf"], expected, "no destination arrived")


def test_status_that_never_comes(cluster: Cluster, expected: list[list[int]]) -> None:
    _flaky(cluster, "r_mute", ["p_mute", "d"], expected, "the prefill never finished")


def test_injected_transfer_failures_are_retried(cluster: Cluster,
                                                expected: list[list[int]]) -> None:
    """The default policy over the flaky prefill: every request completes equal to the engine,
    some only after a retry (the prefill's failures are counted, and so are the retries)."""
    router = cluster.address("r_retry")
    faults_before = get_stats(cluster.address("p_err")).faults_injected
    with grpc.insecure_channel(router) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        outs = [_one(stub, i) for i in range(len(PROMPTS))]
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.tokens for o in outs] == expected
    stats = get_stats(router)
    assert get_stats(cluster.address("p_err")).faults_injected > faults_before
    assert stats.kv_retries > 0 and stats.transfers_failed == 0, stats
    assert_all_idle([cluster.address(n) for n in ("r_retry", "p_err", "d")], FAIL_WITHIN_S)


def test_slow_peer_and_late_status_still_complete(cluster: Cluster,
                                                   expected: list[list[int]]) -> None:
    with grpc.insecure_channel(cluster.address("r_slow")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        outs = [_one(stub, i) for i in range(4)]
    assert [o.tokens for o in outs] == expected[:4], [o.error for o in outs]
    assert all(o.seconds >= 0.3 for o in outs)  # each waited for its delayed status
    assert get_stats(cluster.address("p_slow")).faults_injected >= 4
    assert_all_idle([cluster.address(n) for n in ("r_slow", "p_slow", "d")])


def test_router_killed_mid_stream(cluster: Cluster, expected: list[list[int]]) -> None:
    """``kill -9`` of a router with streams decoding and one room still in transfer: the
    clients get UNAVAILABLE, the prefill and the decode free every room and page, and serve on
    through another router."""
    [router] = start_all([cluster.router_command("p_slow", "d")])
    workers = [cluster.address("p_slow"), cluster.address("d")]
    try:
        with grpc.insecure_channel(router.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            streams = [Stream(stub, _req(PROMPTS[i], 1000)) for i in range(3)]
            deadline = time.monotonic() + 30
            while not all(s.tokens for s in streams):
                assert time.monotonic() < deadline, [s.error for s in streams]
                time.sleep(0.01)
            streams.append(Stream(stub, _req([(j * 7) % 380 for j in range(1200)], 50)))
            while get_stats(workers[0]).kv_pages_used == 0:  # the long prompt is in transfer
                assert time.monotonic() < deadline and streams[-1].error is None
                time.sleep(0.005)
            assert all(s.error is None and len(s.tokens) < 1000 for s in streams)
            router.proc.kill()
            router.proc.wait()
            for s in streams:
                s.join(FAIL_WITHIN_S)
                assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE
        assert_all_idle(workers, FAIL_WITHIN_S)
    finally:
        stop_all([router])
    with grpc.insecure_channel(cluster.address("r_slow")) as ch:
        assert _one(generate_pb2_grpc.GenerationStub(ch), 5).tokens == expected[5]
    assert_all_idle([*workers, cluster.address("r_slow")])
