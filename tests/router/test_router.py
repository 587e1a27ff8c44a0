"""The router in colocated mode, end to end: two ``pdserve decode`` workers behind one
``pdserve router``, called through the generated gRPC stubs, compared with the in-process engine.
"""

from __future__ import annotations

import io
import math
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, start_node, stop_node

pytestmark = pytest.mark.slow
PAGES = "256"


@dataclass
class Cluster:
    router: Node
    decodes: list[Node]
    engine: LLMEngine
    model_dir: Path

    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(self.router.address))

    def wait_idle(self, timeout_s: float = 15.0) -> None:
        """Poll every decode worker until it holds no pages and runs nothing."""
        deadline = time.monotonic() + timeout_s
        for node in self.decodes:
            with grpc.insecure_channel(node.address) as ch:
                stub = worker_pb2_grpc.DecodeWorkerStub(ch)
                while True:
                    load = stub.GetLoad(wpb.GetLoadRequest())
                    if load.kv_pages_used == 0 and load.running_requests == 0 \
                            and load.waiting_requests == 0:
                        break
                    assert time.monotonic() < deadline, f"{node.address} still busy: {load}"
                    time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    nodes: list[Node] = []
    try:
        for _ in range(2):
            nodes.append(start_node(["decode", "--model", str(tiny_dir), "--port", "0",
                                     "--num-pages", PAGES]))
        addrs = ",".join(n.address for n in nodes)
        router = start_node(["router", "--model", str(tiny_dir), "--colocated", addrs,
                             "--port", "0"])
        engine = LLMEngine(tiny_dir, EngineConfig(num_pages=int(PAGES)))
        yield Cluster(router, nodes[:], engine, tiny_dir)
        nodes.append(router)
    finally:
        for node in reversed(nodes):
            stop_node(node)


def greedy(n: int, **kw: object) -> gpb.SamplingParams:
    return gpb.SamplingParams(max_new_tokens=n, **kw)  # type: ignore[arg-type]


def collect(stream: Iterator[gpb.GenerateResponse]) -> list[gpb.GenerateResponse]:
    return list(stream)


def assert_same(msgs: list[gpb.GenerateResponse], exp: GenerationResult) -> None:
    assert [t for m in msgs for t in m.token_ids] == exp.token_ids
    assert "".join(m.text for m in msgs) == exp.text
    assert all(not m.finished for m in msgs[:-1]) and msgs[-1].finished
    assert msgs[-1].finish_reason == exp.finish_reason.value
    assert msgs[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
    assert msgs[-1].usage.completion_tokens == len(exp.token_ids)


def png(width: int, height: int, seed: int = 0) -> bytes:
    img = Image.new("RGB", (width, height))
    img.putdata([((x * 7 + seed) % 256, (y * 13) % 256, (x * y + seed) % 256)
                 for y in range(height) for x in range(width)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---- outputs equal the in-process engine ---------------------------------------------------------


def test_text_token_id_and_image_prompts_equal_engine(cluster: Cluster) -> None:
    image = png(56, 84)
    prompts = [
        (Prompt(text="hello world, tell me a story"), gpb.GenerateRequest(
            text="hello world, tell me a story")),
        (Prompt(token_ids=[5, 6, 7, 8, 9, 10]), gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=[5, 6, 7, 8, 9, 10]))),
        (Prompt(text="describe this picture", images=[image]), gpb.GenerateRequest(
            text="describe this picture", images=[gpb.Image(encoded=image)])),
        (Prompt(text="a <|image_pad|> and <|image_pad|>", images=[image, png(84, 56, 3)]),
         gpb.GenerateRequest(text="a <|image_pad|> and <|image_pad|>",
                             images=[gpb.Image(encoded=image),
                                     gpb.Image(encoded=png(84, 56, 3))])),
    ]
    expected = cluster.engine.generate([p for p, _ in prompts], SamplingParams(max_new_tokens=24))
    stub = cluster.stub()
    for (_, req), exp in zip(prompts, expected, strict=True):
        req.sampling.CopyFrom(greedy(24))
        assert_same(collect(stub.Generate(req)), exp)


def test_sixteen_concurrent_streams_equal_engine(cluster: Cluster) -> None:
    prompts = [[(i * 31 + j * 7) % 500 for j in range(3 + 5 * i)] for i in range(16)]
    lengths = [4 + 3 * i for i in range(16)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    expected = cluster.engine.generate([Prompt(token_ids=p) for p in prompts], params)
    stub = cluster.stub()
    streams = [stub.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=p), sampling=greedy(n, ignore_eos=True)))
        for p, n in zip(prompts, lengths, strict=True)]
    results: dict[int, list[gpb.GenerateResponse]] = {}

    def read(i: int) -> None:
        results[i] = collect(streams[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, exp in enumerate(expected):
        assert_same(results[i], exp)
    cluster.wait_idle()


def test_logprobs_only_when_asked(cluster: Cluster) -> None:
    stub = cluster.stub()
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 2, 3]), sampling=greedy(6))
    assert all(not m.logprobs for m in stub.Generate(req))
    req.sampling.logprobs = True
    msgs = collect(stub.Generate(req))
    lps = [lp for m in msgs for lp in m.logprobs]
    assert len(lps) == sum(len(m.token_ids) for m in msgs) and all(lp <= 0 for lp in lps)


# ---- streaming and cancellation ------------------------------------------------------------------


def long_request(n: int = 2000, rid: str = "") -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=rid, token_ids=gpb.TokenIds(ids=[3, 1, 4, 1, 5]),
                               sampling=greedy(n, ignore_eos=True))


def test_first_message_arrives_before_the_last_token(cluster: Cluster) -> None:
    stream = cluster.stub().Generate(long_request(200))
    first = next(stream)
    assert len(first.token_ids) < 200 and not first.finished
    rest = collect(stream)
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200
    assert len(rest) >= 1


def test_cancel_frees_workers_and_other_stream_is_unharmed(cluster: Cluster) -> None:
    stub = cluster.stub()
    other_ids = [9, 8, 7, 6]
    [exp] = cluster.engine.generate([Prompt(token_ids=other_ids)],
                                    SamplingParams(max_new_tokens=60, ignore_eos=True))
    victim = stub.Generate(long_request())
    other = stub.Generate(gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=other_ids),
                                              sampling=greedy(60, ignore_eos=True)))
    next(victim)
    victim.cancel()
    assert_same(collect(other), exp)
    with pytest.raises(grpc.RpcError) as err:
        collect(victim)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    cluster.wait_idle()


def test_deadline_frees_workers(cluster: Cluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        collect(cluster.stub().Generate(long_request(), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.wait_idle()


def test_abort_by_request_id(cluster: Cluster) -> None:
    stub = cluster.stub()
    stream = stub.Generate(long_request(rid="abort-me"))
    next(stream)
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(long_request(rid="abort-me")))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.Abort(gpb.AbortRequest(request_id="abort-me"))
    rest = collect(stream)
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    cluster.wait_idle()
    with pytest.raises(grpc.RpcError) as err:
        stub.Abort(gpb.AbortRequest(request_id="abort-me"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# ---- bad input -----------------------------------------------------------------------------------


def _patches(shape: list[int], grid: list[int], nbytes: int | None = None) -> gpb.Image:
    n = shape[0] * shape[1] * 4 if nbytes is None else nbytes
    return gpb.Image(patches=gpb.ImagePatches(data=b"\0" * n, shape=shape, grid_thw=grid))


def _huge_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (8200, 8200)).save(buf, format="PNG")
    return buf.getvalue()


def _bad_requests() -> list[tuple[str, gpb.GenerateRequest]]:
    ids = gpb.TokenIds(ids=[1, 2, 3])
    ok = png(56, 56)
    return [
        ("no input", gpb.GenerateRequest()),
        ("empty text", gpb.GenerateRequest(text="")),
        ("empty ids", gpb.GenerateRequest(token_ids=gpb.TokenIds())),
        ("id out of vocab", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 100000]))),
        ("too many images", gpb.GenerateRequest(
            text="x", images=[gpb.Image(encoded=ok)] * 17)),
        ("undecodable image", gpb.GenerateRequest(
            text="x", images=[gpb.Image(encoded=b"not an image")])),
        ("empty image", gpb.GenerateRequest(text="x", images=[gpb.Image()])),
        ("huge image", gpb.GenerateRequest(text="x", images=[gpb.Image(encoded=_huge_png())])),
        ("aspect ratio", gpb.GenerateRequest(text="x", images=[gpb.Image(encoded=png(1, 300))])),
        ("patch shape", gpb.GenerateRequest(text="x", images=[_patches([4, 1176], [1, 4, 4])])),
        ("patch bytes", gpb.GenerateRequest(
            text="x", images=[_patches([16, 1176], [1, 4, 4], nbytes=12)])),
        ("patch grid", gpb.GenerateRequest(text="x", images=[_patches([12, 1176], [1, 3, 4])])),
        ("patch 1-D shape", gpb.GenerateRequest(text="x", images=[_patches([16], [1, 4, 4], 64)])),
        ("placeholders", gpb.GenerateRequest(
            text="a <|image_pad|> b <|image_pad|>", images=[gpb.Image(encoded=ok)])),
        ("id placeholders", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 510, 510, 2]))),
        ("negative temperature", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            temperature=-1.0))),
        ("nan temperature", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            temperature=math.nan))),
        ("top_p > 1", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            top_p=1.5))),
        ("top_p < 0", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            top_p=-0.5))),
        ("max_new_tokens", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            max_new_tokens=100000))),
        ("too long", gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1] * 200),
                                         sampling=gpb.SamplingParams(max_new_tokens=4000))),
        ("stop id", gpb.GenerateRequest(token_ids=ids, sampling=gpb.SamplingParams(
            stop_token_ids=[99999]))),
    ]


def test_bad_input_is_invalid_argument_and_router_keeps_serving(cluster: Cluster) -> None:
    stub = cluster.stub()
    for name, req in _bad_requests():
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value)
        assert err.value.details(), name
    msgs = collect(stub.Generate(gpb.GenerateRequest(text="still here", sampling=greedy(4))))
    assert msgs[-1].finished
    cluster.wait_idle()


# ---- model info, health, reflection, other routers -----------------------------------------------


def test_model_info_health_and_reflection(cluster: Cluster) -> None:
    info = cluster.stub().GetModelInfo(gpb.GetModelInfoRequest())
    assert (info.model_type, info.vocab_size, info.max_model_len) == ("qwen2_vl", 512, 4096)
    assert info.has_tokenizer and info.mode == "colocated"
    with grpc.insecure_channel(cluster.router.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 30  # SERVING once the router has polled its worker
        for service in ("", "pdserve.v1.Generation"):
            while (resp := health.Check(health_pb2.HealthCheckRequest(service=service))).status \
                    != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                time.sleep(0.1)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        [resp] = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert "pdserve.v1.Generation" in names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_tokenizer_and_unreachable_worker(cluster: Cluster, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(cluster.model_dir, bare)
    (bare / "tokenizer.json").unlink()
    dead = f"127.0.0.1:{_free_port()}"
    no_tok = start_node(["router", "--model", str(bare), "--port", "0",
                         "--colocated", cluster.decodes[0].address])
    unreachable = start_node(["router", "--model", str(cluster.model_dir), "--port", "0",
                              "--colocated", dead])
    try:
        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(no_tok.address))
        assert not stub.GetModelInfo(gpb.GetModelInfoRequest()).has_tokenizer
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(gpb.GenerateRequest(text="hi")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids" in err.value.details()
        msgs = collect(stub.Generate(gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=[1, 2]), sampling=greedy(3, ignore_eos=True))))
        assert sum(len(m.token_ids) for m in msgs) == 3 and all(not m.text for m in msgs)

        stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(unreachable.address))
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(gpb.GenerateRequest(text="hi")))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dead in err.value.details()
    finally:
        stop_node(no_tok)
        stop_node(unreachable)
