"""The shipped hybrid sibling (``engine/builtin/tiny-qwen3_5``, ``--model builtin:hybrid``): a
trained tiny Qwen3.5-shaped model whose trained MTP head drafts tokens the target accepts. With
``--draft mtp`` at K = 3 on held-out prompts its output is plain decoding's, token for token, at
two tokens or more per verify round; the command line resolves ``builtin`` aliases (before a
launch hands the directory to its workers) and refuses an unknown one in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import launch
from cli.main import main
from cli.models import ensure_model
from decode_node.spec.eagle_engine import EagleEngine
from engine.builtin import builtin_hybrid_model_dir, builtin_model_dir
from engine.builtin.stdlib_corpus import heldout_prompts
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.mtp import MtpDraft
from engine.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[3]
K = 3
MIN_TOKENS_PER_ROUND = 2.0
GREEDY = SamplingParams(max_new_tokens=64, ignore_eos=True)  # as TRAINING.md's eval


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = builtin_hybrid_model_dir()
    assert (path / "config.json").is_file(), f"{path}: the trained hybrid model is missing"
    return path


def test_the_sibling_is_a_hybrid_with_an_mtp_module(model_dir: Path) -> None:
    text = ModelConfig.from_dir(model_dir).text
    assert text.is_hybrid and text.mtp_num_hidden_layers == 1
    assert {"linear_attention", "full_attention"} == set(text.layer_types)
    assert (model_dir / "tokenizer.json").read_bytes() == \
        (builtin_model_dir() / "tokenizer.json").read_bytes()  # the same vocabulary


def test_mtp_at_k3_on_heldout_prompts_equals_plain_and_accepts(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    prompts = [Prompt(token_ids=ids) for ids in heldout_prompts(tok.encode)]  # all 16
    plain_engine = LLMEngine(model_dir, EngineConfig(num_pages=1024, page_size=16))
    plain = plain_engine.generate(prompts, GREEDY)
    engine = LLMEngine(model_dir, EngineConfig(num_pages=1024, page_size=16, lookahead_tokens=K),
                       draft="mtp")
    draft = engine.load_draft()
    assert isinstance(draft, MtpDraft)
    spec = EagleEngine(engine, draft, K)
    got = spec.generate(prompts, GREEDY)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    st = spec.stats
    print(f"K={K}: {st.rounds} rounds, drafted {st.drafted}, accepted {st.accepted}, "
          f"{st.acceptance_length:.2f} tokens per round")
    assert st.drafted == K * st.rounds
    assert st.acceptance_length == (st.accepted + st.rounds) / st.rounds
    assert st.acceptance_length >= MIN_TOKENS_PER_ROUND
    for done in (plain_engine, engine):
        done.scheduler.check_no_leaks()  # pages, batch rows and state slots all back


def test_builtin_aliases_name_the_shipped_directories(model_dir: Path) -> None:
    assert ensure_model("builtin:hybrid") == model_dir
    assert ensure_model("builtin") == ensure_model("builtin:qwen2-vl") == builtin_model_dir()
    assert ensure_model("./builtin") == Path("builtin")  # a directory of that name


def test_launch_hands_its_workers_the_resolved_directory(model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray workers get the shipped directory itself (and ``--draft mtp`` beside it), never the
    alias: the launch stops where it would start them."""
    from deploy import ray_launcher

    launched: list[ray_launcher.LaunchOptions] = []

    def capture(opts: ray_launcher.LaunchOptions) -> None:
        launched.append(opts)
        raise RuntimeError("stopped before the workers start")

    monkeypatch.setattr(launch, "_choose_ray", lambda opts: False)
    monkeypatch.setattr(launch, "_interrupt_on_sigterm", lambda: None)
    monkeypatch.setattr(launch, "_leave_ray", lambda started, name: None)
    monkeypatch.setattr(ray_launcher, "connect", lambda address: None)
    monkeypatch.setattr(ray_launcher, "launch", capture)
    assert main(["launch", "--model", "builtin:hybrid", "--draft", "mtp"]) == 1
    [opts] = launched
    assert (opts.model, opts.draft) == (str(model_dir), "mtp")


def test_generate_with_builtin_hybrid_and_mtp_prints_an_answer(tmp_path: Path) -> None:
    script = shutil.which("pdserve", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "cli.main"]
    env = dict(os.environ, PDSERVE_CACHE=str(tmp_path))
    proc = subprocess.run([*command, "generate", "--model", "builtin:hybrid", "--draft", "mtp",
                           "def fibonacci(n):", "--max-new-tokens", "24", "--ignore-eos"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    answer, summary = proc.stdout.strip().rsplit("\n", 1)
    assert answer.strip()
    assert "24 tokens" in summary and "EAGLE:" in summary and "tokens per round" in summary


def test_an_unknown_builtin_name_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "builtin:xyz", "hi"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: unknown built-in model 'builtin:xyz': expected builtin or one of "
                   "builtin:qwen2-vl, builtin:hybrid\n")
