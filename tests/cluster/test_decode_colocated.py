"""A decode worker serving whole requests (colocated mode) over real gRPC on loopback."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from tests.cluster.harness import running

pytestmark = pytest.mark.slow


def decode_request(room: int, ids: list[int], new: int) -> wpb.DecodeRequest:
    sampling = gpb.SamplingParams(max_new_tokens=new, ignore_eos=True)
    req = wpb.WorkerRequest(room=room, request_id=f"r{room}", token_ids=ids, sampling=sampling)
    return wpb.DecodeRequest(request=req, local_prefill=True)


def test_streams_equal_in_process_engine(tiny_dir: Path) -> None:
    prompts = [[1, 2, 3, 4, 5], list(range(10, 60)), [7] * 3]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=64))
    expected = engine.generate([Prompt(token_ids=p) for p in prompts],
                               SamplingParams(max_new_tokens=12, ignore_eos=True))
    with running(["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "64"]) as [d]:
        with grpc.insecure_channel(d.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            futures = [stub.Decode(decode_request(i + 1, p, 12)) for i, p in enumerate(prompts)]
            for fut, exp in zip(futures, expected, strict=True):
                msgs = list(fut)
                ids = [t for m in msgs for t in m.token_ids]
                assert ids == exp.token_ids
                assert msgs[-1].finished and msgs[-1].finish_reason == "length"
                assert msgs[-1].usage.completion_tokens == 12
            load = stub.GetLoad(wpb.GetLoadRequest())
            assert load.kv_pages_used == 0 and load.running_requests == 0


def test_bad_request_is_invalid_argument_and_node_keeps_serving(tiny_dir: Path) -> None:
    with running(["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "64"]) as [d]:
        with grpc.insecure_channel(d.address) as ch:
            stub = worker_pb2_grpc.DecodeWorkerStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Decode(decode_request(1, [], 4)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "empty" in err.value.details()
            msgs = list(stub.Decode(decode_request(2, [1, 2, 3], 4)))
            assert sum(len(m.token_ids) for m in msgs) == 4
