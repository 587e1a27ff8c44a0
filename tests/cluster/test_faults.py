"""Nodes killed mid-request (``kill -9``), as real processes on fixed ports (one of each): a
prompt whose prefill dies is computed on the decode instead (the router's default recovery) and
completes equal to the engine; a request whose only decode dies ends with a clear status within a
bounded time (no healthy decode is left); the survivors free everything the room held (the leak
check), and a node restarted on the same address is used again without restarting the others.

Handshake timeouts are configured small (``--heartbeat-interval-s``, ``--quarantine-s``), and the
prompt is long with a small prefill chunk, so the prefill is still pushing KV when it is killed.
Every scenario runs on the built-in tiny model and on a hybrid Qwen3.5 (``fault_model``): a
decode's room in transfer holds a state slot, which comes back with its pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc
from proto.pdserve.v1 import generate_pb2 as gpb
from tests.cluster.harness import Node, free_port
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.streams import Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
FAST_FAIL = ["--heartbeat-interval-s", "0.5", "--quarantine-s", "1", "--bootstrap-timeout-s",
             "10", "--waiting-timeout-s", "20"]
LONG = [(j * 13) % 380 for j in range(1900)]  # ~120 prefill chunks of 16 tokens
FAIL_WITHIN_S = 15.0


@dataclass
class Cluster:
    commands: dict[str, list[str]]  # "prefill", "decode", "router"
    nodes: dict[str, Node]

    def address(self, name: str) -> str:
        return self.nodes[name].address

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes.values()]

    def admin(self, name: str) -> admin_pb2_grpc.AdminStub:
        """An Admin stub on a channel that stays open (reconnecting after a restart)."""
        return admin_pb2_grpc.AdminStub(grpc.insecure_channel(self.address(name)))

    def kill(self, name: str) -> None:
        node = self.nodes[name]
        node.proc.kill()  # SIGKILL: no cleanup of any kind
        node.proc.wait()

    def restart(self, name: str) -> None:
        [self.nodes[name]] = start_all([self.commands[name]])


@contextmanager
def one_of_each(model_dir: Path, worker_flags: Sequence[str] = ()) -> Iterator[Cluster]:
    """A prefill, a decode (both with ``worker_flags``) and a router, on fixed ports."""
    model = ["--model", str(model_dir), "--page-size", "8", "--num-pages", "512", *FAST_FAIL,
             "--state-checkpoint-interval", "64", *worker_flags]
    pport, bport, dport = free_port(), free_port(), free_port()
    commands = {
        "prefill": ["prefill", *model, "--port", str(pport), "--bootstrap-port", str(bport),
                    "--max-num-batched-tokens", "16"],
        "decode": ["decode", *model, "--port", str(dport)],
        "router": ["router", "--model", str(model_dir), "--port", "0", "--prefill",
                   f"127.0.0.1:{pport}", "--decode", f"127.0.0.1:{dport}"],
    }
    c = Cluster(commands, {})
    try:
        p, d = start_all([commands["prefill"], commands["decode"]])
        c.nodes.update(prefill=p, decode=d)
        [c.nodes["router"]] = start_all([commands["router"]])
        yield c
    finally:
        stop_all(list(c.nodes.values()))


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[Cluster]:
    with one_of_each(fault_model) as c:
        yield c


def _req(ids: Sequence[int], new: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=list(ids)),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


def _started_on(stream: Stream, prefill: admin_pb2_grpc.AdminStub) -> bool:
    """True once the prefill holds pages for the room; fails at once if the stream ended first
    (with why: a refused request must not read as a slow prefill)."""
    assert stream.ended_at == 0.0, f"the stream ended before the prefill started: {stream.error}"
    return prefill.GetStats(admin_pb2.GetStatsRequest(), timeout=5).kv_pages_used > 0


def _serves_again(stub: generate_pb2_grpc.GenerationStub, timeout_s: float = 60.0) -> None:
    """Retry a small request until the cluster answers it (channels reconnect with backoff)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            msgs = list(stub.Generate(_req([5, 6, 7, 8, 9], 6), timeout=30))
            assert sum(len(m.token_ids) for m in msgs) == 6
            return
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, f"the cluster does not serve again: {exc}"
            time.sleep(0.5)


def test_prefill_killed_mid_transfer_is_recomputed(cluster: Cluster, fault_model: Path) -> None:
    engine = LLMEngine(fault_model, EngineConfig(num_pages=512, page_size=8))
    [want] = engine.generate([Prompt(token_ids=LONG)],
                             SamplingParams(max_new_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(cluster.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        admin = cluster.admin("prefill")  # one channel: polls must be quicker than the prefill
        admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5)  # connected before the stream
        stream = Stream(stub, _req(LONG, 8))
        wait_for(lambda: _started_on(stream, admin), "the prefill never started the room")
        cluster.kill("prefill")
        stream.join(60.0)
        assert stream.error is None and stream.tokens == want.token_ids, stream.error
        stats = get_stats(cluster.address("router"))
        assert stats.kv_recomputes >= 1 and stats.transfers_failed == 0, stats
        # the decode frees the failed room's pages (after the quarantine: its prefill said
        # nothing)
        assert_all_idle([cluster.address("decode"), cluster.address("router")], 15.0)
        cluster.restart("prefill")  # same ports; the decode and the router keep running
        _serves_again(stub)
        # no sticky failure: the restarted prefill computes prompts again
        before = get_stats(cluster.address("prefill")).requests_total
        _serves_again(stub)
        assert get_stats(cluster.address("prefill")).requests_total > before
    assert_all_idle(cluster.addresses)


def test_decode_killed_mid_stream(cluster: Cluster) -> None:
    only_decode_dies_mid_stream(cluster, lambda: cluster.kill("decode"))


def only_decode_dies_mid_stream(cluster: Cluster, kill: Callable[[], None]) -> None:
    """A long stream whose only decode dies (``kill``) ends ``UNAVAILABLE`` within
    :data:`FAIL_WITHIN_S`; the prefill and the router end idle; a restarted decode serves."""
    with grpc.insecure_channel(cluster.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        stream = Stream(stub, _req([3, 1, 4, 1, 5], 2000))
        wait_for(lambda: bool(stream.tokens), "no token arrived")
        kill()
        stream.join(FAIL_WITHIN_S)
        assert stream.error is not None
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert_all_idle([cluster.address("prefill"), cluster.address("router")], 15.0)
        cluster.restart("decode")
        _serves_again(stub)
    assert_all_idle(cluster.addresses)


def test_decode_killed_mid_transfer_frees_the_prefill_room(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        admin = cluster.admin("prefill")  # one channel: polls must be quicker than the prefill
        admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5)  # connected before the stream
        stream = Stream(stub, _req(LONG, 8))
        wait_for(lambda: _started_on(stream, admin), "the prefill never started the room")
        cluster.kill("decode")
        stream.join(FAIL_WITHIN_S)
        assert stream.error is not None and stream.tokens == []
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
        assert_all_idle([cluster.address("prefill"), cluster.address("router")], 15.0)
        cluster.restart("decode")
        _serves_again(stub)
    assert_all_idle(cluster.addresses)


def test_restarted_nodes_come_back_with_empty_caches(cluster: Cluster, fault_model: Path) -> None:
    """A prompt's pages are cached on both nodes; a restarted decode no longer holds them (the
    prefill sends every page again) and a restarted prefill computes the whole prompt again.
    Then prompts larger than what the pools keep evict cached pages on both nodes. Every
    output equals an engine without a prefix cache, and nothing is held after. A hybrid
    model's prefill hit of 192 tokens resumes at its state checkpoint there (every 64)."""
    engine = LLMEngine(fault_model, EngineConfig(num_pages=2048, page_size=8,
                                              enable_prefix_cache=False))
    shared = LONG[:200]  # 24 full pages a later request can reuse (the last token never)
    bigs = [[(j * 7 + k) % 380 for j in range(1100)] for k in range(4)]  # 138 pages each
    want = [r.token_ids for r in engine.generate(
        [Prompt(token_ids=ids) for ids in [shared, *bigs]],
        SamplingParams(max_new_tokens=6, ignore_eos=True))]

    def spared(name: str) -> int:
        return get_stats(cluster.address(name)).kv_pages_not_sent

    with grpc.insecure_channel(cluster.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        def cached(ids: list[int], expect: list[int]) -> int:
            msgs = list(stub.Generate(_req(ids, 6), timeout=60))
            assert [t for m in msgs for t in m.token_ids] == expect
            return msgs[-1].usage.cached_tokens

        cached(shared, want[0])
        before = spared("decode")
        assert cached(shared, want[0]) == 192 and spared("decode") == before + 24
        cluster.kill("decode")
        cluster.restart("decode")
        _serves_again(stub)
        prefill_before = spared("prefill")
        assert cached(shared, want[0]) == 192  # the prefill's cache survived
        assert spared("decode") == 0 and spared("prefill") == prefill_before  # all sent
        cluster.kill("prefill")
        cluster.restart("prefill")
        _serves_again(stub)
        assert cached(shared, want[0]) == 0  # computed again, but the decode had the pages
        assert spared("decode") == 24 and spared("prefill") == 24
        for ids, expect in zip(bigs, want[1:], strict=True):
            cached(ids, expect)
    for name in ("prefill", "decode"):
        assert get_stats(cluster.address(name)).prefix_cache_evicted_blocks > 0, name
    assert_all_idle(cluster.addresses)
