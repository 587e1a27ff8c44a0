"""A prefill split into pipeline stages (``pdserve prefill --pp-size 2``) and one decode node,
as real processes with real Mooncake transfer over loopback: each stage pushes its own layers'
KV into the one decode pool (layer remapping), the last stage sends the first token, and the
output equals the in-process engine token for token."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engine.builtin.tiny_model import tiny_config_dict
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from serving.auth import internal_metadata
from tests.cluster.harness import Node, running
from tests.cluster.stats import assert_all_idle
from tests.cluster.test_cluster import start_all, stop_all
from tests.cluster.test_disagg_workers import NODE_ARGS, run_room, worker_request
from tests.conftest import HF_SPECIAL

pytestmark = pytest.mark.slow
STUBS = (worker_pb2_grpc.PrefillWorkerStub, worker_pb2_grpc.DecodeWorkerStub)


@contextmanager
def pipeline(model: Path, pp_size: int = 2) -> Iterator[tuple[list[Node], Node, str]]:
    """Prefill stages (last started first) and a decode node; yields (stages in rank order,
    decode, stage 0's bootstrap string)."""
    args = ["--model", str(model), *NODE_ARGS]
    last, d = start_all([["prefill", *args, "--pp-size", str(pp_size), "--pp-rank",
                          str(pp_size - 1)], ["decode", *args]])  # at once: neither needs the other
    try:
        stages = [last]
        with _earlier(args, pp_size, stages):
            with grpc.insecure_channel(stages[0].address) as ch:
                load = worker_pb2_grpc.PrefillWorkerStub(ch).GetLoad(wpb.GetLoadRequest())
            yield stages, d, load.bootstrap
    finally:
        stop_all([d, last])


@contextmanager
def _earlier(args: list[str], pp_size: int, stages: list[Node]) -> Iterator[None]:
    if len(stages) == pp_size:
        yield
        return
    rank = pp_size - len(stages) - 1
    with running(["prefill", *args, "--pp-size", str(pp_size), "--pp-rank", str(rank),
                  "--pp-next", stages[0].address]) as [node]:
        stages.insert(0, node)
        with _earlier(args, pp_size, stages):
            yield


def loads(stages: list[Node], decode: Node) -> list[tuple[int, int, int, int]]:
    out = []
    for node, stub_cls in [*((s, STUBS[0]) for s in stages), (decode, STUBS[1])]:
        with grpc.insecure_channel(node.address) as ch:
            load = stub_cls(ch).GetLoad(wpb.GetLoadRequest())
        out.append((load.kv_pages_used, load.rooms_active, load.running_requests,
                    load.waiting_requests))
    return out


def assert_idle(stages: list[Node], decode: Node, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = loads(stages, decode)
        if all(x == (0, 0, 0, 0) for x in got):
            return
        assert time.monotonic() < deadline, f"nodes still hold state: {got}"
        time.sleep(0.05)


def expected_tokens(model: Path, cases: list, new: int) -> list[list[int]]:  # noqa: ANN001
    engine = LLMEngine(model, EngineConfig(num_pages=96, page_size=8))
    greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return [engine.generate([Prompt(token_ids=ids, images=[ImageInput(*im) for im in ims])],
                            greedy)[0].token_ids for ids, ims in cases]


def image_cases(special: dict) -> list:  # noqa: ANN001
    img_tok, vs, ve = (special["image_token_id"], special["vision_start_token_id"],
                       special["vision_end_token_id"])
    patches = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 1176)).astype("f4"))
    image = (patches, (1, 4, 4))
    return [
        ([1, 2, 3, 4, 5], ()),
        (list(range(20, 120)), ()),  # longer than one prefill chunk (48 tokens)
        ([5, 6, vs] + [img_tok] * 4 + [ve, 7, 8], (image,)),
        ([9, vs] + [img_tok] * 4 + [ve] + list(range(40, 100)), (image,)),  # image, 2 chunks
    ]


Pipeline = tuple[list[Node], Node, str]


def check_equal(model: Path, special: dict, p: Pipeline) -> None:  # noqa: ANN001
    stages, d, bootstrap = p
    cases = image_cases(special)
    expected = expected_tokens(model, cases, 10)
    assert bootstrap.count(",") == len(stages) - 1
    for room, ((ids, ims), exp) in enumerate(zip(cases, expected, strict=True), start=1):
        got = run_room(stages[0].address, d.address, bootstrap,
                       worker_request(room, ids, 10, ims))
        assert got == exp, f"case {room}"
    assert_idle(stages, d)
    # several rooms at once, batched across steps on every stage
    reqs = [worker_request(100 + i, ids, 10, ims) for i, (ids, ims) in enumerate(cases * 3)]
    with ThreadPoolExecutor(len(reqs)) as pool:
        got_all = list(pool.map(
            lambda r: run_room(stages[0].address, d.address, bootstrap, r), reqs))
    assert got_all == expected * 3
    assert_idle(stages, d)


@pytest.fixture(scope="module")
def tiny_pipeline(tiny_dir: Path) -> Iterator[Pipeline]:
    """Two stages of the tiny model (2 layers: one per stage) and a decode, shared by the tests
    that need no other setup (their room ids differ)."""
    with pipeline(tiny_dir) as p:
        yield p


def test_two_stages_equal_colocated(tiny_dir: Path, tiny_pipeline: Pipeline) -> None:
    check_equal(tiny_dir, tiny_config_dict(), tiny_pipeline)


def test_uneven_stages_equal_colocated(hf_dir: Path) -> None:
    with pipeline(hf_dir) as p:  # 3 layers: stage 0 owns layer 0, stage 1 layers 1 and 2
        check_equal(hf_dir, HF_SPECIAL, p)


def test_aborts_leave_nothing_on_any_node(tiny_dir: Path, tiny_pipeline: Pipeline) -> None:
    stages, d, bootstrap = tiny_pipeline
    req = worker_request(7, list(range(10, 90)), 10)
    with grpc.insecure_channel(stages[0].address) as pch:
        pstub = worker_pb2_grpc.PrefillWorkerStub(pch)
        # 1. a room gated on stage 0 (no decode): the router aborts it
        fut = pstub.Prefill.future(wpb.PrefillRequest(request=req), timeout=30)
        time.sleep(0.3)
        assert pstub.AbortRoom(wpb.AbortRoomRequest(room=7, reason="test")).found
        with pytest.raises(grpc.RpcError):
            fut.result()
        assert_idle(stages, d)
        # 2. destinations on every stage, no prefill request: the client cancels
        with grpc.insecure_channel(d.address) as dch:
            dstub = worker_pb2_grpc.DecodeWorkerStub(dch)
            stream = dstub.Decode(wpb.DecodeRequest(request=worker_request(8, [1, 2, 3], 5),
                                                    prefill_bootstrap=bootstrap))
            threading.Timer(0.5, stream.cancel).start()
            with pytest.raises(grpc.RpcError):
                list(stream)
        assert_idle(stages, d)
        # 3. a long generation cancelled after its first tokens
        long_req = worker_request(9, list(range(10, 90)), 400)
        with grpc.insecure_channel(d.address) as dch:
            dstub = worker_pb2_grpc.DecodeWorkerStub(dch)
            stream = dstub.Decode(wpb.DecodeRequest(request=long_req,
                                                    prefill_bootstrap=bootstrap))
            pstub.Prefill(wpb.PrefillRequest(request=long_req), timeout=30)
            assert next(stream).token_ids
            stream.cancel()
        assert_idle(stages, d)
    # and the pipeline still serves afterwards
    got = run_room(stages[0].address, d.address, bootstrap, worker_request(10, [4, 5, 6], 4))
    assert got == expected_tokens(tiny_dir, [([4, 5, 6], ())], 4)[0]
    assert_idle(stages, d)


def test_stages_require_and_send_the_internal_token(tiny_dir: Path, tmp_path: Path) -> None:
    """With ``--internal-token-file`` a stage refuses ``PipelineStage`` calls without the secret,
    and the stage before it sends the secret (stage 0 starts and requests flow end to end)."""
    secret = tmp_path / "internal"
    secret.write_text("pipeline-secret")
    args = ["--model", str(tiny_dir), *NODE_ARGS, "--internal-token-file", str(secret)]
    [expected] = expected_tokens(tiny_dir, [([1, 2, 3, 4, 5], ())], 6)
    last, d = start_all([["prefill", *args, "--pp-size", "2", "--pp-rank", "1"],
                         ["decode", *args]])
    try:
        with grpc.insecure_channel(last.address) as ch:
            stub = worker_pb2_grpc.PipelineStageStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Describe(wpb.DescribeStageRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.Describe(wpb.DescribeStageRequest(), timeout=10,
                                 metadata=internal_metadata("pipeline-secret"))
            assert (info.pp_rank, info.pp_size) == (1, 2)
        with running(["prefill", *args, "--pp-size", "2", "--pp-rank", "0",
                      "--pp-next", last.address]) as [first], \
                running(["router", "--model", str(tiny_dir), "--port", "0", "--prefill",
                         first.address, "--decode", d.address, "--internal-token-file",
                         str(secret)]) as [router]:
            req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 2, 3, 4, 5]),
                                      sampling=gpb.SamplingParams(max_new_tokens=6,
                                                                  ignore_eos=True))
            with grpc.insecure_channel(router.address) as ch:
                msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
            assert [t for m in msgs for t in m.token_ids] == expected
            meta = internal_metadata("pipeline-secret")
            assert_all_idle([first.address, last.address, d.address, router.address],
                            metadata=meta)
    finally:
        stop_all([d, last])


def test_a_first_stage_without_the_deepstack_layers_is_refused(hf3_dir: Path) -> None:
    """Qwen3-VL adds DeepStack features to decoder layers 0 and 1; a first stage holding layer
    0 only would drop them for layer 1 (they never reach a later stage), so it is refused."""
    from engine.errors import ConfigError
    from prefill_node.pipeline.first_runner import first_stage_runner

    engine = LLMEngine(hf3_dir, EngineConfig(num_pages=16, page_size=8, layers=range(0, 1)))
    with pytest.raises(ConfigError, match=r"DeepStack features to decoder layers 0..1"):
        first_stage_runner(engine)
    first_stage_runner(LLMEngine(hf3_dir, EngineConfig(num_pages=16, page_size=8,
                                                       layers=range(0, 2))))


def test_the_last_stage_samples_the_first_token_under_the_grammar(
        tiny_dir: Path, tiny_pipeline: Pipeline) -> None:
    """A constrained room: the last stage masks the first token it samples (else the decode's
    replay of it would be refused), and the output is the in-process engine's."""
    stages, d, bootstrap = tiny_pipeline
    grammar = ("regex", "[a-c]{2,5}")
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=96, page_size=8))
    [want] = engine.generate([Prompt(token_ids=list(range(20, 70)))],
                             SamplingParams(max_new_tokens=12, structured_output=grammar))
    assert engine.tokenizer is not None
    text = engine.tokenizer.decode(want.token_ids[:-1])
    assert want.finish_reason.value == "stop" and 2 <= len(text) <= 5 and set(text) <= set("abc")
    req = wpb.WorkerRequest(room=900, request_id="r900", token_ids=list(range(20, 70)),
                            sampling=gpb.SamplingParams(
                                max_new_tokens=12, structured_output=gpb.StructuredOutput(
                                    kind=grammar[0], value=grammar[1])))
    assert run_room(stages[0].address, d.address, bootstrap, req) == want.token_ids
    assert_idle(stages, d)


def test_a_pipelined_prefill_does_not_claim_to_score_prompts(tiny_pipeline: Pipeline) -> None:
    """Its stages compute no prompt log-probabilities, so its load report says so: the router
    then has a request that asks for them prefilled on its decode."""
    stages, _, _ = tiny_pipeline
    with grpc.insecure_channel(stages[0].address) as ch:
        load = worker_pb2_grpc.PrefillWorkerStub(ch).GetLoad(wpb.GetLoadRequest())
    assert load.bootstrap and not load.scores_prompts
