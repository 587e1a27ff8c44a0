"""transformers' ``generate`` alone, as ``pdserve bench --compare`` runs it for its baseline row.

    OMP_NUM_THREADS=1 python -m bench.hf_generate [--model DIR] [--num-requests 64]
        [--input-len 128] [--output-len 64] [--max-concurrency 32] [--request-rate R]

The same random prompts ``pdserve bench`` sends (same seed, same token ids), served in static
batches of ``--max-concurrency`` by :mod:`bench.hf_baseline`; prints the report as JSON with
the same fields as ``pdserve bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench import hf_baseline, loadgen
from engine.builtin import builtin_model_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the built-in model")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    works = loadgen.random_workloads(args.num_requests, args.input_len, args.output_len,
                                     args.vocab, args.seed)
    traces, wall = hf_baseline.run(args.model or builtin_model_dir(), works,
                                   max_concurrency=args.max_concurrency,
                                   request_rate=args.request_rate, seed=args.seed)
    print(json.dumps(loadgen.report(traces, wall), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
