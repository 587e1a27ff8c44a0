"""A tensor-parallel rank killed mid-request (``kill -9`` of that rank's process): its worker
cannot step again, so it fails what it holds, ends itself with status 1 (a supervisor sees a
failed worker rather than a live one failing every request), and the router recovers as for a
dead worker: a prompt whose prefill rank died is computed on the decode and completes equal to
the engine; a request whose only decode lost a rank ends UNAVAILABLE within a bound. The
survivors end holding nothing, and the worker restarted on its ports is used again.

Cluster: a prefill with ``--tp-size 2``, a decode with ``--tp-size 2``, one router; handshake
timeouts small, a long prompt in small chunks so the prefill is still sending when killed. A
last test runs a two-stage prefill whose later stage has ``--tp-size 2`` and kills its rank 1.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle, get_stats
from tests.cluster.streams import Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_decode_tp import rank_processes
from tests.cluster.test_faults import (
    FAST_FAIL,
    LONG,
    Cluster,
    _req,
    _serves_again,
    _started_on,
    one_of_each,
    only_decode_dies_mid_stream,
)

pytestmark = pytest.mark.slow
EXIT_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    with one_of_each(tiny_dir, ["--tp-size", "2"]) as c:
        yield c


def kill_rank_1(cluster: Cluster, name: str) -> None:
    """``kill -9`` rank 1's process of worker ``name``, then wait for the worker to end itself
    with status 1."""
    node = cluster.nodes[name]
    [rank1] = rank_processes(node.proc.pid)
    os.kill(rank1, signal.SIGKILL)
    assert node.proc.wait(EXIT_WITHIN_S) == 1


def test_a_prefill_rank_killed_mid_transfer_ends_its_worker_and_the_prompt_is_recomputed(
    cluster: Cluster, tiny_dir: Path
) -> None:
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=512, page_size=8))
    [want] = engine.generate([Prompt(token_ids=LONG)],
                             SamplingParams(max_new_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(cluster.address("router")) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        admin = cluster.admin("prefill")
        admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5)
        stream = Stream(stub, _req(LONG, 8))
        wait_for(lambda: _started_on(stream, admin), "the prefill never started the room")
        kill_rank_1(cluster, "prefill")
        stream.join(60.0)
        assert stream.error is None and stream.tokens == want.token_ids, stream.error
        assert get_stats(cluster.address("router")).kv_recomputes >= 1
        assert_all_idle([cluster.address("decode"), cluster.address("router")], 15.0)
        cluster.restart("prefill")
        before = get_stats(cluster.address("prefill")).requests_total
        _serves_again(stub)
        assert get_stats(cluster.address("prefill")).requests_total > before
    assert_all_idle(cluster.addresses)


def test_a_decode_rank_killed_mid_stream_ends_its_worker_and_the_request(
    cluster: Cluster,
) -> None:
    only_decode_dies_mid_stream(cluster, lambda: kill_rank_1(cluster, "decode"))


def test_a_later_stage_rank_killed_mid_prompt_ends_its_stage_and_the_prompt_is_recomputed(
    tiny_dir: Path,
) -> None:
    common = ["--model", str(tiny_dir), "--page-size", "8", "--num-pages", "512", *FAST_FAIL,
              "--port", "0"]
    stage = ["prefill", *common, "--pp-size", "2", "--max-num-batched-tokens", "16"]
    nodes: list[Node] = []
    try:
        nodes += start_all([[*stage, "--pp-rank", "1", "--tp-size", "2"], ["decode", *common]])
        last, decode = nodes
        nodes += start_all([[*stage, "--pp-rank", "0", "--pp-next", last.address]])
        nodes += start_all([["router", "--model", str(tiny_dir), "--port", "0", "--prefill",
                             nodes[-1].address, "--decode", decode.address]])
        router = nodes[-1]
        engine = LLMEngine(tiny_dir, EngineConfig(num_pages=512, page_size=8))
        [want] = engine.generate([Prompt(token_ids=LONG)],
                                 SamplingParams(max_new_tokens=8, ignore_eos=True))
        with grpc.insecure_channel(router.address) as ch, \
                grpc.insecure_channel(last.address) as stage_ch:
            stream = Stream(generate_pb2_grpc.GenerationStub(ch), _req(LONG, 8))
            admin = admin_pb2_grpc.AdminStub(stage_ch)
            wait_for(lambda: _started_on(stream, admin), "the later stage never started")
            [rank1] = rank_processes(last.proc.pid)
            os.kill(rank1, signal.SIGKILL)
            assert last.proc.wait(EXIT_WITHIN_S) == 1
            stream.join(60.0)
            assert stream.error is None and stream.tokens == want.token_ids, stream.error
        assert get_stats(router.address).kv_recomputes >= 1
        assert_all_idle([n.address for n in nodes if n is not last], 15.0)
    finally:
        stop_all(nodes)
