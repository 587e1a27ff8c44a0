"""Overload and deadlines, as real processes: bounded admission queues refuse work with
``RESOURCE_EXHAUSTED`` and a ``retry-after-ms`` hint on every node kind, the router passes a
worker's refusal on unchanged, and a client deadline ends the request with ``DEADLINE_EXCEEDED``
and leaves every node idle.

The decode pool is small: ``hog`` (5 prompt tokens, 2000 new) reserves most of it for its worst
case, so ``waiter`` (600 prompt tokens) waits in the decode's prealloc queue and in the prefill's
bootstrap gate, filling both queues (``--max-waiting 1``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from serving.overload import RETRY_AFTER_KEY, retry_after_ms
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
NODE = ["--port", "0", "--page-size", "8", "--max-num-batched-tokens", "48", "--max-waiting", "1"]


@dataclass
class Cluster:
    prefill: Node
    decode: Node
    router: Node  # --max-running 8
    narrow: Node  # a second router, --max-running 1

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in (self.prefill, self.decode, self.router, self.narrow)]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    model = ["--model", str(tiny_dir), *NODE]
    workers = start_all([["prefill", *model, "--num-pages", "192"],
                         ["decode", *model, "--num-pages", "320"]])
    routers: list[Node] = []
    try:
        p, d = workers
        base = ["router", "--model", str(tiny_dir), "--port", "0", "--prefill", p.address,
                "--decode", d.address]
        routers = start_all([[*base, "--max-running", "8"], [*base, "--max-running", "1"]])
        yield Cluster(p, d, *routers)
    finally:
        stop_all(routers)
        stop_all(workers)


def _req(ids: list[int], new: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                               sampling=gpb.SamplingParams(max_new_tokens=new, ignore_eos=True))


HOG = _req([3, 1, 4, 1, 5], 2000)
WAITER = _req([(j * 11) % 500 for j in range(600)], 16)


def _refused(exc: grpc.RpcError) -> int:
    """Assert ``exc`` is an overload refusal with its hint; return the hint (ms)."""
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
    hint = retry_after_ms(exc.trailing_metadata())
    assert hint is not None and hint > 0, exc.trailing_metadata()
    assert f"retry after {hint} ms" in exc.details()
    return hint


def _consume(stream: Iterator[gpb.GenerateResponse], errors: list[grpc.RpcError]) -> None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError as exc:
        errors.append(exc)


def test_full_queues_refuse_with_a_retry_hint_on_every_node(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router.address) as rch, \
            grpc.insecure_channel(cluster.narrow.address) as nch:
        router = generate_pb2_grpc.GenerationStub(rch)
        narrow = generate_pb2_grpc.GenerationStub(nch)
        hog = narrow.Generate(HOG, timeout=120)
        assert not next(hog).finished
        # the router's own bound: one live stream on the narrow router
        with pytest.raises(grpc.RpcError) as err:
            list(narrow.Generate(_req([1, 2, 3], 2), timeout=30))
        _refused(err.value)
        assert "--max-running 1" in err.value.details()
        # fill the decode's prealloc queue and the prefill's gate
        waiter = router.Generate(WAITER, timeout=120)
        errors: list[grpc.RpcError] = []
        reader = threading.Thread(target=_consume, args=(waiter, errors), daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while (get_stats(cluster.decode.address).requests_waiting < 1
               or get_stats(cluster.prefill.address).requests_waiting < 1):
            assert not errors, errors
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.02)
        # a worker's refusal reaches the client through the router unchanged
        with pytest.raises(grpc.RpcError) as err:
            list(router.Generate(_req([7, 8, 9], 4), timeout=30))
        _refused(err.value)
        assert "worker" in err.value.details() and "--max-waiting 1" in err.value.details()
        # each worker refuses directly too
        room = wpb.WorkerRequest(room=12345, request_id="direct", token_ids=[1, 2, 3],
                                 sampling=gpb.SamplingParams(max_new_tokens=2))
        with grpc.insecure_channel(cluster.decode.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(
                    wpb.DecodeRequest(request=room, local_prefill=True), timeout=30))
            _refused(err.value)
        with grpc.insecure_channel(cluster.prefill.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(wpb.PrefillRequest(request=room),
                                                              timeout=30)
            _refused(err.value)
        waiter.cancel()  # type: ignore[attr-defined]
        hog.cancel()  # type: ignore[attr-defined]
        reader.join(30)
    for node in (cluster.prefill, cluster.decode, cluster.narrow):
        assert get_stats(node.address).requests_rejected >= 1, node.address
    assert_all_idle(cluster.addresses)


def test_a_client_deadline_ends_the_request_and_frees_every_node(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(HOG, timeout=1.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 10
        # a deadline that passes while the room waits on the prefill's gate
        hog = stub.Generate(HOG, timeout=120)
        assert not next(hog).finished
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(WAITER, timeout=1.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        hog.cancel()  # type: ignore[attr-defined]
    assert_all_idle(cluster.addresses)


def test_retry_hint_parsing() -> None:
    assert retry_after_ms([(RETRY_AFTER_KEY, "250")]) == 250
    assert retry_after_ms([("other", "1")]) is None
    assert retry_after_ms([(RETRY_AFTER_KEY, "soon")]) is None
