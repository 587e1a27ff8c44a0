"""Section (e) of ``scripts/device_check.py``: throughput on a Qwen2-VL-2B-shaped checkpoint.

The checkpoint has Qwen2-VL-2B's decoder (hidden 1536, intermediate 8960, 28 layers, 12 heads,
2 KV heads, vocabulary 151936, tied embeddings) with random bfloat16 weights drawn on the device,
and a small vision tower (the prompts are text). transformers writes its ``config.json``; the
weights go straight to safetensors under transformers' own tensor names, so both sides load the
same file without a slow CPU initialisation of 1.5B parameters.

For each batch size (1, 32, 128; prompt 512 tokens, 128 new tokens, end-of-sequence ignored) it
measures output tokens per second of our ``LLMEngine`` (after a warm-up run of that batch size,
which captures graphs and compiles kernels) and of transformers' ``generate`` (bf16, sdpa), and
our median decode step time. At batch 1 the decode step is set against the memory-bandwidth
bound: the bytes of weights one decode step reads (every decoder weight and the LM head, not the
embedding lookup) over 4.8 TB/s. A run whose estimated time does not fit the budget is skipped.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from device_check_context import Context
from device_check_models import hf_load
from safetensors.torch import save_file

from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine

HBM_BYTES_PER_S = 4.8e12  # H200
QWEN2_VL_2B_TEXT: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                        "rope_theta": 1000000.0},
    "eos_token_id": None, "bos_token_id": None,
}
SMALL_VISION: dict[str, Any] = {"depth": 2, "embed_dim": 64, "num_heads": 4, "patch_size": 14,
                                "spatial_merge_size": 2, "temporal_patch_size": 2}
QUICK_TEXT: dict[str, Any] = {
    **QWEN2_VL_2B_TEXT, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}


@dataclass(frozen=True)
class SpeedPlan:
    """Shapes and sizes of one speed run."""

    text: dict[str, Any]
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    chunk: int  # max_num_batched_tokens of our engine

    @property
    def vision(self) -> dict[str, Any]:
        return {**SMALL_VISION, "hidden_size": self.text["hidden_size"]}


FULL = SpeedPlan(QWEN2_VL_2B_TEXT, (1, 32, 128), 512, 128, 8192)
QUICK = SpeedPlan(QUICK_TEXT, (1, 4), 32, 8, 256)


def write_random_checkpoint(path: Path, plan: SpeedPlan, device: str, seed: int = 0) -> int:
    """Write a random bf16 checkpoint of ``plan``'s shape to ``path``; returns the bytes of
    weights one decode step reads."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(text_config=dict(plan.text), vision_config=plan.vision,
                        tie_word_embeddings=True)
    cfg.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = True  # where our loader and every transformers 5.x look
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen2VLForConditionalGeneration(cfg).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embedding
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:  # norm weights one, biases zero
            value = 1.0 if name.endswith("weight") else 0.0
            state[name] = torch.full(shape, value, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
                           * 0.02).cpu()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = plan.text
    decoder = sum(t.numel() for n, t in state.items()
                  if "visual" not in n and "embed_tokens" not in n)
    return 2 * (decoder + text["vocab_size"] * text["hidden_size"])


def prompts(plan: SpeedPlan, batch: int, seed: int) -> torch.Tensor:
    """``[batch, prompt_len]`` random ordinary token ids (no special or vision ids)."""
    vocab = plan.text["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - min(1024, vocab // 8), (batch, plan.prompt_len), generator=gen)


def run_ours(ctx: Context, engine: LLMEngine, ids: torch.Tensor, new_tokens: int
             ) -> dict[str, Any]:
    """Generate for every row of ``ids`` step by step; total and per-decode-step timings."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(row, (), params) for row in ids.tolist()]
    steps: list[tuple[bool, float]] = []  # (every request already had a token, seconds)
    ctx.sync()
    start = time.perf_counter()
    try:
        while engine.scheduler.has_unfinished():
            decoding = all(r.num_output_tokens > 0 for r in reqs)
            t0 = time.perf_counter()
            engine.step()
            ctx.sync()
            steps.append((decoding, time.perf_counter() - t0))
    except BaseException:
        for r in reqs:  # leave the engine empty for the next batch size
            engine.abort(r.request_id)
        raise
    total = time.perf_counter() - start
    produced = sum(r.num_output_tokens for r in reqs)
    decode = [dt for d, dt in steps if d]
    return {"seconds": round(total, 4), "output_tokens": produced,
            "output_tok_s": round(produced / total, 1), "decode_steps": len(decode),
            "decode_step_ms_median": round(1e3 * statistics.median(decode), 3) if decode else None,
            "prefill_s": round(sum(dt for d, dt in steps if not d), 4)}


def run_hf(ctx: Context, model: Any, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:  # noqa: ANN401
    """transformers' greedy ``generate`` of exactly ``new_tokens`` per row; timings."""
    ids = ids.to(model.device)
    ctx.sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    ctx.sync()
    total = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"seconds": round(total, 4), "output_tokens": int(produced),
            "output_tok_s": round(produced / total, 1)}


def fits(ctx: Context, res: dict[str, Any], key: str, estimate: float) -> bool:
    """Whether a run of ``estimate`` seconds fits the budget; records a skip if not."""
    if estimate <= ctx.remaining() - 5.0:
        return True
    res.setdefault("skipped", []).append(f"{key}: skipped: budget (needs ~{estimate:.0f}s)")
    ctx.save()
    return False


def check_speed(ctx: Context, res: dict[str, Any]) -> None:
    """(e) output tok/s of our engine vs transformers, and the batch-1 decode step vs the
    bandwidth bound."""
    plan = QUICK if ctx.quick else FULL
    res["plan"] = {"batches": list(plan.batches), "prompt_len": plan.prompt_len,
                   "new_tokens": plan.new_tokens, "hidden": plan.text["hidden_size"],
                   "layers": plan.text["num_hidden_layers"]}
    path = ctx.work / "speed-model"
    t0 = time.perf_counter()
    weight_bytes = write_random_checkpoint(path, plan, ctx.device)
    res["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
    res["decode_weight_bytes"] = weight_bytes
    pages_per_req = -(-(plan.prompt_len + plan.new_tokens) // 16) + 1
    engine = LLMEngine(path, ctx.engine_config(
        dtype="bfloat16", page_size=16, num_pages=max(plan.batches) * pages_per_req + 8,
        max_num_seqs=max(plan.batches), max_num_batched_tokens=plan.chunk))
    hf = hf_load(path, "bfloat16", ctx.device)
    res["ours"], res["transformers"], res["ratio_tok_s"] = {}, {}, {}
    last: dict[str, tuple[int, float]] = {}  # side -> (batch, seconds) of its last run
    for batch in plan.batches:
        for side in ("ours", "transformers"):
            prev = last.get(side)
            # the last run's time (warm-up included) grown with the batch: decode-bound runs
            # grow far slower than the batch, so sqrt is a cautious middle
            estimate = 20.0 if prev is None else prev[1] * (batch / prev[0]) ** 0.5
            if not fits(ctx, res, f"{side} batch {batch}", estimate):
                continue
            start = time.perf_counter()
            try:
                res[side][str(batch)] = _measure(ctx, side, engine, hf, plan, batch,
                                                 warm=prev is None)
            except Exception as exc:  # e.g. out of memory: the other runs still count
                res[side][str(batch)] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                ctx.free()
            last[side] = (batch, time.perf_counter() - start)
            ctx.save()
        ours, tf = res["ours"].get(str(batch), {}), res["transformers"].get(str(batch), {})
        if "output_tok_s" in ours and "output_tok_s" in tf:
            res["ratio_tok_s"][str(batch)] = round(ours["output_tok_s"] / tf["output_tok_s"], 3)
    _bandwidth(ctx, res, hf, plan, weight_bytes)
    res["ok"] = all("output_tok_s" in res[side].get(str(b), {})
                    for side in ("ours", "transformers") for b in plan.batches)
    ratios = ", ".join(f"b{b}: x{r}" for b, r in res["ratio_tok_s"].items())
    res["summary"] = (f"ours/transformers tok/s {ratios}; b1 decode step "
                      f"{res.get('b1_decode_step_ms')} ms vs bound {res['bound_ms']} ms")


def _measure(ctx: Context, side: str, engine: LLMEngine, hf: Any, plan: SpeedPlan,  # noqa: ANN401
             batch: int, warm: bool) -> dict[str, Any]:
    """One timed run of ``side`` at ``batch``. Ours warms up every batch size first (graph
    capture, kernel compiles); transformers once, before its first run (``warm``)."""
    ids = prompts(plan, batch, seed=batch)
    if side == "ours":
        run_ours(ctx, engine, prompts(plan, batch, seed=1000 + batch), 3)
        return run_ours(ctx, engine, ids, plan.new_tokens)
    if warm:
        run_hf(ctx, hf, ids[:, :16], 2)
    return run_hf(ctx, hf, ids, plan.new_tokens)


def _bandwidth(ctx: Context, res: dict[str, Any], hf: Any, plan: SpeedPlan,  # noqa: ANN401
               weight_bytes: int) -> None:
    """Batch-1 decode step (ours, and transformers' from generate minus its prefill) against
    the bandwidth bound."""
    bound_ms = 1e3 * weight_bytes / HBM_BYTES_PER_S
    res["bound_ms"] = float(f"{bound_ms:.4g}")
    step = res["ours"].get("1", {}).get("decode_step_ms_median")
    res["b1_decode_step_ms"] = step
    if step:
        res["b1_step_over_bound"] = round(step / bound_ms, 3)
    tf = res["transformers"].get("1", {})
    if "seconds" in tf and fits(ctx, res, "transformers batch 1 prefill",
                                2 * tf["seconds"] / plan.new_tokens):
        prefill = run_hf(ctx, hf, prompts(plan, 1, seed=1), 1)["seconds"]
        tf_step = 1e3 * (tf["seconds"] - prefill) / (plan.new_tokens - 1)
        res["transformers_b1_decode_step_ms"] = round(tf_step, 3)
        res["transformers_b1_step_over_bound"] = round(tf_step / bound_ms, 3)
