"""The router serves the checkpoint's chat template: ``GetModelInfo`` reports it, and the HTTP
door renders chat messages (text, images, videos) with it exactly as transformers'
``apply_chat_template`` does. In process: the door runs on aiohttp's test server over a service
that records the ``GenerateRequest`` it is given (no workers)."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.text.chat import CHATML_TEMPLATE
from engine.text.chat_template import BUILTIN_SOURCE
from proto.pdserve.v1 import generate_pb2 as gpb
from router.config import RouterConfig
from router.http_door import HttpDoor
from router.openai_request import BadRequest, chat_prompt
from router.preprocess import ModelAssets
from router.service import GenerationService
from router.workers import WorkerPool
from tests.engine.text.test_chat_template import BUILTIN, QWEN2_VL_STYLE, oracle

FRAMES = [b"\x89PNG frame one", b"\x89PNG frame two"]
IMAGE = b"\xff\xd8 a jpeg"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model's files (no weights) with a Qwen2-VL-style chat template."""
    path = tmp_path_factory.mktemp("door") / "ckpt"
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "preprocessor_config.json",
                 "generation_config.json"):
        shutil.copy(BUILTIN / name, path / name)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": QWEN2_VL_STYLE}))
    return path


class RecordingService:
    """What the door uses of :class:`GenerationService`: ``assets`` and ``generate``."""

    def __init__(self, assets: ModelAssets) -> None:
        self.assets = assets
        self.requests: list[gpb.GenerateRequest] = []

    async def generate(self, req: gpb.GenerateRequest,
                       deadline_s: float | None = None) -> AsyncGenerator[gpb.GenerateResponse]:
        self.requests.append(req)
        yield gpb.GenerateResponse(request_id=req.request_id, token_ids=[5], text="ok",
                                   finished=True, finish_reason="stop",
                                   usage=gpb.Usage(prompt_tokens=3, completion_tokens=1))


def post_chat(service: RecordingService, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    door = HttpDoor(cast(GenerationService, service), "m")

    async def call() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(door.app)) as client:
            resp = await client.post("/v1/chat/completions", json=body)
            return resp.status, await resp.json()

    return asyncio.run(call())


def test_model_info_reports_the_template(model_dir: Path) -> None:
    for path, text, source, special in (
            (model_dir, QWEN2_VL_STYLE, "tokenizer_config.json", {"eos_token": "<|im_end|>"}),
            (BUILTIN, CHATML_TEMPLATE, BUILTIN_SOURCE, {})):
        config = RouterConfig(path, colocated=("127.0.0.1:1",))
        service = GenerationService(config, ModelAssets.from_dir(path), cast(WorkerPool, None))
        info = asyncio.run(service.GetModelInfo(gpb.GetModelInfoRequest(), cast(Any, None)))
        assert (info.chat_template, info.chat_template_source) == (text, source)
        assert dict(info.chat_special_tokens) == special


def test_the_door_renders_the_checkpoint_template(model_dir: Path) -> None:
    service = RecordingService(ModelAssets.from_dir(model_dir))
    messages = [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(IMAGE, "image/jpeg")}},
            {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": "a cat", "name": None},
        {"role": "user", "content": [
            {"type": "text", "text": "and here?"},
            {"type": "video", "video": [data_url(f) for f in FRAMES], "fps": 2}]}]
    status, reply = post_chat(service, {"messages": messages, "max_tokens": 4})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == "ok"
    [req] = service.requests
    template_view: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": [{"type": "text", "text": "and here?"}, {"type": "video"}]}]
    assert req.text == oracle(model_dir, template_view)
    assert req.text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert [im.encoded for im in req.images] == [IMAGE]
    [video] = req.videos
    assert list(video.frames.frames) == FRAMES and video.frames.fps == 2.0


def test_the_door_refuses_what_the_template_refuses(model_dir: Path) -> None:
    service = RecordingService(ModelAssets.from_dir(model_dir))
    status, reply = post_chat(service, {"messages": [{"role": "robot", "content": "beep"}]})
    assert status == 400
    assert "unknown role: robot" in reply["error"]["message"]
    assert not service.requests


def test_video_parts_are_checked() -> None:
    for part, word in (({"type": "video", "video": []}, "non-empty list"),
                       ({"type": "video", "video": "x"}, "non-empty list"),
                       ({"type": "video", "video": [data_url(b"x")], "fps": 0}, "'fps'"),
                       ({"type": "video", "video": ["https://x/y.png"]}, r"video\[0\]")):
        with pytest.raises(BadRequest, match=word):
            chat_prompt([{"role": "user", "content": [part]}])
    chat = chat_prompt([{"role": "user", "content": [
        {"type": "video", "video": [data_url(b"x")]}]}])
    assert chat.videos[0].frames.fps == 0.0  # unset: the video processor's default
