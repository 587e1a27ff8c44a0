"""Sections (a)-(d) of ``scripts/device_check.py``: greedy tokens on the device against an oracle.

Each ``check_*(ctx, res)`` fills ``res`` as it goes (so a failure part-way leaves what was
measured) and ends by setting ``res["ok"]`` and a one-line ``res["summary"]``.

* (a) ``pdserve generate --device D --dtype float32`` (a subprocess, as a user runs it) against
  transformers' ``generate`` on the same device, text and image prompts, 24 new tokens.
* (b) our engine in bfloat16 against transformers in bfloat16: the share of prompts whose first
  16 tokens agree (ok from 50%: bf16 rounding may flip near-ties).
* (c) graphs on against graphs off, over a batch of mixed lengths whose requests stop one after
  another, so the decode batch shrinks through several padded sizes.
* (d) EAGLE (``EagleEngine``, k=3; graphs on and off) against plain decoding on the trained
  built-in model and its draft; reports the acceptance length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from device_check_context import Context
from device_check_models import (
    TINY_VOCAB,
    Case,
    compare,
    hf_greedy,
    hf_load,
    special_config,
    text_ids,
)

from engine.builtin import builtin_model_dir
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.text.chat import chat_prompt

REPO = Path(__file__).resolve().parent.parent
FP32_TOKENS = 24
QUICK_FP32_TOKENS = 12
BF16_TOKENS = 16
EAGLE_K = 3
EAGLE_TREE = (4, 2, 3)  # an EAGLE-2 draft tree: num_draft_tokens, topk, steps
EAGLE_TOKENS = 32
IMAGE_ID = int(special_config(TINY_VOCAB)["image_token_id"])


def _prompt(case: Case) -> Prompt:
    return Prompt(token_ids=case.token_ids, images=case.images)


def cli_flags() -> set[str]:
    """The option strings ``pdserve generate --help`` lists."""
    out = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--help"], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=120, check=True)
    return {w.strip(",[]") for w in out.stdout.split() if w.startswith("--")}


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # float32 means float32: no TF32 in cuBLAS/cuDNN (transformers' side is set the same way)
    return {**os.environ, "PYTHONPATH": path, "NVIDIA_TF32_OVERRIDE": "0"}


def start_cli(ctx: Context, model_dir: Path, cases: list[Case], pngs: list[bytes], dtype: str,
              new_tokens: int, flags: set[str]) -> subprocess.Popen[str]:
    """Start ``python -m cli.main generate`` over ``cases`` (token ids; every prompt gets
    ``pngs``); :func:`finish_cli` collects its results."""
    cmd = [sys.executable, "-m", "cli.main", "generate", "--model", str(model_dir),
           "--dtype", dtype, "--max-new-tokens", str(new_tokens), "--ignore-eos", "--json"]
    if "--device" in flags:
        cmd += ["--device", ctx.device]
    elif ctx.device != "cpu":
        raise RuntimeError("pdserve generate has no --device flag")
    for i, png in enumerate(pngs):
        path = ctx.work / f"image{i}.png"
        path.write_bytes(png)
        cmd += ["--image", str(path)]
    for case in cases:
        cmd += ["--token-ids", ",".join(map(str, case.token_ids))]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_cli(ctx: Context, proc: subprocess.Popen[str], n: int) -> list[list[int]]:
    """Wait for a :func:`start_cli` run of ``n`` prompts; each prompt's generated ids."""
    try:
        stdout, stderr = proc.communicate(timeout=max(10.0, ctx.remaining()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"pdserve generate exited {proc.returncode}: {stderr[-1500:]}")
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(rows) != n:
        raise RuntimeError(f"pdserve generate printed {len(rows)} results for {n} prompts: "
                           f"{stdout[-1500:]}")
    return [[int(t) for t in row["token_ids"]] for row in rows]


def check_fp32(ctx: Context, res: dict[str, Any]) -> None:
    """(a) ``pdserve generate`` float32 equals transformers float32 on the device."""
    model_dir, prompts = ctx.tiny()
    flags = cli_flags()
    res["cli_has_device_flag"] = "--device" in flags
    new = QUICK_FP32_TOKENS if ctx.quick else FP32_TOKENS
    groups: list[tuple[list[Case], list[bytes]]] = [(prompts.text, []),
                                                    (prompts.image, prompts.pngs)]
    # both CLI runs go at once, while transformers computes the references here
    procs = [start_cli(ctx, model_dir, cases, pngs, "float32", new, flags)
             for cases, pngs in groups]
    try:
        hf = hf_load(model_dir, "float32", ctx.device)
        refs = [[hf_greedy(hf, case, new, IMAGE_ID) for case in cases] for cases, _ in groups]
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise
    outs = [finish_cli(ctx, proc, len(cases)) for proc, (cases, _) in zip(procs, groups,
                                                                          strict=True)]
    res["prompts"] = verdicts = [
        compare(case.name, toks, ref, len(case.token_ids))
        for (cases, _), group_out, group_ref in zip(groups, outs, refs, strict=True)
        for case, toks, ref in zip(cases, group_out, group_ref, strict=True)]
    equal = sum(v["equal"] for v in verdicts)
    res["ok"] = equal == len(verdicts)
    res["summary"] = f"{equal}/{len(verdicts)} prompts equal ({new} tokens, float32, CLI)"


def check_bf16(ctx: Context, res: dict[str, Any]) -> None:
    """(b) our engine bfloat16 against transformers bfloat16, first 16 tokens."""
    model_dir, prompts = ctx.tiny()
    cases = [*prompts.text, *prompts.image]
    engine = LLMEngine(model_dir, ctx.engine_config(dtype="bfloat16", num_pages=256))
    greedy = SamplingParams(max_new_tokens=BF16_TOKENS, ignore_eos=True)
    ours = engine.generate([_prompt(c) for c in cases], greedy)
    del engine
    hf = hf_load(model_dir, "bfloat16", ctx.device)
    res["prompts"] = verdicts = [
        compare(c.name, o.token_ids, hf_greedy(hf, c, BF16_TOKENS, IMAGE_ID), len(c.token_ids))
        for c, o in zip(cases, ours, strict=True)]
    share = sum(v["equal"] for v in verdicts) / len(verdicts)
    res["share_equal"] = round(share, 3)
    res["ok"] = share >= 0.5
    res["summary"] = f"{share:.0%} of {len(verdicts)} prompts equal on {BF16_TOKENS} tokens (bf16)"


def check_graphs(ctx: Context, res: dict[str, Any]) -> None:
    """(c) graphs on and off give the same tokens (mixed lengths, a shrinking batch)."""
    model_dir, prompts = ctx.tiny()
    cases = [*prompts.text, Case("short_3", text_ids(3, 20)), Case("mid_17", text_ids(17, 21)),
             *prompts.image]
    # staggered lengths: the decode batch steps down through several padded sizes
    params = [SamplingParams(max_new_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(cases))]
    runs: dict[str, list[list[int]]] = {}
    for graphs in (True, False):
        engine = LLMEngine(model_dir, ctx.engine_config(num_pages=256, graphs=graphs))
        runs[str(graphs)] = [r.token_ids for r in engine.generate([_prompt(c) for c in cases],
                                                                  params)]
        if graphs:  # how many decode graphs were captured (0 off CUDA: eager there)
            static = engine.runner.decode_graphs
            res["graphs_captured"] = static.graphs.num_captured if static is not None else 0
        del engine
        ctx.free()
    res["prompts"] = verdicts = [
        compare(c.name, on, off, len(c.token_ids))
        for c, on, off in zip(cases, runs["True"], runs["False"], strict=True)]
    equal = sum(v["equal"] for v in verdicts)
    cuda = ctx.device.startswith("cuda")
    res["ok"] = equal == len(verdicts) and (res["graphs_captured"] > 0 or not cuda)
    res["summary"] = (f"{equal}/{len(verdicts)} prompts equal, graphs on vs off "
                      f"({res['graphs_captured']} decode graphs captured)")


def check_eagle(ctx: Context, res: dict[str, Any]) -> None:
    """(d) EAGLE greedy equals plain greedy decoding on the device; acceptance length. The
    built-in draft as a chain (graphs on and off) and a tree; a random EAGLE-3 draft (three
    target layers fused inside the captured verify, its own vocabulary) as a chain and a tree
    (equality only: a random draft is rarely accepted)."""
    from decode_node.spec.eagle_engine import EagleEngine
    from decode_node.spec.tree import TreeShape
    from engine.builtin.tiny_model import write_random_eagle3_draft
    from engine.models.eagle.draft import Eagle3Spec
    from engine.models.eagle.loader import load_draft

    model_dir = builtin_model_dir()
    if not (model_dir / "draft" / "config.json").is_file():
        raise RuntimeError(f"{model_dir}: the built-in model and its draft are missing")
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    layers = Eagle3Spec.default_layer_ids(text["num_hidden_layers"])
    eagle3 = write_random_eagle3_draft(ctx.work / "eagle3-draft", text,
                                       Eagle3Spec(layers, text["vocab_size"] // 2))
    png = ctx.tiny()[1].pngs[0]
    prompts = [Prompt(text=chat_prompt(q)) for q in (
        "Write a Python function fibonacci(n). Return the n-th Fibonacci number.",
        "What does os.path.join do?")]
    prompts += [Prompt(text="def parse_args(argv):\n"), Prompt(text="import sys\n", images=[png])]
    greedy = SamplingParams(max_new_tokens=EAGLE_TOKENS, ignore_eos=True)
    plain = LLMEngine(model_dir, ctx.engine_config(num_pages=256)).generate(prompts, greedy)
    ctx.free()
    res["k"] = EAGLE_K
    runs: dict[str, dict[str, Any]] = {}
    res["runs"] = runs  # "graphs_on" / "graphs_off" / "tree" -> rounds, acceptance, verdicts
    own = model_dir / "draft"
    for name, graphs, shape, draft_dir in (("graphs_on", True, TreeShape(EAGLE_K), own),
                                           ("graphs_off", False, TreeShape(EAGLE_K), own),
                                           ("tree", True, TreeShape(*EAGLE_TREE), own),
                                           ("eagle3", True, TreeShape(EAGLE_K), eagle3),
                                           ("eagle3_tree", True, TreeShape(*EAGLE_TREE), eagle3)):
        engine = LLMEngine(model_dir, ctx.engine_config(
            num_pages=256, lookahead_tokens=shape.lookahead, graphs=graphs))
        draft = load_draft(draft_dir, engine.model_config.text, torch.float32, ctx.device)
        spec = EagleEngine(engine, draft, shape.num_draft_tokens, shape.topk, shape.steps)
        got = spec.generate(prompts, greedy)
        runs[name] = {
            "rounds": spec.stats.rounds,
            "acceptance_length": round(spec.stats.acceptance_length, 3),
            "prompts": [compare(f"prompt_{i}", g.token_ids, p.token_ids, len(p.prompt_token_ids))
                        for i, (g, p) in enumerate(zip(got, plain, strict=True))]}
        del engine, spec, draft
        ctx.free()
        ctx.save()
    verdicts = [v for run in runs.values() for v in run["prompts"]]
    equal = sum(v["equal"] for v in verdicts)
    first = next(iter(runs.values()))
    res["acceptance_length"] = first["acceptance_length"]
    res["ok"] = equal == len(verdicts) and all(run["rounds"] > 0 for run in runs.values())
    res["summary"] = (f"{equal}/{len(verdicts)} prompt runs equal ({', '.join(runs)}), "
                      f"acceptance length {first['acceptance_length']:.2f} (k={EAGLE_K})")
