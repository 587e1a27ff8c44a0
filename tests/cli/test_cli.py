"""The ``pdserve`` console script, run as a real subprocess: ``make-tiny-model`` and ``generate``
(token ids, precomputed patches, PNG images, JSON output, bfloat16 on the CPU), and one-line
errors with exit code 2 (bad input, devices this machine cannot run), unexpected errors as one
line too, and ``--debug`` showing the traceback."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.builtin.tiny_model import TINY_EAGLE3_LAYERS
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.eagle.loader import load_draft
from engine.multimodal.inputs import ImageInput
from engine.text.chat import chat_prompt

REPO = Path(__file__).resolve().parents[2]
PATCH_DIM = 3 * 2 * 14 * 14


def pdserve_command() -> list[str]:
    """The installed entry point next to this interpreter, else ``python -m cli.main``."""
    script = shutil.which("pdserve", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "cli.main"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdserve-cache")


def pdserve(cache_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PDSERVE_CACHE=str(cache_dir))
    return subprocess.run([*pdserve_command(), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model_dir(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny"
    out = ok(pdserve(cache_dir, "make-tiny-model", str(path)))
    assert str(path) in out
    return path


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(num_pages=64))


@pytest.fixture(scope="module")
def special(model_dir: Path) -> dict[str, int]:
    raw = json.loads((model_dir / "config.json").read_text())
    return {k: raw[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}


def in_process(engine: LLMEngine, prompts: list[Prompt], n: int) -> list[list[int]]:
    results = engine.generate(prompts, SamplingParams(max_new_tokens=n))
    engine.scheduler.check_no_leaks()
    return [r.token_ids for r in results]


def test_make_tiny_model_writes_the_tiny_checkpoint(model_dir: Path, tiny_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "generation_config.json"):
        assert (model_dir / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_generate_token_ids_json(model_dir: Path, cache_dir: Path, engine: LLMEngine) -> None:
    out = ok(pdserve(cache_dir, "generate", "--model", str(model_dir), "--token-ids", "1,2,3",
                     "--token-ids", "4,5", "--json", "--max-new-tokens", "5"))
    rows = json_lines(out)
    assert len(rows) == 2
    for row in rows:
        assert len(row["token_ids"]) == 5
        assert isinstance(row["text"], str)
    assert [r["prompt_token_ids"] for r in rows] == [[1, 2, 3], [4, 5]]
    want = in_process(engine, [Prompt(token_ids=[1, 2, 3]), Prompt(token_ids=[4, 5])], 5)
    assert [r["token_ids"] for r in rows] == want
    assert rows[0]["text"] == engine.tokenizer.decode(want[0])  # type: ignore[union-attr]


def test_generate_with_image_patches(
    model_dir: Path, cache_dir: Path, engine: LLMEngine, special: dict[str, int],
    tmp_path: Path,
) -> None:
    patches = np.random.default_rng(0).standard_normal((16, PATCH_DIM)).astype(np.float32)
    np.save(tmp_path / "patches.npy", patches)
    ids = [7, special["vision_start_token_id"], *[special["image_token_id"]] * 4,
           special["vision_end_token_id"], 8, 9]
    out = ok(pdserve(cache_dir, "generate", "--model", str(model_dir),
                     "--token-ids", ",".join(map(str, ids)),
                     "--image-patches", str(tmp_path / "patches.npy"), "--image-grid", "1,4,4",
                     "--json", "--max-new-tokens", "6"))
    [row] = json_lines(out)
    assert len(row["token_ids"]) == 6
    image = ImageInput(torch.from_numpy(patches), (1, 4, 4))
    [want] = in_process(engine, [Prompt(token_ids=ids, images=[image])], 6)
    assert row["token_ids"] == want


def test_generate_with_png_and_text(
    model_dir: Path, cache_dir: Path, engine: LLMEngine, tmp_path: Path
) -> None:
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    (tmp_path / "img.png").write_bytes(buf.getvalue())
    prompt = "Describe this picture."
    out = ok(pdserve(cache_dir, "generate", "--model", str(model_dir), prompt,
                     "--image", str(tmp_path / "img.png"), "--json", "--max-new-tokens", "5"))
    [row] = json_lines(out)
    assert len(row["token_ids"]) == 5
    assert isinstance(row["text"], str)
    image_id = engine.model_config.image_token_id
    assert image_id in row["prompt_token_ids"]
    [want] = in_process(engine, [Prompt(text=prompt, images=[buf.getvalue()])], 5)
    assert row["token_ids"] == want


def test_generate_without_model_uses_the_builtin_model(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = ok(pdserve(cache, "generate", "import os\n", "--json", "--max-new-tokens", "8"))
    [row] = json_lines(out)
    assert len(row["token_ids"]) == 8 and row["text"]
    assert not cache.exists()  # the shipped model is used in place: nothing written


@pytest.mark.parametrize("shape", [("4", "1"), ("6", "2")], ids=["chain", "tree"])
def test_generate_with_a_draft_equals_plain_and_reports_its_rounds(
        tmp_path: Path, shape: tuple[str, str]) -> None:
    builtin = REPO / "engine" / "builtin" / "tiny-qwen2-vl"
    prompts = ["def heappop(heap):\n", "import os\n"]
    args = [*prompts, "--json", "--max-new-tokens", "24", "--ignore-eos", "--temperature", "0"]
    plain = json_lines(ok(pdserve(tmp_path, "generate", *args)))
    spec = json_lines(ok(pdserve(tmp_path, "generate", *args, "--draft", str(builtin / "draft"),
                                 "--num-draft-tokens", shape[0], "--draft-topk", shape[1])))
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    for row in spec:  # the bonus token and the accepted drafts of every round, the first token
        assert row["accepted_tokens"] > 0 and row["drafted_tokens"] == int(shape[0]) * row[
            "rounds"]
        assert row["accepted_tokens"] + row["rounds"] + 1 >= 24
    line = ok(pdserve(tmp_path, "generate", prompts[0], "--max-new-tokens", "8", "--draft",
                      str(builtin / "draft"))).splitlines()[-1]
    assert "tokens per round]" in line, line
    bad = pdserve(tmp_path, "generate", "hi", "--draft", str(builtin / "draft"),
                  "--num-draft-tokens", "0")
    assert bad.returncode == 2 and "--num-draft-tokens must be at least 1" in bad.stderr


def test_generate_chat_wraps_the_prompt_in_the_chat_format(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = ok(pdserve(cache, "generate", "--chat", "Write a function.", "--json",
                     "--max-new-tokens", "4"))
    [row] = json_lines(out)
    builtin = REPO / "engine" / "builtin" / "tiny-qwen2-vl"
    engine = LLMEngine(builtin, EngineConfig(num_pages=64, page_size=16))
    want_ids = engine.prepare(Prompt(text=chat_prompt("Write a function."))).token_ids
    assert row["prompt_token_ids"] == want_ids
    start, end = (engine.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert want_ids.count(start) == 2 and want_ids.count(end) == 1  # single special ids
    [got] = in_process(engine, [Prompt(text=chat_prompt("Write a function."))], 4)
    assert row["token_ids"] == got


def assert_one_line_error(proc: subprocess.CompletedProcess[str], word: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert word in lines[0], lines[0]


@pytest.mark.parametrize(("env", "flags", "word"), [
    ({"PDSERVE_FAULT_TRANSFER_FAIL_P": "abc"}, [], "PDSERVE_FAULT_TRANSFER_FAIL_P"),
    ({}, ["--fault-drop-handshake-p", "2"], "drop_handshake_p"),
])
def test_bad_fault_settings_are_a_one_line_error(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  env: dict[str, str], flags: list[str],
                                                  word: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert_one_line_error(pdserve(cache_dir, "decode", "--port", "0", *flags), word)


def test_empty_token_ids_is_a_one_line_error(model_dir: Path, cache_dir: Path) -> None:
    proc = pdserve(cache_dir, "generate", "--model", str(model_dir), "--token-ids", "")
    assert_one_line_error(proc, "empty")


def test_missing_image_file_is_a_one_line_error(
    model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nope.png"
    proc = pdserve(cache_dir, "generate", "--model", str(model_dir), "hello",
                   "--image", str(missing))
    assert_one_line_error(proc, "nope.png")


def test_non_qwen2_vl_model_is_a_one_line_error(
    model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "llama"
    shutil.copytree(model_dir, other)
    raw = json.loads((other / "config.json").read_text())
    raw["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(raw))
    proc = pdserve(cache_dir, "generate", "--model", str(other), "--token-ids", "1,2")
    assert_one_line_error(proc, "llama")


def test_mismatched_image_grid_is_a_one_line_error(
    model_dir: Path, cache_dir: Path, special: dict[str, int], tmp_path: Path
) -> None:
    np.save(tmp_path / "p.npy", np.zeros((16, PATCH_DIM), dtype=np.float32))
    ids = [1, special["vision_start_token_id"], *[special["image_token_id"]] * 3,
           special["vision_end_token_id"]]
    proc = pdserve(cache_dir, "generate", "--model", str(model_dir),
                   "--token-ids", ",".join(map(str, ids)),
                   "--image-patches", str(tmp_path / "p.npy"), "--image-grid", "1,4,4")
    assert_one_line_error(proc, "image")


def test_config_json_that_is_a_list_is_a_one_line_error(
    model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "broken"
    shutil.copytree(model_dir, other)
    (other / "config.json").write_text("[]")
    proc = pdserve(cache_dir, "generate", "--model", str(other), "--token-ids", "1,2")
    assert_one_line_error(proc, "config")


def test_generate_bfloat16_on_the_cpu_equals_the_in_process_engine(tmp_path: Path) -> None:
    out = ok(pdserve(tmp_path / "cache", "generate", "--device", "cpu", "--dtype", "bfloat16",
                     "--token-ids", "1,2,3", "--json", "--max-new-tokens", "6", "--ignore-eos"))
    [row] = json_lines(out)
    builtin = REPO / "engine" / "builtin" / "tiny-qwen2-vl"
    engine = LLMEngine(builtin, EngineConfig(num_pages=64, dtype="bfloat16"))
    assert engine.model.dtype == torch.bfloat16
    [want] = engine.generate([Prompt(token_ids=[1, 2, 3])],
                             SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert row["token_ids"] == want.token_ids and row["logprobs"] == want.logprobs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error(cache_dir: Path) -> None:
    proc = pdserve(cache_dir, "generate", "--device", "cuda", "--token-ids", "1,2")
    assert_one_line_error(proc, "--device cuda: ")
    assert ("install a CUDA build of torch" in proc.stderr) == (torch.version.cuda is None)


def test_device_npu_without_torch_npu_is_a_one_line_error(cache_dir: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    proc = pdserve(cache_dir, "generate", "--device", "npu", "--token-ids", "1,2")
    assert_one_line_error(proc, "install torch_npu")


@pytest.mark.parametrize("command", [["decode", "--port", "0"], ["launch", "--port", "0"]])
def test_unknown_device_is_a_one_line_error_on_servers_and_launch(cache_dir: Path,
                                                                   command: list[str]) -> None:
    """(generate: the tests above; prefill builds its config like decode.)"""
    proc = pdserve(cache_dir, *command, "--device", "tpu")
    assert_one_line_error(proc, "choose one of auto, cpu, cuda, npu")


def test_make_tiny_model_writes_an_eagle3_draft(cache_dir: Path, tmp_path: Path) -> None:
    """``--with-eagle3-draft`` writes a draft ``--draft`` recognises as EAGLE-3 by its config
    (tests/cluster/test_eagle3_cluster.py and test_eagle_tp_cluster.py serve it)."""
    path = tmp_path / "tiny"
    assert "EAGLE-3 draft" in ok(pdserve(cache_dir, "make-tiny-model", str(path),
                                         "--with-eagle3-draft"))
    draft = load_draft(path / "draft", ModelConfig.from_dir(path).text, torch.float32)
    assert isinstance(draft, Eagle3Draft) and draft.cfg.aux_layer_ids == TINY_EAGLE3_LAYERS


def test_draft_on_a_pipeline_stage_before_the_last_is_a_one_line_error(cache_dir: Path) -> None:
    """Only the last stage runs the EAGLE draft (tests/cluster/test_eagle_cluster.py runs it
    there)."""
    proc = pdserve(cache_dir, "prefill", "--port", "0", "--pp-size", "3", "--pp-rank", "1",
                   "--pp-next", "127.0.0.1:1", "--draft", "draft-dir")
    assert_one_line_error(proc, "--draft goes to the last pipeline stage only")


@pytest.mark.parametrize(("command", "flags", "word"), [
    (["decode", "--port", "0"], ["--draft-topk", "0"], "--draft-topk must be at least 1"),
    (["decode", "--port", "0"], ["--num-draft-tokens", "11", "--draft-topk", "2",
                                 "--draft-steps", "3"], "exceeds the 10 candidates"),
    (["launch"], ["--draft-steps", "0"], "--draft-steps must be at least 1"),
])
def test_bad_draft_tree_flags_are_a_one_line_error(cache_dir: Path, command: list[str],
                                                   flags: list[str], word: str) -> None:
    assert_one_line_error(pdserve(cache_dir, *command, *flags), word)


def test_debug_shows_the_traceback(cache_dir: Path) -> None:
    assert_one_line_error(pdserve(cache_dir, "launch", "--name", "a/b"), "--name 'a/b'")
    proc = pdserve(cache_dir, "--debug", "launch", "--name", "a/b")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "InvalidRequestError: --name 'a/b'" in proc.stderr


@pytest.mark.parametrize(("exc", "line", "status"), [
    (RuntimeError("ray::ServerActor.address()\n  File x\nRuntimeError: gone"),
     "error: RuntimeError: gone", 1),
    (ValueError("bad\n value"), "error: bad value", 2),
    (subprocess.CalledProcessError(1, ["ray", "start"], stderr=b"noise\nport 6379 taken\n"),
     "error: `ray start` exited with status 1: port 6379 taken", 1),
    (KeyError(), "error: KeyError", 1),
    (KeyboardInterrupt(), "error: interrupted", 130),
])
def test_unexpected_errors_are_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exc: BaseException,
    line: str, status: int,
) -> None:
    import cli.main

    def fail(args: object) -> int:
        raise exc

    monkeypatch.setattr(cli.main, "COMMANDS", (("fail", "always fails", None, fail),))
    assert cli.main.main(["fail"]) == status
    assert capsys.readouterr().err == line + "\n"
    with pytest.raises(type(exc)):
        cli.main.main(["--debug", "fail"])


def test_generate_with_video_patches(
    model_dir: Path, cache_dir: Path, engine: LLMEngine, special: dict[str, int],
    tmp_path: Path,
) -> None:
    from engine.multimodal.inputs import VideoInput

    patches = np.random.default_rng(1).standard_normal((32, PATCH_DIM)).astype(np.float32)
    np.save(tmp_path / "video.npy", patches)
    video_id = engine.model_config.video_token_id
    ids = [7, special["vision_start_token_id"], *[video_id] * 8,
           special["vision_end_token_id"], 8, 9]
    out = ok(pdserve(cache_dir, "generate", "--model", str(model_dir),
                     "--token-ids", ",".join(map(str, ids)),
                     "--video-patches", str(tmp_path / "video.npy"), "--video-grid", "2,4,4",
                     "--video-second-per-grid", "0.5", "--json", "--max-new-tokens", "6"))
    [row] = json_lines(out)
    video = VideoInput(torch.from_numpy(patches), (2, 4, 4), 0.5)
    [want] = in_process(engine, [Prompt(token_ids=ids, videos=[video])], 6)
    assert row["token_ids"] == want


def test_the_command_line_is_built_without_heavy_libraries() -> None:
    """``pdserve``'s parsers (every subcommand's) import no torch, gRPC, protobuf code, Ray or
    HTTP client: each subcommand imports what it needs when it runs, so ``pdserve generate``
    on a machine without the serving stack (a lent GPU node) starts, and ``--help`` is quick."""
    heavy = ("torch", "grpc", "grpc_health", "grpc_tools", "proto", "google", "ray", "aiohttp",
             "prometheus_client", "transformers")
    code = ("import sys; from cli.main import build_parser; build_parser(); "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert out.strip() == "[]"
