"""The router's disaggregated path against fake prefill and decode workers (in this process):
pair selection, room ids, the bootstrap hand-off, concurrent Prefill/Decode, prefill failure,
conditional local prefill and cancellation reaching both workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.cluster.harness import Node, start_node, stop_node

pytestmark = pytest.mark.slow
FAIL_TOKEN = 13  # a prompt starting with it makes the fake prefill fail


@dataclass
class Fake:
    """Shared record of what a fake worker saw."""

    bootstrap: str = ""
    waiting_tokens: int = 0
    requests: list[wpb.WorkerRequest] = field(default_factory=list)
    decode_requests: list[wpb.DecodeRequest] = field(default_factory=list)
    aborted: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)  # rooms whose Decode stream is over
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> wpb.LoadReport:
        return wpb.LoadReport(bootstrap=self.bootstrap, waiting_tokens=self.waiting_tokens)

    def abort(self, room: int) -> wpb.AbortRoomResponse:
        with self.lock:
            self.aborted.add(room)
        return wpb.AbortRoomResponse(found=True)


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, fake: Fake) -> None:
        self.fake = fake

    def Prefill(self, request, context):  # noqa: N802
        self.fake.requests.append(request.request)
        if request.request.token_ids[0] == FAIL_TOKEN:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV pages for the room")
        return wpb.PrefillResponse(room=request.request.room,
                                   prompt_tokens=len(request.request.token_ids))

    def AbortRoom(self, request, context):  # noqa: N802
        return self.fake.abort(request.room)

    def GetLoad(self, request, context):  # noqa: N802
        return self.fake.load()


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Streams token ``i % 300`` every 10 ms until max_new_tokens, an abort or a cancel."""

    def __init__(self, fake: Fake) -> None:
        self.fake = fake

    def Decode(self, request, context):  # noqa: N802
        self.fake.decode_requests.append(request)
        req = request.request
        n = req.sampling.max_new_tokens
        try:
            for i in range(n):
                if req.room in self.fake.aborted:
                    yield gpb.GenerateResponse(finished=True, finish_reason="abort")
                    return
                if not context.is_active():
                    return
                msg = gpb.GenerateResponse(request_id=req.request_id, token_ids=[i % 300])
                if i == n - 1:
                    msg.finished, msg.finish_reason = True, "length"
                    msg.usage.prompt_tokens, msg.usage.completion_tokens = len(req.token_ids), n
                yield msg
                time.sleep(0.01)
        finally:
            self.fake.ended.add(req.room)

    def AbortRoom(self, request, context):  # noqa: N802
        return self.fake.abort(request.room)

    def GetLoad(self, request, context):  # noqa: N802
        return self.fake.load()


@dataclass
class Setup:
    router: Node
    prefills: list[Fake]
    decode: Fake

    def stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(grpc.insecure_channel(self.router.address))


@pytest.fixture(scope="module")
def setup(tiny_dir: Path) -> Iterator[Setup]:
    busy = Fake(bootstrap="127.0.0.1:7001", waiting_tokens=100000)
    idle = Fake(bootstrap="127.0.0.1:7002")
    decode = Fake()
    # one server per worker, so each address reaches the right fake
    servers = []
    addrs = []
    for servicer, add in ((FakePrefill(busy), worker_pb2_grpc.add_PrefillWorkerServicer_to_server),
                          (FakePrefill(idle), worker_pb2_grpc.add_PrefillWorkerServicer_to_server),
                          (FakeDecode(decode), worker_pb2_grpc.add_DecodeWorkerServicer_to_server)):
        s = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        add(servicer, s)
        addrs.append(f"127.0.0.1:{s.add_insecure_port('127.0.0.1:0')}")
        s.start()
        servers.append(s)
    router = start_node(["router", "--model", str(tiny_dir), "--port", "0",
                         "--prefill", f"{addrs[0]},{addrs[1]}", "--decode", addrs[2],
                         "--local-prefill-threshold", "4"])
    try:
        yield Setup(router, [busy, idle], decode)
    finally:
        stop_node(router)
        for s in servers:
            s.stop(0)


def _req(ids: list[int], n: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids),
                               sampling=gpb.SamplingParams(max_new_tokens=n))


def test_least_loaded_prefill_gets_the_room_and_decode_its_bootstrap(setup: Setup) -> None:
    msgs = list(setup.stub().Generate(_req([5, 6, 7, 8, 9], 12)))
    assert [t for m in msgs for t in m.token_ids] == list(range(12))
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 12
    busy, idle = setup.prefills
    assert not busy.requests
    [pre] = idle.requests
    dec = setup.decode.decode_requests[-1]
    assert dec.prefill_bootstrap == idle.bootstrap and not dec.local_prefill
    assert dec.request.room == pre.room and 0 < pre.room < 2**63
    assert list(pre.token_ids) == [5, 6, 7, 8, 9] == list(dec.request.token_ids)


def test_short_prompt_prefills_on_decode(setup: Setup) -> None:
    before = len(setup.prefills[1].requests)
    msgs = list(setup.stub().Generate(_req([5, 6], 3)))
    assert msgs[-1].finished
    dec = setup.decode.decode_requests[-1]
    assert dec.local_prefill and not dec.prefill_bootstrap
    assert len(setup.prefills[1].requests) == before


def test_prefill_failure_fails_stream_and_aborts_decode(setup: Setup) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(setup.stub().Generate(_req([FAIL_TOKEN, 1, 2, 3, 4], 500)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no KV pages" in err.value.details() and "prefill worker 127.0.0.1:" in \
        err.value.details()
    # this request's room (the decode may record it after the stream already ended)
    _wait(lambda: any(d.request.token_ids[:1] == [FAIL_TOKEN]
                      for d in setup.decode.decode_requests))
    [room] = [d.request.room for d in setup.decode.decode_requests
              if d.request.token_ids[:1] == [FAIL_TOKEN]]
    _wait(lambda: room in setup.decode.aborted)


def test_cancel_reaches_both_workers(setup: Setup) -> None:
    stream = setup.stub().Generate(_req([1, 2, 3, 4, 5, 6], 1000))
    next(stream)
    room = setup.decode.decode_requests[-1].request.room
    stream.cancel()
    _wait(lambda: room in setup.decode.aborted and room in setup.prefills[1].aborted)
    _wait(lambda: room in setup.decode.ended)


def _wait(cond, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_real_prefill_and_decode_behind_router_equal_engine(tiny_dir: Path) -> None:
    """1P1D real processes (Mooncake over loopback) behind the router, against the engine."""
    from engine.config import EngineConfig
    from engine.core.request import SamplingParams
    from engine.llm_engine import LLMEngine, Prompt
    from tests.cluster.harness import running
    from tests.router.test_router import png

    args = ["--model", str(tiny_dir), "--port", "0", "--num-pages", "96", "--page-size", "8",
            "--max-num-batched-tokens", "48"]
    image = png(56, 84)
    prompts = [Prompt(text="hello there, a long enough prompt for a chunk or two"),
               Prompt(text="describe", images=[image])]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=96, page_size=8))
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    with running(["prefill", *args], ["decode", *args]) as [p, d]:
        with running(["router", "--model", str(tiny_dir), "--port", "0", "--prefill", p.address,
                      "--decode", d.address]) as [r]:
            stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(r.address))
            reqs = [gpb.GenerateRequest(text=prompts[0].text),
                    gpb.GenerateRequest(text="describe", images=[gpb.Image(encoded=image)])]
            streams = []
            for req in reqs:
                req.sampling.max_new_tokens, req.sampling.ignore_eos = 12, True
                streams.append(stub.Generate(req))
            for stream, exp in zip(streams, expected, strict=True):
                msgs = list(stream)
                assert [t for m in msgs for t in m.token_ids] == exp.token_ids
                assert "".join(m.text for m in msgs) == exp.text
            victim = stub.Generate(gpb.GenerateRequest(
                text="cancel me", sampling=gpb.SamplingParams(max_new_tokens=500,
                                                              ignore_eos=True)))
            next(victim)
            victim.cancel()
            for addr, stub_cls in ((p.address, worker_pb2_grpc.PrefillWorkerStub),
                                   (d.address, worker_pb2_grpc.DecodeWorkerStub)):
                with grpc.insecure_channel(addr) as ch:
                    worker = stub_cls(ch)
                    _wait(lambda w=worker: _idle(w.GetLoad(wpb.GetLoadRequest())), 15.0)


def _idle(load: wpb.LoadReport) -> bool:
    return (load.kv_pages_used, load.rooms_active, load.running_requests,
            load.waiting_requests) == (0, 0, 0, 0)
