"""Qwen2.5-VL through the cluster: real ``pdserve`` processes on a transformers-written tiny
Qwen2.5-VL checkpoint, greedy streams equal to transformers' ``generate`` (the oracle of
tests/engine/models/test_qwen2_5_vl.py) for text, images, a video and an image with a video.

Two clusters cover the paths: a two-stage pipeline prefill and a decode node behind one router
(disaggregated), plus a colocated router on the same decode node; and an EAGLE prefill/decode
pair (the draft's KV travels in its layer band) behind a third router. Prompts are token ids with
one placeholder per image or video (the router expands them) and patches; the prefills run
16-token chunks, so vision blocks span chunk borders. Every node ends idle (the leak check).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from engine.builtin.tiny_model import write_random_draft
from engine.llm_engine import Prompt
from engine.multimodal.inputs import ImageInput, VideoInput
from proto.convert import patches_message
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node
from tests.cluster.stats import assert_all_idle
from tests.cluster.test_cluster import start_all, stop_all
from tests.conftest import HF_SPECIAL
from tests.engine.models.test_qwen2_5_vl import NEW_TOKENS, cases, reference_tokens

pytestmark = pytest.mark.slow

IMG, VID = HF_SPECIAL["image_token_id"], HF_SPECIAL["video_token_id"]
NAMES = ["text_only", "two_images", "video", "image_then_video"]
NODE = ["--port", "0", "--page-size", "8", "--num-pages", "128", "--max-num-batched-tokens", "16"]


def request(prompt: Prompt, new_tokens: int = NEW_TOKENS) -> gpb.GenerateRequest:
    """The wire request of an expanded ``prompt`` (greedy, ``new_tokens`` long): each run of
    pads collapsed to one placeholder, the images and videos as patches with their seconds per
    grid."""
    ids = list(prompt.token_ids or [])
    collapsed = [t for i, t in enumerate(ids) if t not in (IMG, VID) or i == 0 or ids[i - 1] != t]
    images = [gpb.Image(patches=_patches(im)) for im in prompt.images
              if isinstance(im, ImageInput)]  # (a Prompt may also hold encoded bytes)
    videos = [gpb.Video(patches=_patches(v), second_per_grid=v.second_per_grid)
              for v in prompt.videos]
    return gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=collapsed), images=images, videos=videos,
        sampling=gpb.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=0.0))


def _patches(item: ImageInput | VideoInput) -> gpb.ImagePatches:
    return patches_message(np.asarray(item.patches, dtype=np.float32), item.grid_thw)


def stream_all(router: Node) -> list[list[gpb.GenerateResponse]]:
    """Every case at once through ``router``: each one's stream of messages."""
    with grpc.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(len(NAMES)) as pool:
            return list(pool.map(lambda n: list(stub.Generate(request(cases()[n]), timeout=120)),
                                 NAMES))


@pytest.fixture(scope="module")
def nodes(hf25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    text = json.loads((hf25_dir / "config.json").read_text())["text_config"]
    draft = ["--draft", str(write_random_draft(tmp_path_factory.mktemp("draft25"), text))]
    model = ["--model", str(hf25_dir)]
    pp = [*model, *NODE, "--pp-size", "2"]
    started: list[Node] = []
    try:
        started += start_all([["prefill", *pp, "--pp-rank", "1"], ["decode", *model, *NODE],
                              ["prefill", *model, *NODE, *draft],
                              ["decode", *model, *NODE, *draft, "--num-draft-tokens", "3"]])
        last, d, ep, ed = started
        started += start_all([["prefill", *pp, "--pp-rank", "0", "--pp-next", last.address]])
        first = started[-1]
        router = ["router", *model, "--port", "0"]
        started += start_all([[*router, "--prefill", first.address, "--decode", d.address],
                              [*router, "--colocated", d.address],
                              [*router, "--prefill", ep.address, "--decode", ed.address]])
        names = ("pipeline", "colocated", "eagle")
        yield {**dict(zip(names, started[-3:], strict=True)), "first": first, "last": last,
               "decode": d, "eagle_prefill": ep, "eagle_decode": ed}
    finally:
        stop_all(started)


@pytest.mark.parametrize("path", ["pipeline", "colocated", "eagle"])
def test_streams_equal_transformers(path: str, nodes: dict[str, Node], hf25_model) -> None:  # noqa: ANN001
    streams = stream_all(nodes[path])
    for name, msgs in zip(NAMES, streams, strict=True):
        assert [t for m in msgs for t in m.token_ids] == list(reference_tokens(name, hf25_model)), \
            (path, name)
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == NEW_TOKENS
        assert msgs[-1].usage.prompt_tokens == len(cases()[name].token_ids or [])
        if path == "eagle":
            assert msgs[-1].usage.drafted_tokens > 0
    assert_all_idle([n.address for n in nodes.values()])
