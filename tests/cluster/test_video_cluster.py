"""Videos end to end: real ``pdserve`` processes, a 1P1D router and a colocated router on one
prefill and one decode worker, compared token for token with the in-process engine.

The prompts: a text prompt with a video given as encoded frames (the router decodes them), token
ids with a video and an image given as patches (one placeholder each, expanded by the router),
and text with a video placeholder between an image and more text. The prefill runs 16-token
chunks, so vision tokens span chunk borders. Last, ``pdserve client`` sends a frames video and a
patches video through its ``--video-*`` flags.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import GenerationResult, LLMEngine, Prompt
from engine.multimodal.inputs import ImageInput, VideoInput
from engine.multimodal.mrope import num_image_tokens
from engine.multimodal.video_processor import VideoProcessorConfig, process_video
from proto.convert import patches_message
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import ROOT, Node
from tests.cluster.stats import assert_all_idle
from tests.cluster.test_cluster import (
    IMAGE_PAD,
    MERGE,
    SPECIAL,
    VISION_END,
    VISION_START,
    assert_same,
    patches,
    png,
    start_all,
    stop_all,
)

pytestmark = pytest.mark.slow

PAGE_SIZE = 8
CHUNK = 16
VIDEO_PAD = SPECIAL["video_token_id"]
NEW_TOKENS = 6


def _video(frames: list[bytes], fps: float, model_dir: Path) -> VideoInput:
    out = process_video(frames, VideoProcessorConfig.from_dir(model_dir), fps=fps)
    return VideoInput(torch.from_numpy(out.patches), out.grid_thw, out.second_per_grid)


def _cases(model_dir: Path) -> list[tuple[gpb.GenerateRequest, Prompt]]:
    frames = [png(56, 84, seed=s) for s in range(3)]
    sampling = gpb.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    text = "what moves in this clip"
    frames_case = (
        gpb.GenerateRequest(text=text, sampling=sampling, videos=[gpb.Video(
            frames=gpb.VideoFrames(frames=frames, fps=1.0))]),
        Prompt(text=text, videos=[_video(frames, 1.0, model_dir)]))
    v_array, v_grid = patches(7, (2, 4, 6))
    i_array, i_grid = patches(8, (1, 4, 4))
    head, mid, tail = [5, 6, VISION_START], [VISION_END, 9, VISION_START], [VISION_END, 11, 12]
    ids = [*head, VIDEO_PAD, *mid, IMAGE_PAD, *tail]
    expanded = [*head, *[VIDEO_PAD] * num_image_tokens(v_grid, MERGE), *mid,
                *[IMAGE_PAD] * num_image_tokens(i_grid, MERGE), *tail]
    patches_case = (
        gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=ids), sampling=sampling,
            images=[gpb.Image(patches=patches_message(i_array, i_grid))],
            videos=[gpb.Video(patches=patches_message(v_array, v_grid), second_per_grid=0.5)]),
        Prompt(token_ids=expanded,
               images=[ImageInput(torch.from_numpy(i_array.copy()), i_grid)],
               videos=[VideoInput(torch.from_numpy(v_array.copy()), v_grid, 0.5)]))
    image = png(84, 56, seed=4)
    mixed = "look <|vision_start|><|image_pad|><|vision_end|> then " \
            "<|vision_start|><|video_pad|><|vision_end|> and say"
    mixed_case = (
        gpb.GenerateRequest(text=mixed, sampling=sampling, images=[gpb.Image(encoded=image)],
                            videos=[gpb.Video(frames=gpb.VideoFrames(frames=frames[:2]))]),
        Prompt(text=mixed, images=[image], videos=[_video(frames[:2], 2.0, model_dir)]))
    return [frames_case, patches_case, mixed_case]


@pytest.fixture(scope="module")
def routers(tiny_dir: Path) -> Iterator[dict[str, Node]]:
    model = ["--model", str(tiny_dir), "--port", "0", "--page-size", str(PAGE_SIZE),
             "--num-pages", "256"]
    workers = start_all([["prefill", *model, "--max-num-batched-tokens", str(CHUNK)],
                         ["decode", *model, "--max-num-batched-tokens", str(CHUNK)]])
    nodes: list[Node] = []
    try:
        p, d = workers
        base = ["router", "--model", str(tiny_dir), "--port", "0"]
        nodes = start_all([[*base, "--prefill", p.address, "--decode", d.address],
                           [*base, "--colocated", d.address]])
        yield {"1p1d": nodes[0], "colocated": nodes[1], "prefill": p, "decode": d}
    finally:
        stop_all([*nodes, *workers])  # all at once: nothing is in flight by now


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_dir, EngineConfig(num_pages=256, page_size=PAGE_SIZE,
                                            max_num_batched_tokens=CHUNK))


def _generate(engine: LLMEngine, prompts: list[Prompt]) -> list[GenerationResult]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return engine.generate(prompts, [params] * len(prompts))


@pytest.mark.parametrize("topology", ["1p1d", "colocated"])
def test_video_prompts_equal_engine(
    routers: dict[str, Node], engine: LLMEngine, tiny_dir: Path, topology: str
) -> None:
    cases = _cases(tiny_dir)
    expected = _generate(engine, [prompt for _, prompt in cases])
    with grpc.insecure_channel(routers[topology].address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(lambda c: list(stub.Generate(c[0], timeout=60)), cases))
    for i, (msgs, exp) in enumerate(zip(results, expected, strict=True)):
        assert_same(msgs, exp, f"{topology} case {i}")
    assert_all_idle([n.address for n in routers.values()])


def test_client_video_flags(
    routers: dict[str, Node], engine: LLMEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    frames = [png(56, 56, seed=s) for s in (1, 2)]
    paths = []
    for k, data in enumerate(frames):
        paths.append(tmp_path / f"f{k}.png")
        paths[-1].write_bytes(data)
    array, grid = patches(3, (1, 4, 4))
    np.save(tmp_path / "v.npy", array)
    cmd = [sys.executable, "-m", "cli.main", "client", "--target", routers["1p1d"].address,
           "--video-frames", ",".join(str(p) for p in paths), "--video-fps", "4",
           "--video-patches", str(tmp_path / "v.npy"), "--video-grid", "1,4,4",
           "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json", "compare these"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    videos = [_video(frames, 4.0, tiny_dir), VideoInput(torch.from_numpy(array), grid, 1.0)]
    (exp,) = _generate(engine, [Prompt(text="compare these", videos=videos)])
    assert got["token_ids"] == exp.token_ids
    assert got["usage"]["prompt_tokens"] == len(exp.prompt_token_ids)
