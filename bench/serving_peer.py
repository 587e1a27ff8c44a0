"""pdserve's OpenAI door against vLLM's OpenAI server, under one load generator, in one run.

    python -m bench.serving_peer [--model qwen2-0.5b|DIR] [--dtype float32]
                                 [--concurrency 1,8,32] [--requests-per-stream 4]
                                 [--input-len 128] [--output-len 64]
                                 [--targets vllm,colocated,disaggregated] [--json]

Each target runs alone on this machine: started, measured at every concurrency, stopped before
the next one starts.

* ``vllm``: vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) in its own environment
  (:mod:`bench.peers.vllm_peer`, which creates it on first use), set up as its CPU docs say;
  it serves the decoder as a ``Qwen2ForCausalLM`` (:func:`bench.checkpoints.text_only_view`).
* ``colocated``: one pdserve decode node that also prefills, with a thread per core, behind a
  router with its HTTP door.
* ``disaggregated``: a pdserve prefill node and a decode node, one thread each (the same cores
  between them), behind a router with its HTTP door.

The load is vLLM's own serving benchmark (what ``vllm bench serve`` runs,
:mod:`bench.peers.vllm_bench_serve`) over ``/v1/completions``, the same for every target: its
random dataset with one seed (prompts of ``--input-len`` random words of the checkpoint's
word-level tokenizer, the same text for every target), exactly ``--output-len`` new tokens each
(``ignore_eos``), greedy, streamed, ``--concurrency`` streams at a time, ``concurrency *
--requests-per-stream`` requests (at least 8) after as many warm-up requests as streams.
Figures are vLLM's: output tokens/s, TTFT, TPOT (time per output token after the first, per
request) and ITL (the gap between streamed chunks), p50 and p99. A level where any request
failed or came back short is an error, not a figure. The ratios printed are pdserve / vLLM for
output tokens/s and vLLM / pdserve for ITL p50 (above 1: pdserve is ahead on both).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.checkpoints import shape_names, shaped_or_dir, text_only_view, tokenizer_only
from bench.clusters import Proc, Processes, engine_flags, start_colocated, start_disaggregated
from bench.peers import vllm_peer

TARGETS = ("vllm", "colocated", "disaggregated")
MIN_REQUESTS = 8
SERVER_READY_S = 900.0  # vLLM's CPU start-up compiles its model step: minutes on 2 cores
# the columns of a level's row, from vLLM's result dict: (heading, key)
FIGURES = (("out tok/s", "output_throughput"), ("TTFT p50 ms", "p50_ttft_ms"),
           ("TTFT p99 ms", "p99_ttft_ms"), ("TPOT p50 ms", "p50_tpot_ms"),
           ("ITL p50 ms", "p50_itl_ms"), ("ITL p99 ms", "p99_itl_ms"))


@dataclass(frozen=True)
class Load:
    """What every target is asked, level by level."""

    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    requests_per_stream: int

    def requests(self, streams: int) -> int:
        return max(MIN_REQUESTS, streams * self.requests_per_stream)


def bench_args(base_url: str, model_name: str, tokenizer: Path, load: Load,
               streams: int) -> list[str]:
    """The serving benchmark's arguments for one level against ``base_url``."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_name, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(load.input_len),
            "--random-output-len", str(load.output_len), "--ignore-eos", "--seed", "0",
            "--temperature", "0", "--num-prompts", str(load.requests(streams)),
            "--max-concurrency", str(streams), "--num-warmups", str(streams),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm"]


def checked(result: dict[str, Any], target: str, load: Load, streams: int) -> dict[str, Any]:
    """``result`` if every request of the level completed with all its tokens; else raise."""
    want = load.requests(streams)
    if result.get("completed") != want or result.get("failed", 0):
        errors = "\n".join(result.get("error_lines", []))
        raise RuntimeError(f"{target} at {streams} streams: {result.get('completed')} of {want} "
                           f"requests completed, {result.get('failed')} failed\n{errors}")
    if result.get("total_output_tokens") != want * load.output_len:
        raise RuntimeError(f"{target} at {streams} streams: {result.get('total_output_tokens')} "
                           f"output tokens, expected {want * load.output_len}")
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(proc: Proc, url: str, timeout_s: float) -> None:
    """Block until ``url`` answers 200; raise with ``proc``'s log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.tail()}")


@dataclass(frozen=True)
class Checkpoint:
    """The measured checkpoint as each side reads it."""

    model_dir: Path  # pdserve's (Qwen2-VL layout)
    text_dir: Path  # vLLM's (the decoder as a Qwen2ForCausalLM)
    tokenizer_dir: Path  # vLLM's and the load generator's tokenizer (the same words)
    name: str  # the model id of every server's API


def start_target(procs: Processes, target: str, ckpt: Checkpoint, dtype: str,
                 max_seqs: int) -> str:
    """Start ``target``; the base URL of its OpenAI API once it is ready."""
    if target == "vllm":
        port = free_port()
        argv, env = vllm_peer.serve_command(ckpt.text_dir, ckpt.tokenizer_dir, ckpt.name, dtype,
                                            port, max_seqs)
        proc = procs.spawn("vllm server", argv, env)
        wait_http(proc, f"http://127.0.0.1:{port}/health", SERVER_READY_S)
        return f"http://127.0.0.1:{port}"
    engine = [*engine_flags(ckpt.model_dir, max_num_seqs=max_seqs, max_num_batched_tokens=2048),
              "--dtype", dtype]
    door = ["--http-port", "0", "--served-model-name", ckpt.name]
    if target == "colocated":
        router = start_colocated(procs, ckpt.model_dir, engine, threads=cores(),
                                 router_flags=door)
    else:
        router = start_disaggregated(procs, ckpt.model_dir, engine, router_flags=door)
    assert router.http_port is not None, "the router printed no HTTP port"
    url = f"http://127.0.0.1:{router.http_port}"
    wait_http(router, f"{url}/health", SERVER_READY_S)
    return url


def cores() -> int:
    """The cores this process may run on (a colocated node's threads)."""
    return len(os.sched_getaffinity(0))


def measure(target: str, ckpt: Checkpoint, dtype: str, load: Load) -> dict[int, dict[str, Any]]:
    """Every level's result for ``target`` (started here and stopped before returning)."""
    procs = Processes()
    try:
        url = start_target(procs, target, ckpt, dtype, max(64, max(load.concurrency)))
        return {c: checked(vllm_peer.bench_serve(
                    bench_args(url, ckpt.name, ckpt.tokenizer_dir, load, c)), target, load, c)
                for c in load.concurrency}
    finally:
        procs.stop_all()


def table(results: dict[str, dict[int, dict[str, Any]]], load: Load) -> str:
    """One row per target and level, then pdserve's ratios against vLLM where both ran."""
    head = f"{'target':<14} {'streams':>7} " + " ".join(f"{h:>12}" for h, _ in FIGURES)
    lines = [head, "-" * len(head)]
    for target, levels in results.items():
        for c in load.concurrency:
            row = levels[c]
            lines.append(f"{target:<14} {c:>7} "
                         + " ".join(f"{float(row[k]):>12.1f}" for _, k in FIGURES))
    peer = results.get("vllm")
    if peer is not None:
        lines.append("")
        for target, levels in results.items():
            if target == "vllm":
                continue
            for c in load.concurrency:
                tok = levels[c]["output_throughput"] / peer[c]["output_throughput"]
                itl = peer[c]["p50_itl_ms"] / max(levels[c]["p50_itl_ms"], 1e-9)
                lines.append(f"{target} / vllm at {c} streams: output tok/s {tok:.2f}x, "
                             f"ITL p50 {itl:.2f}x (vllm's / pdserve's)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2-0.5b",
                        help=f"checkpoint directory or a shape: {', '.join(shape_names())}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        parser.error(f"--concurrency: comma-separated integers, got {args.concurrency!r}")
    if not args.levels or min(args.levels) < 1:
        parser.error(f"--concurrency: positive integers, got {args.concurrency!r}")
    args.target_list = tuple(t for t in args.targets.split(",") if t)
    unknown = sorted(set(args.target_list) - set(TARGETS))
    if unknown or not args.target_list:
        parser.error(f"--targets: some of {', '.join(TARGETS)}, got {args.targets!r}")
    for flag in ("requests_per_stream", "input_len", "output_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def model_dir_of(arg: str) -> Path:
    """:func:`bench.checkpoints.shaped_or_dir`, refusing a directory with no checkpoint."""
    path = shaped_or_dir(arg)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {arg!r}: neither a shape ({', '.join(shape_names())}) nor a "
                         "checkpoint directory with a config.json")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = model_dir_of(args.model)
    load = Load(args.input_len, args.output_len, args.levels, args.requests_per_stream)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-serving-peer-") as tmp:
        text_dir = (text_only_view(model_dir, Path(tmp) / "text")
                    if "vllm" in args.target_list else model_dir)
        ckpt = Checkpoint(model_dir, text_dir, tokenizer_only(model_dir, Path(tmp) / "tokenizer"),
                          model_dir.name)
        for target in args.target_list:
            print(f"measuring {target} ({args.dtype})", file=sys.stderr, flush=True)
            results[target] = measure(target, ckpt, args.dtype, load)
    if args.json:
        print(json.dumps({"dtype": args.dtype, "load": asdict(load), "results": results},
                         default=str))
    else:
        print(f"{model_dir} {args.dtype}, {load.input_len}-token prompts, "
              f"{load.output_len} new tokens each")
        print(table(results, load))


if __name__ == "__main__":
    main()
