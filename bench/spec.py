"""EAGLE on vs off: decode tokens per second on the same prompts, in one run.

    python -m bench.spec [--model DIR (with DIR/draft)] [--k 3] [--topk 1] [--steps S]
        [--batch 1,8] [--new 64] [--prompts random|heldout] [--json]

Prints tokens/s of plain decoding and of EAGLE rounds, their ratio, and the acceptance length
(tokens committed per verify round). Greedy, so both produce the same tokens (checked). Prompts
are random token ids, or (``heldout``, for the built-in model) text from the standard-library
files that ``scripts/train_tiny.py`` holds out of training.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from decode_node.spec.eagle_engine import EagleEngine
from decode_node.spec.tree import TreeShape
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle import load_draft
from engine.request import SamplingParams
from engine.stdlib_corpus import heldout_prompts
from engine.tiny_model import write_tiny_draft, write_tiny_model
from engine.tokenizer import Tokenizer


def run(model_dir: Path, prompts: list[Prompt], params: SamplingParams, k: int | None,
        topk: int = 1, steps: int | None = None) -> tuple[float, list[list[int]], float]:
    """Tokens/s, outputs and acceptance length of plain decoding (``k`` None) or EAGLE rounds of
    ``k`` draft tokens (a tree of ``topk`` children per node, ``steps`` deep)."""
    lookahead = TreeShape(k, topk, steps).lookahead if k else 0
    config = EngineConfig(num_pages=4096, page_size=16, max_num_seqs=256,
                          max_num_batched_tokens=4096, lookahead_tokens=lookahead)
    engine = LLMEngine(model_dir, config)
    runner: LLMEngine | EagleEngine = engine
    if k:
        draft = load_draft(model_dir / "draft", engine.model_config.text, engine.dtype,
                           device=engine.device)
        runner = EagleEngine(engine, draft, k, topk, steps)
    runner.generate(prompts[:1], params)  # warm-up
    start = time.perf_counter()
    results = runner.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    accept = runner.stats.acceptance_length if isinstance(runner, EagleEngine) else 1.0
    return tokens / elapsed, [r.token_ids for r in results], accept


def heldout_ids(model_dir: Path, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from the stdlib files the training held out."""
    tok = Tokenizer.from_dir(model_dir)
    if tok is None:
        raise SystemExit(f"--prompts heldout needs {model_dir}/tokenizer.json")
    return heldout_prompts(tok.encode, n, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory with an EAGLE draft in DIR/draft")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--topk", type=int, default=1, help="draft tree: children per node")
    parser.add_argument("--steps", type=int, default=None, help="draft tree: depth (default k)")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--prompts", choices=["random", "heldout"], default="random")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_tiny_model(Path(tmp) / "tiny")
        if not (model_dir / "draft").is_dir():
            write_tiny_draft(model_dir / "draft")
        params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        batches = [int(b) for b in args.batch.split(",")]
        held = heldout_ids(model_dir, max(batches), args.prompt_len) if args.prompts == "heldout" \
            else []
        for bs in batches:
            ids = held[:bs] or torch.randint(0, 400, (bs, args.prompt_len), generator=gen).tolist()
            prompts = [Prompt(token_ids=p) for p in ids]
            off, plain, _ = run(model_dir, prompts, params, None)
            on, spec, accept = run(model_dir, prompts, params, args.k, args.topk, args.steps)
            assert spec == plain, "EAGLE changed the output"
            rows.append({"batch": bs, "k": args.k, "plain_tok_s": round(off, 1),
                         "eagle_tok_s": round(on, 1), "ratio": round(on / off, 2),
                         "acceptance_length": round(accept, 2)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'batch':>5} {'k':>2} {'plain tok/s':>12} {'eagle tok/s':>12} {'ratio':>6} "
          f"{'accept len':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['k']:>2} {r['plain_tok_s']:>12} {r['eagle_tok_s']:>12} "
              f"{r['ratio']:>6} {r['acceptance_length']:>10}")


if __name__ == "__main__":
    main()
