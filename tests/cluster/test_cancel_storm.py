"""Cancel storms: clients cancel at every stage of a request's life while others keep running.

One 1P1D cluster of real processes (plus a colocated router on the same decode). The prefill
runs one request at a time in 16-token chunks (``--max-num-seqs 1``), so long prompts are slow
and queue behind each other; the decode runs two requests at a time (``--max-num-seqs 2``), so
two long generations keep later rooms waiting in its scheduler. Each cancel happens at a stage
confirmed through ``Admin.GetStats`` (not by timing): before routing, queued on the prefill,
during prefill, mid-transfer (more than half of the prompt's KV pushed, the decode holding the
destination), queued on the decode and mid-decode. Cancelled calls end ``CANCELLED``; requests
that were not cancelled end with the same tokens as a reference run; every node ends empty.
Both storms run on the built-in tiny model and on a hybrid Qwen3.5 (``fault_model``), whose
state slots (lent to transfers on the decode) are part of the leak check.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc
from proto.pdserve.v1 import generate_pb2 as gpb
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle
from tests.cluster.streams import TIMEOUT_S, Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
LONG = 1600  # prompt tokens of a slow prefill: 100 chunks of 16


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + j * 7) % 380 for j in range(n)]


def request(prompt: list[int], new: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    routers: dict[str, Node]  # "1p1d", "colocated"

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in (self.prefill, self.decode, *self.routers.values())]


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[Cluster]:
    model = ["--model", str(fault_model), "--port", "0", "--page-size", "8", "--num-pages", "2048"]
    workers = start_all([
        ["prefill", *model, "--max-num-batched-tokens", "16", "--max-num-seqs", "1"],
        # slots for the two running and the rooms queued behind them (a hybrid model)
        ["decode", *model, "--max-num-seqs", "2", "--state-slots", "16"],
    ])
    routers: list[Node] = []
    try:
        p, d = workers
        base = ["router", "--model", str(fault_model), "--port", "0"]
        routers = start_all([[*base, "--prefill", p.address, "--decode", d.address],
                             [*base, "--colocated", d.address]])
        yield Cluster(p, d, dict(zip(("1p1d", "colocated"), routers, strict=True)))
    finally:
        stop_all(routers)
        stop_all(workers)


class Stats:
    """``GetStats`` of one node on a channel that stays open (polls must be quick)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    def __call__(self) -> admin_pb2.Stats:
        return self._stub.GetStats(admin_pb2.GetStatsRequest(), timeout=5)

    def close(self) -> None:
        self._channel.close()


def reference(stub: generate_pb2_grpc.GenerationStub,
              reqs: list[gpb.GenerateRequest]) -> list[list[int]]:
    """Tokens of every request, run to the end concurrently and never cancelled."""
    def one(req: gpb.GenerateRequest) -> list[int]:
        return [t for m in stub.Generate(req, timeout=TIMEOUT_S) for t in m.token_ids]

    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(one, reqs))


def test_cancel_at_every_stage_while_others_complete(cluster: Cluster) -> None:
    p_stats, d_stats = Stats(cluster.prefill.address), Stats(cluster.decode.address)
    channel = grpc.insecure_channel(cluster.routers["1p1d"].address)
    stub = generate_pb2_grpc.GenerationStub(channel)
    try:
        group_a = [request(ids(i, 20 + 25 * i), 6 + 3 * i) for i in range(4)]
        group_b = [request(ids(10 + i, 40 + 30 * i), 5 + 4 * i) for i in range(4)]
        expected = reference(stub, group_a + group_b)
        assert_all_idle(cluster.addresses)

        def sched_waiting_on_d() -> int:  # adopted rooms waiting for a running slot
            s = d_stats()
            return s.requests_waiting - s.rooms_active

        # mid-decode victims: two long generations fill the decode's two running slots
        hogs = [Stream(stub, request(ids(90 + i, 5), 2000)) for i in range(2)]
        wait_for(lambda: all(len(h.tokens) >= 3 for h in hogs), "the decode hogs never streamed")
        # survivors of group A: prefilled, then queued on the decode behind the hogs
        survivors = [Stream(stub, r) for r in group_a]
        wait_for(lambda: sched_waiting_on_d() == len(group_a), "group A never queued on D")

        # queued on D: delivered, waiting for a running slot
        queued_d = Stream(stub, request(ids(70, 30), 8))
        wait_for(lambda: sched_waiting_on_d() == len(group_a) + 1, "never queued on D")
        assert len(queued_d.cancel().tokens) <= 1  # the prefill's first token streams at once
        wait_for(lambda: sched_waiting_on_d() == len(group_a), "the cancel did not reach D")

        # before routing: cancelled before the router can have picked workers
        early = Stream(stub, request(ids(71, 300), 8))
        early.call.cancel()
        early.join()
        assert early.error is not None and early.error.code() == grpc.StatusCode.CANCELLED

        # during prefill (first chunks), queued on P (behind it), mid-transfer (later chunks)
        in_prefill = Stream(stub, request(ids(72, LONG), 8))
        wait_for(lambda: p_stats().kv_pages_used > 0, "the long prefill never started")
        mid_transfer = Stream(stub, request(ids(73, LONG), 8))
        queued_p = Stream(stub, request(ids(74, LONG), 8))
        wait_for(lambda: p_stats().requests_waiting >= 2, "the long prompts never queued on P")
        s = p_stats()
        assert s.requests_running == 1 and s.waiting_tokens > 2 * LONG, s
        assert queued_p.cancel().tokens == []
        assert in_prefill.cancel().tokens == []
        wait_for(lambda: p_stats().waiting_tokens < LONG // 2, "the second prefill never ran")
        assert d_stats().rooms_active >= 1  # the decode holds the room's destination pages
        assert mid_transfer.cancel().tokens == []

        # survivors of group B go through P and D while the hogs are cancelled mid-decode
        survivors += [Stream(stub, r) for r in group_b]
        for hog in hogs:
            assert 3 <= len(hog.cancel().tokens) < 2000 and not hog.finished
        for i, (stream, exp) in enumerate(zip(survivors, expected, strict=True)):
            stream.join()
            assert stream.error is None, (i, stream.error)
            assert stream.finished and stream.tokens == exp, i
    finally:
        channel.close()
        p_stats.close()
        d_stats.close()
    assert_all_idle(cluster.addresses, 15.0)


@pytest.mark.parametrize("topology", ["1p1d", "colocated"])
def test_random_cancel_storm(cluster: Cluster, topology: str) -> None:
    """Two waves of 24 concurrent requests (short and long prompts, short and long outputs),
    each cancelled after a random delay or not at all; the uncancelled ones and those that
    finished before their cancel equal the reference."""
    rng = random.Random(7 if topology == "1p1d" else 8)
    reqs = [request(ids(200 + i, rng.choice([8, 60, 300, 900])), rng.choice([4, 16, 200]))
            for i in range(24)]
    with grpc.insecure_channel(cluster.routers[topology].address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        expected = reference(stub, reqs)
        for wave in range(2):
            delays = [rng.choice([None, 0.0, 0.02, 0.1, 0.3, 0.8, 1.5]) for _ in reqs]
            streams = [Stream(stub, r) for r in reqs]
            start = time.monotonic()
            for stream, delay in sorted(zip(streams, delays, strict=True),
                                        key=lambda sd: -1.0 if sd[1] is None else sd[1]):
                if delay is None:
                    continue
                time.sleep(max(0.0, start + delay - time.monotonic()))
                stream.call.cancel()
            for i, (stream, exp, delay) in enumerate(zip(streams, expected, delays,
                                                         strict=True)):
                stream.join()
                if stream.error is not None:
                    assert delay is not None, (wave, i, stream.error)
                    assert stream.error.code() == grpc.StatusCode.CANCELLED, (wave, i)
                    assert stream.tokens == exp[:len(stream.tokens)], (wave, i)
                else:
                    assert stream.finished and stream.tokens == exp, (wave, i)
            assert_all_idle(cluster.addresses, 15.0)
