"""Serving latency and throughput, disaggregated (1 prefill + 1 decode) vs colocated, in one run.

    python -m bench.serving [--model DIR] [--requests 64] [--concurrency 32] [--prompt-len 256]
                            [--long-prompt-len 2048] [--long-requests 4] [--new 64] [--json]

Starts both clusters as subprocesses on loopback (``pdserve prefill`` + ``pdserve decode`` +
``pdserve router --prefill --decode``; ``pdserve decode`` + ``pdserve router --colocated``, by
:mod:`bench.clusters`), each process with ``OMP_NUM_THREADS=1``, all on the same
model (a fresh tiny model unless ``--model``).
Both routers get the same requests (random token ids, greedy, ``ignore_eos``, exactly ``--new``
tokens each) through the public gRPC API:

* load phase: ``--requests`` requests of ``--prompt-len`` tokens, ``--concurrency`` streams at a
  time: TTFT, ITL and end-to-end latency (mean, p50, p90, p99) and output tokens/s;
* long-prompt phase: ``--long-requests`` requests of ``--long-prompt-len`` tokens, one at a time:
  TTFT.

ITL is per token: each message's gap since the previous message divided by the tokens it carries
(one sample per token). Every process started here is stopped on exit, errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import loadgen
from bench.clusters import (
    Processes,
    engine_flags,
    start_colocated,
    start_disaggregated,
)

ITL_METHOD = "per token: message gap / tokens in the message"
MODES = ("disaggregated", "colocated")


def start_clusters(procs: Processes, model_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    """Start both clusters; the router address of each mode."""
    engine = engine_flags(model_dir, page_size=args.page_size, num_pages=args.num_pages,
                          max_num_seqs=max(64, args.concurrency),
                          max_num_batched_tokens=args.max_num_batched_tokens)
    return {"disaggregated": start_disaggregated(procs, model_dir, engine).address,
            "colocated": start_colocated(procs, model_dir, engine).address}


# ---- load --------------------------------------------------------------------------------------


def make_prompts(count: int, length: int, vocab: int, seed: int,
                 new: int) -> list[loadgen.Workload]:
    """``count`` random prompts of exactly ``length`` ordinary token ids."""
    return loadgen.random_workloads(count, length, new, vocab, seed, spread=0.0)


def traces_of(address: str, works: list[loadgen.Workload], concurrency: int
              ) -> tuple[list[loadgen.Trace], float]:
    """Send ``works`` (after one warm-up request); raise if any failed."""
    asyncio.run(loadgen.run(address, works[:1], max_concurrency=1))  # warm-up
    traces, wall = asyncio.run(loadgen.run(address, works, max_concurrency=concurrency))
    failed = [t.error for t in traces if not t.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return traces, wall


def measure(address: str, load_prompts: list[loadgen.Workload],
            long_prompts: list[loadgen.Workload],
            args: argparse.Namespace) -> tuple[dict[str, object], list[list[int]]]:
    """Both phases against one router: the figures and the load phase's output ids."""
    traces, wall = traces_of(address, load_prompts, args.concurrency)
    long_traces, _ = traces_of(address, long_prompts, 1)
    tokens = sum(len(t.token_ids) for t in traces)
    result: dict[str, object] = {
        "ttft_ms": loadgen.summary_ms([t.ttft for t in traces]),
        "itl_ms": loadgen.summary_ms([x for t in traces for x in t.itl()]),
        "e2e_ms": loadgen.summary_ms([t.e2e for t in traces]),
        "output_tok_s": round(tokens / wall, 1),
        "wall_s": round(wall, 3),
        "long_prompt_ttft_ms": loadgen.summary_ms([t.ttft for t in long_traces]),
    }
    return result, [t.token_ids for t in traces]


# ---- report ------------------------------------------------------------------------------------


def print_table(report: dict[str, object]) -> None:
    cfg = report["config"]
    assert isinstance(cfg, dict)
    print(f"model {cfg['model']}: {cfg['requests']} requests x {cfg['prompt_len']} prompt tokens "
          f"-> {cfg['new']} new tokens at concurrency {cfg['concurrency']}; "
          f"{cfg['long_requests']} sequential {cfg['long_prompt_len']}-token prompts")
    print(f"ITL: {ITL_METHOD}; times in ms")
    head = f"{'mode':<14} {'metric':<16} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"
    print(head)
    print("-" * len(head))
    for mode in MODES:
        res = report[mode]
        assert isinstance(res, dict)
        for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end"),
                           ("long_prompt_ttft_ms", f"TTFT {cfg['long_prompt_len']}-tok")):
            s = res[key]
            print(f"{mode:<14} {label:<16} {s['mean']:>9.2f} {s['p50']:>9.2f} "
                  f"{s['p90']:>9.2f} {s['p99']:>9.2f}")
        print(f"{mode:<14} {'output tok/s':<16} {res['output_tok_s']:>9.1f}")
    ratios = report["ratios"]
    assert isinstance(ratios, dict)
    print(f"disaggregated / colocated: TTFT at {cfg['long_prompt_len']}-token prompts "
          f"(mean) {ratios['long_prompt_ttft_mean']:.3f}, "
          f"(p50) {ratios['long_prompt_ttft_p50']:.3f}; "
          f"output tok/s at {cfg['concurrency']} streams {ratios['output_tok_s']:.3f}")
    print(f"outputs equal between the clusters: {report['outputs_equal']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: a fresh tiny model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--long-prompt-len", type=int, default=2048)
    p.add_argument("--long-requests", type=int, default=4,
                   help="sequential long-prompt requests for the TTFT ratio")
    p.add_argument("--long-new", type=int, default=4, help="new tokens of each long request")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if min(args.requests, args.concurrency, args.prompt_len, args.long_prompt_len,
           args.new, args.long_new) < 1 or args.long_requests < 0:
        p.error("counts and lengths must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    procs = Processes()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.model:
                model_dir = Path(args.model)
            else:
                from engine.builtin.tiny_model import write_tiny_model

                model_dir = write_tiny_model(Path(tmp) / "tiny")
            config = json.loads((model_dir / "config.json").read_text())
            vocab = int((config.get("text_config") or config)["vocab_size"])
            routers = start_clusters(procs, model_dir, args)
            load_prompts = make_prompts(args.requests, args.prompt_len, vocab, args.seed,
                                        args.new)
            long_prompts = make_prompts(args.long_requests, args.long_prompt_len, vocab,
                                        args.seed + 1, args.long_new)
            report: dict[str, object] = {"config": {
                "model": str(args.model or "tiny (fresh)"), "requests": args.requests,
                "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                "long_prompt_len": args.long_prompt_len, "long_requests": args.long_requests,
                "new": args.new, "itl": ITL_METHOD}}
            outputs = {}
            for mode in MODES:
                report[mode], outputs[mode] = measure(routers[mode], load_prompts,
                                                      long_prompts, args)
        finally:
            procs.stop_all()
    dis, col = report["disaggregated"], report["colocated"]
    assert isinstance(dis, dict) and isinstance(col, dict)
    report["ratios"] = {
        "long_prompt_ttft_mean": round(dis["long_prompt_ttft_ms"]["mean"]
                                       / col["long_prompt_ttft_ms"]["mean"], 3),
        "long_prompt_ttft_p50": round(dis["long_prompt_ttft_ms"]["p50"]
                                      / col["long_prompt_ttft_ms"]["p50"], 3),
        "output_tok_s": round(dis["output_tok_s"] / col["output_tok_s"], 3),
    }
    report["outputs_equal"] = outputs["disaggregated"] == outputs["colocated"]
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
