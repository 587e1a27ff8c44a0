"""``bench.engine`` and its pieces: the text-only view a peer loads, the bytes a decode step
reads, the FLOPs a prefill costs, the vLLM peer's environment, and a whole run against
transformers on the tiny model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench.checkpoints import QWEN2_05B_TEXT, config_dict, text_only_view
from bench.engine import phase_columns
from bench.peers import vllm_peer
from bench.roofline import gemm_gflop_s, prefill_flops
from bench.weight_bandwidth import decode_weight_bytes
from engine.builtin.tiny_model import write_tiny_model
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from tests.cluster.harness import ROOT


def test_the_text_only_view_is_the_same_decoder_to_transformers(tmp_path: Path) -> None:
    """transformers' Qwen2ForCausalLM over the view gives the Qwen2-VL model's logits on a
    text prompt (mrope with three equal axes is plain rope)."""
    transformers = pytest.importorskip("transformers")
    src = write_tiny_model(tmp_path / "vl")
    view = text_only_view(src, tmp_path / "text")
    assert json.loads((view / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"]
    with safe_open(str(view / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith("visual.") for k in f.keys())
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    text = transformers.Qwen2ForCausalLM.from_pretrained(view).eval()
    full = transformers.Qwen2VLForConditionalGeneration.from_pretrained(src).eval()
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=ids).logits, full(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_the_benchmark_shape_is_qwen2_half_a_billion() -> None:
    raw = config_dict(QWEN2_05B_TEXT)
    cfg = ModelConfig.from_dict(raw).text
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    params = layers * per_layer + cfg.vocab_size * h + h  # tied head: the embedding once
    assert raw["tie_word_embeddings"] and 0.4e9 < params < 0.5e9


def test_decode_weight_bytes_count_every_decoder_weight_and_the_head(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        want = sum(f.get_tensor(k).numel() * 4 for k in f.keys()
                   if k.startswith("model.layers.") or k == "lm_head.weight")
    engine = LLMEngine(model_dir, EngineConfig(num_pages=16, page_size=16))
    assert decode_weight_bytes(engine) == want


def test_prefill_flops_count_every_projection_per_token_and_the_head_per_prompt(
        tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        layers = sum(f.get_tensor(k).numel() for k in f.keys() if k.startswith("model.layers.")
                     and k.endswith(".weight") and k.split(".")[-2] in projections)
        head = f.get_tensor("lm_head.weight").numel()
    engine = LLMEngine(model_dir, EngineConfig(num_pages=16, page_size=16))
    assert prefill_flops(engine, 3, 10) == 2 * (layers * 3 * 10 + head * 3)


def test_phase_columns_take_the_prefill_off_the_timed_call() -> None:
    args = argparse.Namespace(new=5)
    # 2 prompts x 5 tokens at 4 tok/s: 2.5 s, of which a 0.5 s prefill; 4 steps of 0.5 s
    cols = phase_columns("peer_", 2, args, 4.0, 0.5, 10**9)
    assert cols == {"peer_prefill_s": 0.5, "peer_prefill_gflop_s": 2, "peer_decode_ms": 500.0}


def test_the_gemm_ceiling_is_a_plausible_rate() -> None:
    rate = gemm_gflop_s(256, 128, torch.float32)
    assert 0.1 < rate < 100_000  # GFLOP/s of a real product, not a division by a zero time


def test_the_vllm_environment_binds_every_core_and_preloads_what_exists(tmp_path: Path,
                                                                       monkeypatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_peer.run_env(tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")
    assert all(Path(p).exists() for p in env["LD_PRELOAD"].split(":"))


def test_the_engine_bench_runs_against_transformers() -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--batch-sizes", "1,2", "--prompt-len", "12",
         "--new", "4", "--bandwidth", "--rounds", "2", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[0]["same"] is True  # float32 greedy on the tiny model: the same tokens
    assert rows[0]["stream_gb_s"] > 0 and rows[0]["step_ms"] > 0
    assert all(r["pdserve_tok_s"] > 0 and r["peer_tok_s"] > 0 for r in rows)


@pytest.mark.parametrize(("argv", "error"), [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--phases"], "--phases needs --peer vllm"),
    (["--phases", "--peer", "vllm", "--new", "1"], "--phases needs --peer vllm"),
])
def test_the_engine_bench_refuses_bad_arguments(argv: list[str], error: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.engine", *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and error in proc.stderr
