"""EAGLE on vs off: output tokens/s of whole generate calls (prefill included), in one run.

    python -m bench.spec [--model DIR (with DIR/draft)] [--k 3] [--topk 1] [--steps S]
        [--batch 1,8] [--groups G] [--repeats R] [--new 64] [--prompts random|heldout] [--json]

Prints tokens/s of plain decoding and of EAGLE rounds, their ratio, and the acceptance length
(tokens committed per verify round). Greedy, so both produce the same tokens (checked). Prompts
are random token ids, or (``heldout``, for the built-in model) text from the standard-library
files that ``scripts/train_tiny.py`` holds out of training. Each batch size runs ``G`` fixed
batches of distinct prompts one after another (``G * batch`` prompts), so a figure does not
hang on one prompt; tokens/s count all of them. With ``--repeats R`` plain and EAGLE are timed
alternately ``R`` times on the same engines and the medians are printed (the ratio is the
median of the ``R`` ratios, with their range), which keeps a busy machine's drift out of the
ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from decode_node.spec.eagle_engine import EagleEngine, SpecStats
from decode_node.spec.tree import TreeShape
from engine.builtin.stdlib_corpus import heldout_prompts
from engine.builtin.tiny_model import write_tiny_draft, write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.loader import load_draft
from engine.text.tokenizer import Tokenizer

Runner = LLMEngine | EagleEngine


def make_runner(model_dir: Path, k: int | None, topk: int = 1, steps: int | None = None
                ) -> Runner:
    """Plain decoding (``k`` None), or EAGLE rounds of ``k`` draft tokens (a tree of ``topk``
    children per node, ``steps`` deep), on a fresh engine."""
    lookahead = TreeShape(k, topk, steps).lookahead if k else 0
    config = EngineConfig(num_pages=4096, page_size=16, max_num_seqs=256,
                          max_num_batched_tokens=4096, lookahead_tokens=lookahead)
    engine = LLMEngine(model_dir, config)
    if not k:
        return engine
    draft = load_draft(model_dir / "draft", engine.model_config.text, engine.dtype,
                       device=engine.device)
    return EagleEngine(engine, draft, k, topk, steps)


def timed(runner: Runner, groups: list[list[Prompt]], params: SamplingParams
          ) -> tuple[float, list[list[int]]]:
    """Tokens/s and outputs of ``runner`` over each batch of ``groups`` in turn."""
    start = time.perf_counter()
    results = [r for prompts in groups for r in runner.generate(prompts, params)]
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed, [r.token_ids for r in results]


def compare(model_dir: Path, groups: list[list[Prompt]], params: SamplingParams, k: int,
            topk: int, steps: int | None, repeats: int) -> dict[str, float]:
    """Plain and EAGLE over the same ``groups``, timed alternately ``repeats`` times (so both
    see the same machine); medians of tokens/s and of the per-repeat ratio, and EAGLE's
    acceptance length. Raises if EAGLE changes any output."""
    plain, spec = make_runner(model_dir, None), make_runner(model_dir, k, topk, steps)
    assert isinstance(spec, EagleEngine)
    for runner in (plain, spec):
        runner.generate(groups[0][:1], params)  # warm-up
    offs, ons = [], []
    for _ in range(repeats):
        off, want = timed(plain, groups, params)
        spec.stats = SpecStats()
        on, got = timed(spec, groups, params)
        if got != want:
            raise AssertionError("EAGLE changed the output")
        offs.append(off)
        ons.append(on)
    ratios = [b / a for a, b in zip(offs, ons, strict=True)]
    return {"plain_tok_s": round(statistics.median(offs), 1),
            "eagle_tok_s": round(statistics.median(ons), 1),
            "ratio": round(statistics.median(ratios), 2),
            "ratio_min": round(min(ratios), 2), "ratio_max": round(max(ratios), 2),
            "acceptance_length": round(spec.stats.acceptance_length, 2)}


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
    parser.add_argument("--groups", type=int, default=1,
                        help="batches of distinct prompts per batch size, run in turn")
    parser.add_argument("--repeats", type=int, default=1,
                        help="plain and EAGLE timed alternately this many times (medians)")
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
        most = max(batches) * args.groups
        held = heldout_ids(model_dir, most, args.prompt_len) if args.prompts == "heldout" else []
        for bs in batches:
            n = bs * args.groups
            ids = held[:n] or torch.randint(0, 400, (n, args.prompt_len), generator=gen).tolist()
            groups = [[Prompt(token_ids=p) for p in ids[i : i + bs]] for i in range(0, n, bs)]
            rows.append({"batch": bs, "groups": args.groups, "k": args.k, **compare(
                model_dir, groups, params, args.k, args.topk, args.steps, args.repeats)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'batch':>5} {'k':>2} {'plain tok/s':>12} {'eagle tok/s':>12} {'ratio':>6} "
          f"{'min-max':>10} {'accept len':>10}")
    for r in rows:
        spread = f"{r['ratio_min']}-{r['ratio_max']}"
        print(f"{r['batch']:>5} {r['k']:>2} {r['plain_tok_s']:>12} {r['eagle_tok_s']:>12} "
              f"{r['ratio']:>6} {spread:>10} {r['acceptance_length']:>10}")


if __name__ == "__main__":
    main()
