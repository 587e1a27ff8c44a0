"""``pdserve.v1.Admin/GetStats`` on every node kind, as real processes: a plain prefill, a
two-stage pipeline prefill, a decode node and a router that uses both prefills. Figures rise
while a request runs and are all zero (the leak check) once every stream ended, however it ended.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from serving.admin import to_stats
from tests.cluster.harness import Node, start_node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all

NODE = ["--port", "0", "--page-size", "8", "--max-num-batched-tokens", "48"]


def test_to_stats_renames_load_figures_and_drops_the_rest() -> None:
    stats = to_stats("decode", {"waiting_requests": 2, "running_requests": 3, "kv_pages_used": 4,
                                "bootstrap_addr": 9, "requests_total": 7})
    assert (stats.role, stats.requests_waiting, stats.requests_running, stats.kv_pages_used,
            stats.requests_total) == ("decode", 2, 3, 4, 7)


@dataclass
class Cluster:
    prefill: Node
    stages: list[Node]  # pipeline stages in rank order
    decode: Node
    router: Node

    @property
    def nodes(self) -> list[Node]:
        return [self.prefill, *self.stages, self.decode, self.router]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    model = ["--model", str(tiny_dir), *NODE]
    last = start_node(["prefill", *model, "--num-pages", "96", "--pp-size", "2",
                       "--pp-rank", "1"])
    nodes = [last]
    try:
        first, prefill, decode = start_all([
            ["prefill", *model, "--num-pages", "96", "--pp-size", "2", "--pp-rank", "0",
             "--pp-next", last.address],
            ["prefill", *model, "--num-pages", "96"],
            ["decode", *model, "--num-pages", "256"],
        ])
        nodes += [first, prefill, decode]
        [router] = start_all([["router", "--model", str(tiny_dir), "--port", "0", "--prefill",
                               f"{prefill.address},{first.address}", "--decode",
                               decode.address]])
        nodes.append(router)
        yield Cluster(prefill, [first, last], decode, router)
    finally:
        stop_all(nodes)


def _request(i: int, new: int) -> gpb.GenerateRequest:
    ids = [(i * 31 + j * 7) % 300 for j in range(5 + (i * 13) % 90)]
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


@pytest.mark.slow
def test_every_node_reports_its_role_and_capacity(cluster: Cluster) -> None:
    roles = [get_stats(a).role for a in cluster.addresses]
    assert roles == ["prefill", "prefill", "prefill-stage", "decode", "router"]
    decode = get_stats(cluster.decode.address)
    assert decode.kv_pages_total == 256 and decode.aux_slots_total > 0
    assert get_stats(cluster.router.address).kv_pages_total == 0
    assert_all_idle(cluster.addresses)


@pytest.mark.slow
def test_figures_rise_while_a_request_runs_and_return_to_zero(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        stream = stub.Generate(_request(1, 1500), timeout=120)
        first = next(stream)
        assert not first.finished
        router = get_stats(cluster.router.address)
        assert (router.requests_running, router.rooms_active) == (1, 1)
        decode = get_stats(cluster.decode.address)
        assert decode.kv_pages_used > 0 and decode.requests_running == 1
        stream.cancel()  # type: ignore[attr-defined]
    assert_all_idle(cluster.addresses)


@pytest.mark.slow
def test_concurrent_requests_through_both_prefills_leave_nothing(cluster: Cluster) -> None:
    before = get_stats(cluster.router.address).requests_total
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        def one(i: int) -> int:
            return sum(len(m.token_ids) for m in stub.Generate(_request(i, 8 + i), timeout=120))

        with ThreadPoolExecutor(12) as pool:
            counts = list(pool.map(one, range(12)))
    assert counts == [8 + i for i in range(12)]
    assert get_stats(cluster.router.address).requests_total == before + 12
    totals = [get_stats(n.address).requests_total for n in (cluster.prefill, cluster.stages[0])]
    assert sum(totals) >= 12 and all(t > 0 for t in totals), totals
    time.sleep(0.1)
    assert_all_idle(cluster.addresses)
