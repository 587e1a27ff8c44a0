"""A prefill and a decode worker as real processes, with real Mooncake transfer over loopback,
driven directly through the worker API (the router's part is played by the test)."""

from __future__ import annotations

import threading
import time
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
from proto.convert import patches_message
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from tests.cluster.harness import running

pytestmark = pytest.mark.slow
NODE_ARGS = ["--port", "0", "--num-pages", "96", "--page-size", "8",
             "--max-num-batched-tokens", "48"]


def worker_request(room: int, ids: list[int], new: int, images=()) -> wpb.WorkerRequest:  # noqa: ANN001
    sampling = gpb.SamplingParams(max_new_tokens=new, ignore_eos=True)
    msgs = [patches_message(p.numpy(), g) for p, g in images]
    return wpb.WorkerRequest(room=room, request_id=f"r{room}", token_ids=ids, images=msgs,
                             sampling=sampling)


def run_room(prefill: str, decode: str, bootstrap: str, req: wpb.WorkerRequest) -> list[int]:
    with grpc.insecure_channel(prefill) as pch, grpc.insecure_channel(decode) as dch:
        pstub, dstub = worker_pb2_grpc.PrefillWorkerStub(pch), worker_pb2_grpc.DecodeWorkerStub(dch)
        stream = dstub.Decode(wpb.DecodeRequest(request=req, prefill_bootstrap=bootstrap))
        errors: list[Exception] = []

        def prefill() -> None:
            try:
                pstub.Prefill(wpb.PrefillRequest(request=req), timeout=60)
            except grpc.RpcError as exc:
                errors.append(exc)

        t = threading.Thread(target=prefill)
        t.start()
        ids = [tok for msg in stream for tok in msg.token_ids]
        t.join()
        assert not errors, errors
        return ids


def wait_idle(address: str, stub_cls, timeout_s: float = 10.0) -> wpb.LoadReport:  # noqa: ANN001
    with grpc.insecure_channel(address) as ch:
        stub = stub_cls(ch)
        deadline = time.monotonic() + timeout_s
        while True:
            load = stub.GetLoad(wpb.GetLoadRequest())
            idle = load.kv_pages_used == 0 and load.rooms_active == 0 and \
                load.running_requests == 0 and load.waiting_requests == 0
            if idle or time.monotonic() > deadline:
                return load
            time.sleep(0.05)


def test_disaggregated_equals_colocated(tiny_dir: Path) -> None:
    special = tiny_config_dict()
    img_tok, vs, ve = (special["image_token_id"], special["vision_start_token_id"],
                       special["vision_end_token_id"])
    patches = torch.from_numpy(np.random.default_rng(0).standard_normal((16, 1176)).astype("f4"))
    image = (patches, (1, 4, 4))
    cases = [
        ([1, 2, 3, 4, 5], ()),
        (list(range(20, 120)), ()),  # longer than one prefill chunk
        ([5, 6, vs] + [img_tok] * 4 + [ve, 7, 8], (image,)),
    ]
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=96, page_size=8))
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = [engine.generate([Prompt(token_ids=ids, images=[ImageInput(*im) for im in ims])],
                                greedy)[0].token_ids for ids, ims in cases]
    model = ["--model", str(tiny_dir)]
    with running(["prefill", *model, *NODE_ARGS], ["decode", *model, *NODE_ARGS]) as [p, d]:
        with grpc.insecure_channel(p.address) as ch:
            load = worker_pb2_grpc.PrefillWorkerStub(ch).GetLoad(wpb.GetLoadRequest())
            bootstrap = load.bootstrap
        for room, ((ids, ims), exp) in enumerate(zip(cases, expected, strict=True), start=1):
            got = run_room(p.address, d.address, bootstrap, worker_request(room, ids, 10, ims))
            assert got == exp, f"case {room}"
        assert wait_idle(p.address, worker_pb2_grpc.PrefillWorkerStub).kv_pages_used == 0
        load = wait_idle(d.address, worker_pb2_grpc.DecodeWorkerStub)
        assert (load.kv_pages_used, load.rooms_active, load.running_requests) == (0, 0, 0)
