"""``pdserve bench``: drive running routers with a workload and report latency and throughput.

    pdserve bench --target HOST:PORT [--target HOST:PORT ...] --num-requests N [--json FILE]

With several targets the same requests go to each in turn and the report adds ratios against
the first target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from deploy import loadgen


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", required=True, metavar="HOST:PORT",
                   help="router address (repeat to compare targets on the same requests)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dataset", default="random",
                   choices=["random", "shared-prefix", "images", "jsonl"])
    p.add_argument("--jsonl", type=Path, help="prompts file for --dataset jsonl")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean new tokens")
    p.add_argument("--vocab", type=int, default=512, help="token ids are drawn below this")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--num-draft-tokens", type=int, default=0,
                   help="the servers' K, to turn accepted/drafted counts into acceptance length")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report")
    p.add_argument("--no-progress", action="store_true")


def workloads(args: argparse.Namespace) -> list[loadgen.Workload]:
    n = args.num_requests
    if args.dataset == "jsonl":
        if args.jsonl is None:
            raise ValueError("--dataset jsonl needs --jsonl FILE")
        return loadgen.jsonl_workloads(args.jsonl, args.output_len)[:n]
    if args.dataset == "shared-prefix":
        half = max(1, args.input_len // 2)
        return loadgen.shared_prefix_workloads(n, half, args.input_len - half, args.output_len,
                                               args.vocab, args.seed)
    if args.dataset == "images":
        return loadgen.image_workloads(n, args.output_len, args.seed)
    return loadgen.random_workloads(n, args.input_len, args.output_len, args.vocab, args.seed)


def run_bench(args: argparse.Namespace) -> int:
    works = workloads(args)
    results: dict[str, dict[str, object]] = {}
    for target in args.target:
        progress = _Progress(target, len(works), enabled=not args.no_progress)
        traces, wall = asyncio.run(loadgen.run(
            target, works, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
            seed=args.seed, on_done=progress.tick))
        progress.close()
        results[target] = loadgen.report(traces, wall, args.num_draft_tokens, args.slo_ttft_ms,
                                         args.slo_tpot_ms)
    out: dict[str, object] = dict(next(iter(results.values())))
    if len(results) > 1:
        base = next(iter(results.values()))
        out = {"targets": results, "ratios_vs_first": {
            t: _ratios(r, base) for t, r in list(results.items())[1:]}}
    text = json.dumps(out, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


def _ratios(r: dict[str, object], base: dict[str, object]) -> dict[str, float]:
    def ratio(key: str, sub: str | None = None) -> float:
        a, b = r[key], base[key]
        if sub is not None:
            assert isinstance(a, dict) and isinstance(b, dict)
            a, b = a[sub], b[sub]
        assert isinstance(a, (int, float)) and isinstance(b, (int, float))
        return round(a / b, 3) if b else float("nan")

    return {"output_tokens_per_s": ratio("output_tokens_per_s"),
            "ttft_p50": ratio("ttft_ms", "p50"), "tpot_p50": ratio("tpot_ms", "p50")}


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, target: str, total: int, enabled: bool) -> None:
        self.target, self.total, self.done, self.enabled = target, total, 0, enabled

    def tick(self, trace: loadgen.Trace) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r{self.target} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
