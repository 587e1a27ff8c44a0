"""``--chat`` of ``pdserve generate`` and ``pdserve client`` renders with the checkpoint's chat
template (the client: the one the router reports in ``GetModelInfo``), images first in the user
message; without one, the built-in ChatML. No servers: the client's stub is a stand-in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cli.client import _router_template, build_request
from cli.generate import _chat_texts
from cli.main import build_parser
from engine.text.chat import IMAGE_BLOCK, VIDEO_BLOCK, chat_prompt
from engine.text.chat_template import BUILTIN_SOURCE, ChatTemplate, user_message
from proto.pdserve.v1 import generate_pb2 as gpb
from tests.engine.text.test_chat_template import BUILTIN, QWEN2_VL_STYLE, oracle


class InfoStub:
    """A ``RouterClient`` that only answers ``model_info``."""

    def __init__(self, info: gpb.ModelInfo) -> None:
        self.info = info

    def model_info(self, timeout: float | None) -> gpb.ModelInfo:
        return self.info


def test_client_renders_with_the_router_template(tmp_path: Path) -> None:
    image = tmp_path / "x.png"
    image.write_bytes(b"png")
    args = build_parser().parse_args(["client", "--chat", "what is it?", "--image", str(image)])
    served = _router_template(InfoStub(gpb.ModelInfo(
        chat_template=QWEN2_VL_STYLE, chat_template_source="tokenizer_config.json")), 5.0)
    assert served.text == QWEN2_VL_STYLE
    req = build_request(args, served)
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(BUILTIN / "tokenizer.json", model / "tokenizer.json")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN2_VL_STYLE}))
    assert req.text == oracle(model, [user_message("what is it?", images=1)])
    assert IMAGE_BLOCK + "what is it?<|im_end|>" in req.text
    assert [im.encoded for im in req.images] == [b"png"]

    old_router = _router_template(InfoStub(gpb.ModelInfo()), None)
    assert old_router.source == BUILTIN_SOURCE
    plain = build_parser().parse_args(["client", "--chat", "hi"])
    assert build_request(plain, old_router).text == build_request(plain).text == chat_prompt("hi")

    # the template's special tokens come with it, so the client renders as the router would
    with_bos = _router_template(InfoStub(gpb.ModelInfo(
        chat_template="{{ bos_token }}{{ messages[0]['content'] }}",
        chat_template_source="chat_template.jinja", chat_special_tokens={"bos_token": "<s>"})),
        None)
    assert build_request(plain, with_bos).text == "<s>hi"


def test_generate_renders_with_the_checkpoint_template(tmp_path: Path) -> None:
    shutil.copy(BUILTIN / "tokenizer.json", tmp_path / "tokenizer.json")
    assert _chat_texts(tmp_path, ["a"], images=0, videos=0) == [chat_prompt("a")]
    (tmp_path / "chat_template.jinja").write_text(QWEN2_VL_STYLE)
    want = ChatTemplate(QWEN2_VL_STYLE, "x").render([user_message("b", images=2, videos=1)])
    assert _chat_texts(tmp_path, ["b"], images=2, videos=1) == [want]
    assert want.count(IMAGE_BLOCK) == 2 and want.count(VIDEO_BLOCK) == 1
