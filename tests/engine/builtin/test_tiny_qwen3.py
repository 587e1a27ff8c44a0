"""The tiny Qwen3-VL and Qwen3.5 checkpoints (``engine/builtin/tiny_qwen3.py``, ``pdserve
make-tiny-model --arch``): our engine loads each and answers text and image prompts;
transformers loads the same directory with no missing or unexpected weight and its greedy
continuation equals ours; the same seed writes the same bytes; the command line writes them,
refuses a bad ``--arch`` (a real ``python -m cli.main``) and a draft for them in one error line,
and leaves nothing of an earlier run for another arch behind."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from cli.main import main
from engine.builtin.tiny_qwen3 import QWEN3_ARCHS, write_tiny_qwen3_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, PreparedPrompt, Prompt

REPO = Path(__file__).resolve().parents[3]
NEW_TOKENS = 10
HF_CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_5": "Qwen3_5ForConditionalGeneration"}
FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
         "preprocessor_config.json", "video_preprocessor_config.json")


def png(height: int = 64, width: int = 96) -> bytes:
    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


PROMPTS = {"text": Prompt(text="def add(a, b):\n    return"),
           "image": Prompt(text="What is in the picture?", images=[png()])}


@pytest.fixture(scope="module", params=QWEN3_ARCHS)
def arch_dir(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = str(request.param)
    return arch, write_tiny_qwen3_model(tmp_path_factory.mktemp(arch) / "model", arch)


@pytest.fixture(scope="module")
def engine(arch_dir: tuple[str, Path]) -> LLMEngine:
    return LLMEngine(arch_dir[1], EngineConfig(num_pages=64))


def greedy(engine: LLMEngine, prompts: list[Prompt]) -> list[list[int]]:
    results = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                      ignore_eos=True))
    engine.scheduler.check_no_leaks()
    return [r.token_ids for r in results]


def test_our_engine_answers_text_and_image_prompts(arch_dir: tuple[str, Path],
                                                   engine: LLMEngine) -> None:
    arch, _ = arch_dir
    assert engine.model_config.model_type == arch
    image = engine.prepare(PROMPTS["image"])
    assert image.images[0].grid_thw == (1, 4, 6)  # 64 x 96 px in 16-px patches
    assert image.token_ids.count(engine.model_config.image_token_id) == 6
    for ids in greedy(engine, list(PROMPTS.values())):
        assert len(ids) == NEW_TOKENS
        assert len(set(ids)) >= 4, ids  # not one token repeated


def hf_greedy(hf_model: Any, prompt: PreparedPrompt, image_token: int) -> list[int]:
    ids = torch.tensor([prompt.token_ids])
    kwargs: dict[str, torch.Tensor] = {}
    if prompt.images:
        kwargs = {"pixel_values": torch.cat([im.patches for im in prompt.images]),
                  "image_grid_thw": torch.tensor([im.grid_thw for im in prompt.images]),
                  "mm_token_type_ids": (ids == image_token).int()}
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def test_transformers_loads_it_and_decodes_as_we_do(arch_dir: tuple[str, Path],
                                                    engine: LLMEngine) -> None:
    import transformers

    arch, path = arch_dir
    model_cls = getattr(transformers, HF_CLASSES[arch])
    hf_model, info = model_cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    prepared = [engine.prepare(p) for p in PROMPTS.values()]
    image_token = engine.model_config.image_token_id
    want = [hf_greedy(hf_model.eval(), p, image_token) for p in prepared]
    assert greedy(engine, [Prompt(token_ids=p.token_ids, images=p.images)
                           for p in prepared]) == want


@pytest.mark.parametrize("arch", QWEN3_ARCHS)
def test_the_same_seed_writes_the_same_bytes(arch: str, tmp_path: Path) -> None:
    a, b, c = (write_tiny_qwen3_model(tmp_path / name, arch, seed=seed)
               for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_the_command_line_writes_a_qwen3_5_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "tiny35"
    assert main(["make-tiny-model", str(target), "--arch", "qwen3_5"]) == 0
    assert capsys.readouterr().out == f"wrote tiny Qwen3.5 checkpoint to {target}\n"
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)
    raw = json.loads((target / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert raw["text_config"]["model_type"] == "qwen3_5_text"


def test_a_bad_arch_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "cli.main", "make-tiny-model",
                           str(tmp_path / "x"), "--arch", "llama"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: pdserve make-tiny-model: argument --arch: invalid choice")
    assert not (tmp_path / "x").exists()


def test_a_draft_for_a_qwen3_arch_is_refused_before_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t"
    assert main(["make-tiny-model", str(target), "--arch", "qwen3_vl", "--with-draft"]) == 2
    assert capsys.readouterr().err == ("error: --with-draft writes a draft for --arch qwen2_vl "
                                       "only, not qwen3_vl\n")
    assert not target.exists()


def test_another_arch_over_an_earlier_run_leaves_nothing_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen3-VL model over an earlier run's Qwen2-VL draft (the draft goes), then a Qwen2-VL
    one over it (the Qwen3 video processor settings go)."""
    target = tmp_path / "t"
    (target / "draft").mkdir(parents=True)
    (target / "draft" / "config.json").write_text("{}")
    assert main(["make-tiny-model", str(target), "--arch", "qwen3_vl"]) == 0
    assert not (target / "draft").exists()
    assert main(["make-tiny-model", str(target)]) == 0
    assert not (target / "video_preprocessor_config.json").exists()
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2_vl"
