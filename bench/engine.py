"""Engine throughput against a peer on the same checkpoint and prompts, in one run.

    python -m bench.engine [--model DIR|qwen2-0.5b|qwen3.5-0.65b] [--peer transformers|vllm]
        [--batch-sizes 1,8,32] [--prompt-len 128] [--new 64] [--device cpu]
        [--dtype float32[,bfloat16]] [--bandwidth] [--phases] [--rounds 1] [--json]

Prints decode tokens/s (batch x new tokens / wall time of one ``generate`` call over fresh
prompts, after a warm-up call over other prompts, so the timed call's prefill is computed, not
found in a prefix cache) of pdserve and of the peer, and their ratio, per dtype and batch size.
Both see the same random prompts of exactly ``--prompt-len`` tokens and produce exactly
``--new`` tokens, greedy; ``same`` says whether the first prompt's tokens agree. The peers:

- ``transformers``: its ``generate`` in this interpreter; beside it the engine's host time per
  decode step (``host ms``: step wall time minus the model's forward and LM head,
  :mod:`bench.host_time`);
- ``vllm``: vLLM's offline ``LLM.generate`` in its own environment (:mod:`bench.peers.vllm_peer`,
  created on first use), on the checkpoint's decoder as a ``Qwen2ForCausalLM``, or a
  ``Qwen3_5ForCausalLM`` for a Qwen3.5 one (:func:`bench.checkpoints.text_only_view`: a text
  prompt's mrope is plain rope).

``--model qwen2-0.5b`` writes (once, under ``~/.cache/pdserve/bench``) a random checkpoint of
Qwen2-0.5B's decoder shape, ``--model qwen3.5-0.65b`` one of the small Qwen3.5 models' hybrid
text shape (:mod:`bench.checkpoints`); without ``--model`` a fresh tiny model.
``--phases`` (with ``--peer vllm``) adds each side's prefill apart: a one-token call over other
fresh prompts (``prefill_s``, and its rate over the projections' and head's FLOPs,
``prefill_gflop_s``, :mod:`bench.roofline`), the timed call's mean decode step once that prefill
is taken off (``decode_ms``), and, on a CPU, what one large product of the checkpoint's widest
shape reaches (``gemm_gflop_s``): the ceiling a prefill is read against.
``--rounds N`` runs both sides N times, alternating, and keeps each one's best (on a shared
machine whose memory bandwidth drifts, one slow spell then costs a round, not the ratio).
``--bandwidth`` adds, per dtype, the batch-1 decode step's weight bandwidth against a plain
streaming read of as many bytes (:mod:`bench.weight_bandwidth`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.checkpoints import shape_names, shaped_or_dir, text_only_view
from bench.host_time import measure_host_time
from bench.random_prompts import prompts
from engine.builtin.tiny_model import write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.device import dtype_name, resolve_device, resolve_dtype
from engine.llm_engine import LLMEngine, Prompt

WARMUP_SEED = 1  # the timed prompts are seed 0's
PREFILL_SEED = 2  # the prompts of --phases' one-token calls
STATE_SLOTS = 64


def _engine(model_dir: Path, device: str, dtype: str) -> LLMEngine:
    # a hybrid model's state slots: one per row of the largest batch (32), not per max_num_seqs
    # (a Qwen3.5-0.65b slot is 19 MiB in float32)
    return LLMEngine(model_dir, EngineConfig(num_pages=2048, page_size=16, max_num_seqs=256,
                                             max_num_batched_tokens=4096, device=device,
                                             dtype=dtype, state_slots=STATE_SLOTS))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_ours(engine: LLMEngine, warm: list[list[int]], ids: list[list[int]],
             new: int) -> tuple[float, list[int]]:
    """tok/s of one generate call over ``ids`` after one over ``warm``; the first prompt's
    tokens."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate([Prompt(token_ids=p) for p in warm], params)  # warm-up (and graph capture)
    _sync(engine.device)
    start = time.perf_counter()
    results = engine.generate([Prompt(token_ids=p) for p in ids], params)
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results)
    return len(ids) * new / elapsed, list(results[0].token_ids)


def prefill_seconds(engine: LLMEngine, ids: list[list[int]]) -> float:
    """Wall time of a generate call over ``ids`` that makes one token: the prefill and the
    first sample."""
    _sync(engine.device)
    start = time.perf_counter()
    engine.generate([Prompt(token_ids=p) for p in ids],
                    SamplingParams(max_new_tokens=1, ignore_eos=True))
    _sync(engine.device)
    return time.perf_counter() - start


def phase_columns(prefix: str, batch: int, args: argparse.Namespace, tok_s: float,
                  prefill_s: float, flops: int) -> dict[str, float]:
    """``--phases``' figures of one side: the prefill's seconds and GFLOP/s, and the mean
    decode step of the timed call once its prefill (taken as ``prefill_s``) is subtracted."""
    whole = batch * args.new / tok_s
    return {f"{prefix}prefill_s": round(prefill_s, 2),
            f"{prefix}prefill_gflop_s": round(flops / prefill_s / 1e9),
            f"{prefix}decode_ms": round((whole - prefill_s) / (args.new - 1) * 1000, 1)}


def run_transformers(model_dir: Path, warm: list[list[int]], ids: list[list[int]], new: int,
                     device: torch.device, dtype: torch.dtype) -> tuple[float, list[int]]:
    import transformers

    # the checkpoint's own class (Qwen2-VL or Qwen3.5), as its config names it
    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=dtype).eval()
    model.to(device)
    kwargs = {"max_new_tokens": new, "eos_token_id": None, "do_sample": False,
              "pad_token_id": 0}
    with torch.inference_mode():
        first = torch.tensor(warm[:1], device=device)
        model.generate(input_ids=first, attention_mask=torch.ones_like(first), **kwargs)
        batch = torch.tensor(ids, device=device)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == batch.shape[1] + new
    return len(ids) * new / elapsed, out[0, batch.shape[1]:].tolist()


def model_dir_of(arg: str | None, tmp: Path) -> Path:
    """``--model``: a directory, a shape name of :func:`bench.checkpoints.shape_names` (written
    once under :data:`bench.checkpoints.CACHE`) or none (a fresh tiny model in ``tmp``)."""
    if arg is None:
        return write_tiny_model(tmp / "tiny")
    return shaped_or_dir(arg)


Result = tuple[float, list[int]]  # tok/s and the first prompt's tokens


def _keep_best(best: dict[int, Result], batch: int, got: Result) -> None:
    if batch not in best or got[0] > best[batch][0]:
        best[batch] = got


def rows_for_dtype(args: argparse.Namespace, model_dir: Path, device: torch.device,
                   dtype: torch.dtype, vocab: int, tmp: Path) -> list[dict[str, Any]]:
    """One row per batch size: the best of ``args.rounds`` rounds of each side, the rounds
    alternating between the peer and pdserve (a slow spell of the machine spoils one round of
    one side, not the comparison)."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    timed = prompts(max(sizes), args.prompt_len, vocab)
    warm = prompts(max(sizes), args.prompt_len, vocab, seed=WARMUP_SEED)
    once = prompts(max(sizes), args.prompt_len, vocab, seed=PREFILL_SEED) if args.phases else []
    peer: dict[int, Result] = {}
    ours: dict[int, Result] = {}
    prefill: dict[tuple[str, int], float] = {}  # (side, batch) -> the best prefill seconds
    flops: dict[int, int] = {}
    extra: dict[int, dict[str, Any]] = {bs: {} for bs in sizes}
    text_dir = None
    peer_error = None  # why the peer cannot run this checkpoint in this dtype
    for round_ in range(args.rounds):
        if args.peer == "vllm" and peer_error is None:
            from bench.peers import vllm_peer

            if text_dir is None:
                text_dir = text_only_view(model_dir, tmp / f"text-{dtype_name(dtype)}")
            try:
                got = vllm_peer.generate(text_dir, warm, timed, args.new, dtype_name(dtype),
                                         sizes, cuda=device.type == "cuda",
                                         prefill_prompts=once)
            except vllm_peer.PeerFailed as e:
                print(f"vLLM does not run {model_dir.name} in {dtype_name(dtype)}: {e.cause}",
                      flush=True)
                peer_error = e.cause
                got = {"rows": []}
            for r in got["rows"]:
                _keep_best(peer, r["batch"], (r["tok_s"], got["tokens"]))
                if args.phases:
                    key = ("peer", r["batch"])
                    prefill[key] = min(prefill.get(key, float("inf")), r["prefill_s"])
        for bs in sizes:
            engine = _engine(model_dir, str(device), dtype_name(dtype))
            _keep_best(ours, bs, run_ours(engine, warm[:bs], timed[:bs], args.new))
            if args.phases:
                from bench.roofline import prefill_flops

                flops[bs] = prefill_flops(engine, bs, args.prompt_len)
                prefill[("ours", bs)] = min(prefill.get(("ours", bs), float("inf")),
                                            prefill_seconds(engine, once[:bs]))
            if round_ == 0 and args.peer == "transformers":
                extra[bs]["host_ms"] = round(
                    measure_host_time(engine, timed[:bs], args.new).host_ms, 3)
            if round_ == 0 and args.bandwidth and bs == sizes[0]:
                from bench.weight_bandwidth import measure

                bw = measure(engine, args.prompt_len, args.new, vocab)
                extra[bs].update(step_ms=round(bw.step_ms, 1), step_gb_s=round(bw.step_gb_s, 1),
                                 stream_gb_s=round(bw.stream_gb_s, 1),
                                 bandwidth=round(bw.ratio, 2))
            del engine
            if args.peer == "transformers":
                _keep_best(peer, bs, run_transformers(model_dir, warm[:bs], timed[:bs],
                                                      args.new, device, dtype))
    rows = []
    for bs in sizes:
        mine, tokens = ours[bs]
        row: dict[str, Any] = {"dtype": dtype_name(dtype), "batch": bs,
                               "pdserve_tok_s": round(mine, 1), **extra[bs]}
        if peer_error is not None:  # the peer's columns stay empty, the reason beside them
            row["peer_error"] = peer_error
            rows.append(row)
            continue
        theirs, their_tokens = peer[bs]
        row.update(peer_tok_s=round(theirs, 1), ratio=round(mine / theirs, 2))
        if bs == sizes[0]:
            row["same"] = tokens == their_tokens
        if args.phases:
            row.update(phase_columns("", bs, args, mine, prefill[("ours", bs)], flops[bs]))
            row.update(phase_columns("peer_", bs, args, theirs, prefill[("peer", bs)],
                                     flops[bs]))
            if bs == sizes[0] and device.type == "cpu":
                from bench.roofline import gemm_gflop_s

                text = json.loads((model_dir / "config.json").read_text())
                text = text.get("text_config", text)
                row["gemm_gflop_s"] = round(gemm_gflop_s(
                    2 * text["intermediate_size"], text["hidden_size"], dtype))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory or a shape: "
                        f"{', '.join(shape_names())} (default: a fresh tiny model)")
    parser.add_argument("--peer", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--dtype", default="float32",
                        help="auto, float32, bfloat16 or float16, or several, comma-separated")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also the batch-1 decode step's share of the memory bandwidth")
    parser.add_argument("--phases", action="store_true",
                        help="also each side's prefill and decode step apart (--peer vllm)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of both sides, alternating; the best of each is kept")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.phases and (args.peer != "vllm" or args.new < 2):
        parser.error("--phases needs --peer vllm and --new of at least 2")
    device = resolve_device(args.device)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_of(args.model, Path(tmp))
        raw = json.loads((model_dir / "config.json").read_text())
        vocab = (raw.get("text_config") or raw)["vocab_size"]
        for name in args.dtype.split(","):
            dtype = resolve_dtype(name, device)
            rows += rows_for_dtype(args, model_dir, device, dtype, vocab, Path(tmp))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"peer: {args.peer}; model: {args.model or 'tiny'}; prompt {args.prompt_len}, "
          f"{args.new} new tokens")
    cols = ["dtype", "batch", "pdserve_tok_s", "peer_tok_s", "ratio", "same", "host_ms",
            "step_ms", "step_gb_s", "stream_gb_s", "bandwidth", "prefill_s", "peer_prefill_s",
            "prefill_gflop_s", "peer_prefill_gflop_s", "gemm_gflop_s", "decode_ms",
            "peer_decode_ms", "peer_error"]
    cols = [c for c in cols if any(c in r for r in rows)]
    print(" ".join(f"{c:>{max(13, len(c))}}" for c in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(c, '')):>{max(13, len(c))}}" for c in cols))


if __name__ == "__main__":
    main()
