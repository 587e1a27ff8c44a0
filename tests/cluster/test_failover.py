"""Decode failover on real processes: one of two decodes is killed (``kill -9``) while it
streams; the router resubmits each of its requests to the other decode, through the prefill,
with the prompt plus the tokens already streamed, and every stream completes, token for token
equal to the in-process engine (greedy), with nothing left held on the survivors. It runs on the
built-in tiny model and on a hybrid Qwen3.5 (``fault_model``): the resubmitted prompt's states
travel again, and the survivors' state slots end free.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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
from tests.cluster.streams import Stream, wait_for
from tests.cluster.test_cluster import start_all, stop_all

pytestmark = pytest.mark.slow
NEW = 200  # long enough that every stream is still running when its decode dies
PROMPTS = [[(i * 31 + j * 7) % 380 for j in range(6 + 5 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def nodes(fault_model: Path) -> Iterator[dict[str, Node]]:
    model = ["--model", str(fault_model), "--page-size", "8", "--num-pages", "1024", "--port", "0",
             "--heartbeat-interval-s", "0.5", "--quarantine-s", "1"]
    started: dict[str, Node] = {}
    try:
        p, d0, d1 = start_all([["prefill", *model], ["decode", *model], ["decode", *model]])
        started.update(p=p, d0=d0, d1=d1)
        [started["router"]] = start_all([[
            "router", "--model", str(fault_model), "--port", "0", "--prefill", p.address,
            "--decode", f"{d0.address},{d1.address}"]])
        yield started
    finally:
        stop_all(list(started.values()))


def _req(ids: list[int]) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                               sampling=gpb.SamplingParams(max_new_tokens=NEW, ignore_eos=True))


def test_decode_killed_mid_stream_fails_over(nodes: dict[str, Node], fault_model: Path) -> None:
    engine = LLMEngine(fault_model, EngineConfig(num_pages=1024, page_size=8))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = [r.token_ids for r in engine.generate([Prompt(token_ids=p) for p in PROMPTS], params)]
    with grpc.insecure_channel(nodes["router"].address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        streams = [Stream(stub, _req(p)) for p in PROMPTS]
        wait_for(lambda: all(len(s.tokens) >= 3 for s in streams), "the streams never started")
        running = {name: get_stats(nodes[name].address).requests_running
                   for name in ("d0", "d1")}
        victim = max(running, key=lambda name: running[name])
        assert running[victim] > 0, running
        nodes[victim].proc.kill()
        nodes[victim].proc.wait()
        killed_at = time.monotonic()
        for s in streams:
            s.join(120.0)
        cut = [len(s.tokens) for s in streams]
        assert [s.error for s in streams] == [None] * len(streams)
        assert [s.tokens for s in streams] == want, cut
        assert all(s.ended_at > killed_at for s in streams)  # they were mid-stream
        assert [(s.usage.prompt_tokens, s.usage.completion_tokens) for s in streams] == \
            [(len(p), NEW) for p in PROMPTS]
    stats = get_stats(nodes["router"].address)
    assert stats.decode_failovers >= running[victim] > 0 and stats.transfers_failed == 0, stats
    survivors = [nodes[n].address for n in ("router", "p", "d0", "d1") if n != victim]
    assert_all_idle(survivors, 15.0)
