"""``bench.engine`` on a Qwen3.5 (hybrid) checkpoint: the text-only view a peer loads, the
cached shape, the run against transformers, and what a peer that cannot run it leaves in the
table (vLLM's CPU build runs Qwen3.5 in bfloat16 only)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from bench import checkpoints
from bench.engine import rows_for_dtype
from bench.peers import vllm_peer
from bench.qwen3_5_generate import write_checkpoint
from tests.cluster.harness import ROOT

VOCAB = 512


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 checkpoint with 2 key heads over 4 value heads (each key head's value
    heads are two: the grouping a Qwen3-Next-style layout would have to get right)."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hybrid") / "ckpt"
    write_checkpoint(path, VOCAB, tiny=True)
    return path


def test_the_hybrid_text_view_is_the_same_decoder_to_transformers(hybrid_dir: Path,
                                                                    tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    view = checkpoints.text_only_view(hybrid_dir, tmp_path / "text")
    config = json.loads((view / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"] is True
    with safe_open(str(view / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith("model.visual.") for k in keys)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8, 9]])
    text = transformers.Qwen3_5ForCausalLM.from_pretrained(view).eval()
    full = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(hybrid_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(text(input_ids=ids).logits, full(input_ids=ids).logits)


def test_a_hybrid_shape_is_written_once_with_a_word_tokenizer(tmp_path: Path,
                                                              monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setitem(checkpoints.HYBRID_SHAPES, "tiny-hybrid", (True, VOCAB))
    path = checkpoints.write_hybrid(tmp_path / "h", "tiny-hybrid")
    assert json.loads((path / "config.json").read_text())["architectures"] == [
        checkpoints.HYBRID_ARCHITECTURE]
    tok = json.loads((path / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == VOCAB
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert checkpoints.write_hybrid(path, "tiny-hybrid") == path
    assert weights.stat().st_mtime_ns == stamp  # the cached one, not drawn again
    assert checkpoints.write_hybrid(path, "tiny-hybrid", seed=1) == path
    assert weights.stat().st_mtime_ns != stamp  # another seed: written anew
    assert "tiny-hybrid" in checkpoints.shape_names()


def test_the_engine_bench_runs_a_hybrid_against_transformers(hybrid_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--model", str(hybrid_dir), "--batch-sizes",
         "1,2", "--prompt-len", "12", "--new", "4", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[0]["same"] is True  # float32 greedy: transformers' Qwen3.5 gives our tokens
    assert all(r["pdserve_tok_s"] > 0 and r["peer_tok_s"] > 0 for r in rows)


# what vLLM's CPU build prints when asked for a Qwen3.5 model in float32 (shortened): a warning
# that carries an exception's name first, the root cause, then the engine's shutdown
VLLM_FLOAT32_OUTPUT = """\
(MainProcess pid=1) WARNING 12-06 19:58:01 [base.py:380] ValueError: Tokenizer not available
(Worker pid=2) ERROR 12-06 19:58:40 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=2) ERROR 12-06 19:58:40 [multiproc_executor.py:1063] AssertionError: CPU GDN \
attention requires BF16.
(EngineCore pid=3) ERROR 12-06 19:58:40 [core.py:1512] RuntimeError: Worker failed with error
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
"""


def test_a_failed_peer_run_names_its_root_cause() -> None:
    proc = subprocess.CompletedProcess(["python"], 1, stdout="", stderr=VLLM_FLOAT32_OUTPUT)
    with pytest.raises(vllm_peer.PeerFailed) as failed:
        vllm_peer._peer_result(proc, "vLLM's run")
    assert failed.value.cause == "AssertionError: CPU GDN attention requires BF16."
    bare = subprocess.CompletedProcess(["python"], 137, stdout="", stderr="Killed\n")
    with pytest.raises(vllm_peer.PeerFailed) as killed:
        vllm_peer._peer_result(bare, "vLLM's run")
    assert killed.value.cause == "exit 137"


def test_a_dtype_the_peer_cannot_run_keeps_pdserves_rows_and_says_why(
        hybrid_dir: Path, tmp_path: Path, monkeypatch) -> None:
    calls = []

    def refuse(*args: object, **kwargs: object) -> dict[str, object]:
        calls.append(args)
        raise vllm_peer.PeerFailed("vLLM's run", subprocess.CompletedProcess(
            ["python"], 1, stdout="", stderr=VLLM_FLOAT32_OUTPUT))

    monkeypatch.setattr(vllm_peer, "generate", refuse)
    args = argparse.Namespace(batch_sizes="1,2", prompt_len=8, new=3, rounds=2, phases=False,
                              peer="vllm", bandwidth=False)
    rows = rows_for_dtype(args, hybrid_dir, torch.device("cpu"), torch.float32, VOCAB, tmp_path)
    assert len(calls) == 1  # the second round does not ask again
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["pdserve_tok_s"] > 0 and "peer_tok_s" not in r and "ratio" not in r
        assert r["peer_error"] == "AssertionError: CPU GDN attention requires BF16."


def test_torchvision_without_its_ops_imports_once_two_fakes_are_guarded(tmp_path: Path) -> None:
    """The two registrations torchvision 0.28 makes unguarded become its guarded form; the
    rest of the file is left as it was, and a second pass changes nothing."""
    source = ('@register_meta("roi_align")\ndef meta_roi_align(): ...\n\n'
              '@torch.library.register_fake("torchvision::nms")\ndef meta_nms(): ...\n\n'
              '@torch.library.register_fake("torchvision::qnms")\ndef meta_qnms(): ...\n\n'
              '@torch.library.register_fake("torchvision::other")\ndef meta_other(): ...\n')
    (tmp_path / "_meta_registrations.py").write_text(source)
    vllm_peer.survive_missing_ops(tmp_path)
    patched = (tmp_path / "_meta_registrations.py").read_text()
    assert '@register_meta("nms")\ndef meta_nms' in patched
    assert '@register_meta("qnms")\ndef meta_qnms' in patched
    assert '@torch.library.register_fake("torchvision::other")' in patched
    assert patched.count("\n") == source.count("\n")
    vllm_peer.survive_missing_ops(tmp_path)
    assert (tmp_path / "_meta_registrations.py").read_text() == patched
