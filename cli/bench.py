"""``pdserve bench``: drive routers with a workload and report latency and throughput.

    pdserve bench --target HOST:PORT [--target HOST:PORT ...] --num-requests N [--json FILE]
    pdserve bench --compare [--model DIR] [--request-rate R ...] [--plot FILE.png]

With one target at one rate the JSON is that run's report. With several targets or rates the
same requests go to each in turn and the JSON has one row per run, with ratios against the
baseline (the first target; with ``--compare`` see :mod:`bench.compare`), also printed as a
Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.compare_targets import DEFAULT_K, DEFAULT_TARGETS, TARGETS
from cli.arg_types import positive, positive_float
from cli.engine_args import add_tree_args
from cli.models import ensure_model

if TYPE_CHECKING:  # the run functions import these (gRPC, clusters): the parser stays light
    from bench import compare, loadgen


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", metavar="HOST:PORT",
                   help="router address (repeat to compare targets on the same requests)")
    p.add_argument("--compare", action="store_true",
                   help="start each of --compare-targets on loopback in turn and compare them")
    p.add_argument("--compare-targets", default=None,
                   help=f"comma-separated, from {','.join(TARGETS)} (default: "
                        f"{','.join(DEFAULT_TARGETS)}; without transformers for "
                        "--dataset multi-turn); the -no-cache ones run without a prefix cache")
    p.add_argument("--baseline", default=None,
                   help="the row ratios are taken against (default: transformers with "
                        "--compare if run, else the first target)")
    p.add_argument("--model", default=None,
                   help="checkpoint for --compare, and the tokenizer of --dataset code: a "
                        "directory, or builtin, builtin:qwen2-vl, builtin:hybrid (default: "
                        "builtin)")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw latency against request rate per target (matplotlib)")
    p.add_argument("--num-requests", type=positive, default=64)
    p.add_argument("--dataset", default="random",
                   choices=["random", "code", "shared-prefix", "multi-turn", "images", "jsonl"],
                   help="random token ids; code: text cut from the standard-library files "
                        "the built-in model held out of training; shared-prefix: random "
                        "prompts of --input-len tokens that share their first "
                        "--shared-prefix-ratio; multi-turn: --num-conversations chats of "
                        "--num-turns turns, each turn's prompt the chat so far (earlier "
                        "messages and the answers the server gave) and a new message of "
                        "--turn-len random ids; PNG images; prompts from --jsonl")
    p.add_argument("--jsonl", type=Path, help="prompts file for --dataset jsonl")
    p.add_argument("--input-len", type=positive, default=128, help="mean prompt tokens")
    p.add_argument("--shared-prefix-ratio", type=float, default=0.5, metavar="R",
                   help="--dataset shared-prefix: the share of each prompt all prompts have in "
                        "common (0 to 1)")
    p.add_argument("--num-conversations", type=positive, default=8,
                   help="--dataset multi-turn: conversations at once (--num-requests is "
                        "conversations x turns; --request-rate counts conversations)")
    p.add_argument("--num-turns", type=positive, default=4, help="--dataset multi-turn: turns each")
    p.add_argument("--turn-len", type=positive, default=None,
                   help="--dataset multi-turn: tokens of each new user message "
                        "(default: --input-len)")
    p.add_argument("--output-len", type=positive, default=64, help="mean new tokens")
    p.add_argument("--vocab", type=positive, default=512, help="token ids are drawn below this")
    p.add_argument("--request-rate", type=positive_float, action="append", metavar="R",
                   help="Poisson arrivals per second; repeat for several runs "
                        "(default: all at once, 'inf')")
    p.add_argument("--max-concurrency", type=positive, default=32)
    p.add_argument("--num-draft-tokens", type=positive, default=None,
                   help="the servers' K, to turn accepted/drafted counts into acceptance "
                        "length (--compare: the EAGLE cluster's K, default "
                        f"{DEFAULT_K})")
    add_tree_args(p)  # --compare: the EAGLE cluster's draft tree
    p.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                   help="goodput: the share of requests with TTFT (and TPOT) within the limits; "
                        "with several runs, goodput_max_rate is the highest rate at which at "
                        "least 90%% of requests met them")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report")
    p.add_argument("--no-progress", action="store_true")


def workloads(args: argparse.Namespace) -> loadgen.Load:
    from bench import loadgen

    n = args.num_requests
    if args.dataset == "jsonl":
        if args.jsonl is None:
            raise ValueError("--dataset jsonl needs --jsonl FILE")
        return loadgen.jsonl_workloads(args.jsonl, args.output_len)[:n]
    if args.dataset == "shared-prefix":
        if not 0.0 <= args.shared_prefix_ratio <= 1.0:
            raise ValueError("--shared-prefix-ratio must be between 0 and 1")
        shared = round(args.input_len * args.shared_prefix_ratio)
        return loadgen.shared_prefix_workloads(n, shared, args.input_len - shared,
                                               args.output_len, args.vocab, args.seed)
    if args.dataset == "multi-turn":
        return loadgen.multi_turn_workloads(args.num_conversations, args.num_turns,
                                            args.turn_len or args.input_len, args.output_len,
                                            args.vocab, args.seed)
    if args.dataset == "code":
        from engine.text.tokenizer import Tokenizer

        model = ensure_model(args.model)
        tok = Tokenizer.from_dir(model)
        if tok is None:
            raise ValueError(f"--dataset code needs a tokenizer: {model} has no tokenizer.json")
        return loadgen.code_workloads(n, args.input_len, args.output_len, tok.encode, args.seed)
    if args.dataset == "images":
        return loadgen.image_workloads(n, args.output_len, args.seed)
    return loadgen.random_workloads(n, args.input_len, args.output_len, args.vocab, args.seed)


def run_bench(args: argparse.Namespace) -> int:
    """Run and report; exit 1 when a request failed, 2 (one error line) when a cluster did not
    start or a baseline library is missing."""
    try:
        return _bench(args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    from bench import compare

    if bool(args.compare) == bool(args.target):
        raise ValueError("give --target HOST:PORT (repeatable) or --compare, not both")
    works = workloads(args)
    rates = args.request_rate or [math.inf]
    config = _config(args, rates, len(works))
    if args.compare:
        rows, outputs, baseline = _compare_rows(args, works, rates)
    else:
        baseline = args.baseline or args.target[0]
        if baseline not in args.target:
            raise ValueError(f"--baseline {baseline} is not one of the --target addresses")
        rows, outputs = _target_rows(args, works, rates)
    if len(rows) == 1:
        out: dict[str, object] = {k: v for k, v in rows[0].items()
                                  if k not in ("target", "request_rate")}
    else:
        compare.add_ratios(rows, outputs, baseline)
        out = {"config": config, "baseline": baseline, "rows": rows}
        if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
            out["goodput_max_rate"] = compare.goodput_rates(rows)
        print(compare.table(rows, baseline), file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    if args.plot is not None:
        from bench.plot import plot

        plot(rows, args.plot, title=f"{len(works)} requests, {args.dataset}, "
                                    f"{args.input_len} prompt tokens, {args.output_len} new")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _target_rows(args: argparse.Namespace, works: loadgen.Load, rates: list[float]
                 ) -> tuple[list[compare.Row], list[list[list[int]]]]:
    from bench import compare, loadgen

    rows: list[compare.Row] = []
    outputs: list[list[list[int]]] = []
    for target in args.target:
        for rate in rates:
            progress = _Progress(target, len(works), enabled=not args.no_progress)
            traces, wall = asyncio.run(loadgen.run(
                target, works, max_concurrency=args.max_concurrency, request_rate=rate,
                seed=args.seed, on_done=progress.tick))
            progress.close()
            rows.append({"target": target, "request_rate": compare.rate_key(rate),
                         **loadgen.report(traces, wall, args.num_draft_tokens or 0,
                                          args.slo_ttft_ms, args.slo_tpot_ms)})
            outputs.append([t.token_ids for t in traces])
    return rows, outputs


def _compare_rows(args: argparse.Namespace, works: loadgen.Load, rates: list[float]
                  ) -> tuple[list[compare.Row], list[list[list[int]]], str]:
    from bench import compare, hf_baseline, loadgen

    multi_turn = isinstance(works, loadgen.MultiTurn)
    if args.compare_targets is None:
        targets = [t for t in DEFAULT_TARGETS if not (multi_turn and t == "transformers")]
    else:
        targets = [t.strip() for t in args.compare_targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"unknown --compare-targets {unknown}; choose from {TARGETS}")
    if multi_turn and "transformers" in targets:
        raise ValueError("--dataset multi-turn does not run on the transformers baseline: "
                         "leave it out of --compare-targets")
    baseline = args.baseline or ("transformers" if "transformers" in targets else targets[0])
    if baseline not in targets:
        raise ValueError(f"--baseline {baseline} is not one of --compare-targets")
    if "transformers" in targets:
        hf_baseline.require_transformers()  # fail before any cluster starts
    from decode_node.spec.tree import TreeShape

    TreeShape(args.num_draft_tokens or DEFAULT_K, args.draft_topk, args.draft_steps)
    model = ensure_model(args.model)
    rows, outputs = compare.run_compare(
        model, targets, works, rates, max_concurrency=args.max_concurrency,
        num_draft_tokens=args.num_draft_tokens or DEFAULT_K, seed=args.seed,
        draft_topk=args.draft_topk, draft_steps=args.draft_steps,
        log=(lambda m: None) if args.no_progress else (lambda m: print(m, file=sys.stderr)),
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    return rows, outputs, baseline


def _config(args: argparse.Namespace, rates: list[float], requests: int) -> dict[str, object]:
    from bench import compare

    dataset: dict[str, object] = {}
    if args.dataset == "shared-prefix":
        dataset = {"shared_prefix_ratio": args.shared_prefix_ratio}
    elif args.dataset == "multi-turn":
        dataset = {"num_conversations": args.num_conversations, "num_turns": args.num_turns,
                   "turn_len": args.turn_len or args.input_len}
    return {"dataset": args.dataset, **dataset, "num_requests": requests,
            "input_len": args.input_len, "output_len": args.output_len,
            "max_concurrency": args.max_concurrency,
            "request_rates": [compare.rate_key(r) for r in rates],
            "model": str(args.model) if args.model else "built-in",
            "num_draft_tokens": args.num_draft_tokens or (DEFAULT_K if args.compare else 0),
            "draft_topk": args.draft_topk, "draft_steps": args.draft_steps, "seed": args.seed}


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
