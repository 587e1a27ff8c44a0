"""``pdserve client`` against a real router and decode worker (colocated mode)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from tests.cluster.harness import ROOT, Node, _env, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(tiny_dir: Path) -> Iterator[Node]:
    decode = ["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "128"]
    with running(decode) as [d]:
        with running(["router", "--model", str(tiny_dir), "--colocated", d.address,
                      "--port", "0"]) as [r]:
            yield r


def client(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", "client", *args],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)


def test_streams_text_and_prints_json(router: Node, tiny_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(image)
    engine = LLMEngine(tiny_dir, EngineConfig(num_pages=128))
    [text_exp, image_exp] = engine.generate(
        [Prompt(text="once upon a time"),
         Prompt(text="what is this", images=[image.read_bytes()])],
        SamplingParams(max_new_tokens=20))

    out = client("--target", router.address, "once upon a time", "--max-new-tokens", "20")
    assert out.returncode == 0, out.stderr
    assert out.stdout == text_exp.text + "\n"

    out = client("--target", router.address, "what is this", "--image", str(image),
                 "--max-new-tokens", "20", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] == image_exp.token_ids
    assert result["text"] == image_exp.text
    assert result["finish_reason"] == image_exp.finish_reason.value
    assert result["request_id"]
    assert result["usage"]["prompt_tokens"] == len(image_exp.prompt_token_ids)
    assert result["usage"]["completion_tokens"] == len(image_exp.token_ids)

    out = client("--target", router.address, "--token-ids", "1,2,3", "--max-new-tokens", "5",
                 "--json", "--seed", "7", "--temperature", "0.8")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) <= 5


def test_errors_print_one_line_and_exit_2(router: Node) -> None:
    out = client("--target", "127.0.0.1:1", "hello", "--timeout", "10")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: UNAVAILABLE: "), out.stderr

    out = client("--target", router.address, "--token-ids", "1,99999")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: INVALID_ARGUMENT: "), out.stderr
    assert "Traceback" not in out.stderr


def test_several_targets_fail_over(router: Node) -> None:
    """``--target A,B``: a router that is down hands the call (``--chat``'s ``GetModelInfo`` and
    the stream) to the next."""
    out = client("--target", f"127.0.0.1:1, {router.address}", "hello", "--chat",
                 "--max-new-tokens", "5", "--json", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 5

    out = client("--target", " , ", "hello")
    assert out.returncode == 2 and out.stderr.startswith("error: --target names no router"), \
        out.stderr
