"""A hybrid model's prefix cache (KV pages plus linear-attention state checkpoints), on against
off, in one run: prompts sharing 90% of their tokens.

    python -m bench.hybrid_prefix_cache [--prompt-len 1024] [--shared 0.9] [--requests 8]
        [--new-tokens 8] [--interval 256] [--threads N] [--tiny] [--json]

The checkpoint is :mod:`bench.qwen3_5_generate`'s random Qwen3.5 (the small published shape, or
``--tiny``), float32 on the CPU. Every prompt is one shared prefix of ``shared * prompt_len``
random tokens followed by its own random tokens. Per engine (cache on, cache off; the same
settings otherwise, ``--interval`` tokens between state checkpoints):

* ``miss_ttft_s``: the first request's time to its first token, cache empty (with the cache on
  its prefill chunks end at every checkpoint boundary, the price of the checkpoints);
* ``ttft_p50_s``: the median time to first token of ``--requests`` further requests, one at a
  time (with the cache on each resumes at the last checkpoint inside the shared prefix);
* ``requests_per_s``: ``--requests`` new requests submitted together, run to ``--new-tokens``
  tokens each, over the wall time.

Outputs must be equal on and off (greedy); ``state_checkpoint_bytes`` is the memory one
checkpoint takes (one state slot: every linear layer's conv and recurrent state).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.qwen3_5_generate import write_checkpoint
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt

PAGE_SIZE = 16


def make_prompts(n: int, length: int, shared: float, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens whose first ``shared * length`` are the same."""
    gen = torch.Generator().manual_seed(seed)
    common = int(length * shared)
    prefix = torch.randint(0, vocab - 8, (common,), generator=gen).tolist()
    return [prefix + torch.randint(0, vocab - 8, (length - common,), generator=gen).tolist()
            for _ in range(n)]


def ttft(engine: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Seconds from queueing ``ids`` to its first token, then the request run to its end."""
    start = time.perf_counter()
    req = engine.add_request(ids, sampling=params)
    while not req.output_token_ids:
        engine.step()
    first = time.perf_counter() - start
    while engine.scheduler.has_unfinished():
        engine.step()
    return first, list(req.output_token_ids)


def measure(engine: LLMEngine, warm: list[int], singles: list[list[int]],
            batch: list[list[int]], new: int) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    miss, first_out = ttft(engine, warm, params)
    runs = [ttft(engine, ids, params) for ids in singles]
    start = time.perf_counter()
    results = engine.generate([Prompt(token_ids=ids) for ids in batch], params)
    elapsed = time.perf_counter() - start
    engine.scheduler.check_no_leaks()
    stats = engine.stats()
    return {"miss_ttft_s": miss, "ttft_p50_s": statistics.median(t for t, _ in runs),
            "requests_per_s": len(batch) / elapsed,
            "hit_tokens": int(stats.get("prefix_cache_hit_tokens", 0)),
            "state_checkpoint_bytes": int(stats.get("state_checkpoint_bytes", 0)),
            "outputs": [first_out, *(o for _, o in runs), *(r.token_ids for r in results)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared", type=float, default=0.9)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--interval", type=int, default=256, help="tokens between checkpoints")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="a 4-layer toy shape (smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(1 + 2 * args.requests, args.prompt_len, args.shared, args.vocab, 0)
    warm, singles, batch = prompts[0], prompts[1 : 1 + args.requests], prompts[1 + args.requests:]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3_5"
        write_checkpoint(model_dir, args.vocab, args.tiny)
        report: dict[str, Any] = {"prompt_len": args.prompt_len, "shared": args.shared,
                                  "requests": args.requests, "interval": args.interval}
        for name, on in (("off", False), ("on", True)):
            config = EngineConfig(page_size=PAGE_SIZE, num_pages=4096,
                                  max_num_batched_tokens=2048, enable_prefix_cache=on,
                                  state_checkpoint_interval=args.interval)
            engine = LLMEngine(model_dir, config)
            report[name] = measure(engine, warm, singles, batch, args.new_tokens)
            del engine
    on, off = report["on"], report["off"]
    report["same_outputs"] = on.pop("outputs") == off.pop("outputs")
    report["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    report["requests_per_s_ratio"] = on["requests_per_s"] / off["requests_per_s"]
    report["miss_ttft_ratio"] = on["miss_ttft_s"] / off["miss_ttft_s"]
    if args.json:
        print(json.dumps(report))
        return
    print(f"prompt {args.prompt_len} tokens, {args.shared:.0%} shared, checkpoints every "
          f"{args.interval}; one checkpoint {on['state_checkpoint_bytes'] / 2**20:.2f} MiB")
    print(f"{'':6}{'miss TTFT s':>13}{'TTFT p50 s':>12}{'req/s':>9}{'hit tokens':>12}")
    for name in ("off", "on"):
        r = report[name]
        print(f"{name:6}{r['miss_ttft_s']:13.3f}{r['ttft_p50_s']:12.3f}"
              f"{r['requests_per_s']:9.2f}{r['hit_tokens']:12d}")
    print(f"on/off: TTFT p50 {report['ttft_p50_speedup']:.2f}x faster, request rate "
          f"{report['requests_per_s_ratio']:.2f}x, miss TTFT {report['miss_ttft_ratio']:.2f}x; "
          f"same outputs: {report['same_outputs']}")


if __name__ == "__main__":
    main()
