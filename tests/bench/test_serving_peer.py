"""``python -m bench.serving_peer``: the pieces that run without vLLM's environment.

vLLM's server and its serving benchmark live in an environment of their own that only the
benchmark creates (minutes of installing), so no test starts them; what a test can hold is
checked here: a real colocated pdserve target started the benchmark's way answers the OpenAI
API it is measured through, the word-level tokenizer round-trips, bench checkpoints written
before it get it, and the arguments, checks and ratios are what the module says."""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from bench import checkpoints
from bench.clusters import Processes
from bench.serving_peer import (
    MIN_REQUESTS,
    Checkpoint,
    Load,
    bench_args,
    checked,
    model_dir_of,
    parse_args,
    start_target,
    table,
)
from engine.builtin.tiny_model import TINY_VOCAB
from engine.builtin.tiny_tokenizer import build_tiny_tokenizer

LOAD = Load(input_len=16, output_len=4, concurrency=(1, 8), requests_per_stream=2)
TINY_MODEL = Path(__file__).resolve().parents[2] / "engine" / "builtin" / "tiny-qwen2-vl"


def test_word_tokenizer_round_trips_every_id_through_text() -> None:
    tok = checkpoints.word_tokenizer(1000, {510: "<|image|>"})
    ids = [random.Random(0).randrange(1000) for _ in range(200)]
    text = tok.decode(ids, skip_special_tokens=False)
    assert tok.encode(text).ids == ids
    assert [tok.decode([i]) for i in (0, 1, 999)] == ["w0", "w1", "w999"]
    assert tok.encode("w1 w510 <|image|>").ids == [1, 0, 510]  # only the name is the image


def test_shaped_checkpoint_written_before_gets_the_word_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 700}
    monkeypatch.setitem(checkpoints.SHAPES, "small", shape)
    path = checkpoints.write_shaped(tmp_path / "small", "small")
    config = json.loads((path / "config.json").read_text())
    special = checkpoints.special_tokens(config)
    assert set(special) == {config["image_token_id"], config["video_token_id"],
                            config["vision_start_token_id"], config["vision_end_token_id"]}
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == 700
    assert tok.decode(sorted(special)) == ""  # special: dropped from text by default
    build_tiny_tokenizer(TINY_VOCAB).save(str(path / "tokenizer.json"))  # an older cache
    weights = (path / "model.safetensors").stat().st_mtime_ns
    checkpoints.write_shaped(path, "small")
    assert Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size() == 700
    assert (path / "model.safetensors").stat().st_mtime_ns == weights  # weights kept
    alone = checkpoints.tokenizer_only(path, tmp_path / "tokenizer")
    assert sorted(p.name for p in alone.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (alone / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    tok_config = json.loads((alone / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert sorted(tok_config["additional_special_tokens"]) == sorted(special.values())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def test_colocated_target_serves_the_openai_api_it_is_measured_through(tmp_path: Path) -> None:
    procs = Processes()
    try:
        ckpt = Checkpoint(TINY_MODEL, TINY_MODEL, TINY_MODEL, "tiny")
        url = start_target(procs, "colocated", ckpt, "float32", 8)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny"]
        out = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": "def main",
                                              "max_tokens": 4, "temperature": 0,
                                              "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 4
        assert out["choices"][0]["text"]
        worker, router = procs.procs
        assert worker.popen.poll() is None and router.http_port is not None
    finally:
        procs.stop_all()
    assert all(p.popen.poll() is not None for p in [worker, router])


def test_bench_args_carry_the_load_for_every_level() -> None:
    args = bench_args("http://127.0.0.1:9", "m", Path("/tok"), LOAD, 8)
    flags = dict(zip(args, args[1:], strict=False))  # each flag -> what follows it
    assert flags["--base-url"] == "http://127.0.0.1:9"
    assert flags["--num-prompts"] == "16" and flags["--max-concurrency"] == "8"
    assert flags["--random-input-len"] == "16" and flags["--random-output-len"] == "4"
    assert flags["--tokenizer"] == "/tok" and "--ignore-eos" in args
    assert LOAD.requests(1) == MIN_REQUESTS


def _result(tok_s: float, itl: float, completed: int = 16, output: int = 64) -> dict[str, Any]:
    return {"completed": completed, "failed": 0, "total_output_tokens": output,
            "output_throughput": tok_s, "p50_ttft_ms": 1.0, "p99_ttft_ms": 2.0,
            "p50_tpot_ms": 3.0, "p50_itl_ms": itl, "p99_itl_ms": 5.0}


def test_a_level_with_a_failed_or_short_request_is_an_error() -> None:
    assert checked(_result(1.0, 1.0), "t", LOAD, 8)["completed"] == 16
    with pytest.raises(RuntimeError, match="15 of 16 requests"):
        checked(_result(1.0, 1.0, completed=15), "t", LOAD, 8)
    with pytest.raises(RuntimeError, match="63 output tokens, expected 64"):
        checked(_result(1.0, 1.0, output=63), "t", LOAD, 8)


def test_table_prints_pdserves_ratios_against_vllm() -> None:
    results = {"vllm": {1: _result(10.0, 100.0), 8: _result(40.0, 120.0)},
               "colocated": {1: _result(12.0, 80.0), 8: _result(30.0, 150.0)}}
    text = table(results, LOAD)
    assert "colocated / vllm at 1 streams: output tok/s 1.20x, ITL p50 1.25x" in text
    assert "colocated / vllm at 8 streams: output tok/s 0.75x, ITL p50 0.80x" in text


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "1,x"], "comma-separated integers"),
    (["--concurrency", "0"], "positive integers"),
    (["--targets", "vllm,sglang"], "--targets"),
    (["--output-len", "0"], "--output-len must be at least 1"),
])
def test_bad_arguments_are_refused_by_name(argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_model_that_is_neither_a_shape_nor_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a shape"):
        model_dir_of(str(tmp_path))
