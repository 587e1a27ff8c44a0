"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) greedy decoding: pdserve's engine against
transformers' ``generate`` on the same random ~0.5B checkpoint, in one run.

    python -m bench.qwen3_5_generate [--batches 1,8,32] [--prompt-len 64] [--new-tokens 32]
        [--threads N] [--vocab 151936] [--tiny] [--json]

The checkpoint is built in a temporary directory by transformers' own
``Qwen3_5ForConditionalGeneration`` (seeded random weights, float32) and ``save_pretrained``:
the text shape of the published small Qwen3.5 models (:data:`TEXT`: hidden 1024, 24 layers,
every 4th full attention) with a tiny vision tower, since the prompts are text (``--tiny``:
a 4-layer toy of the same layout, for the smoke test). Both sides load it in float32 on the
CPU and get the same random prompts of exactly ``--prompt-len`` tokens; each produces exactly
``--new-tokens`` tokens per prompt (EOS ignored). Tokens/s count generated tokens over the
whole ``generate`` call, prefill included. Per batch size pdserve and transformers run one after
the other on the same machine (transformers with a left-padded batch and its attention mask),
each after a warm-up call on the same prompts with one new token (a first call at a new batch
size pays for allocating its activations). ``same`` is how many rows gave the same tokens on
both sides; batch 1 must agree (float32, greedy).

Beside the table: the memory one request holds. A hybrid request has a fixed-size state in
every linear layer (the state pool's ``bytes_per_slot``) plus KV for the full-attention layers
only (per token, from the KV pool's shape); a model of the same shape with all layers full
attention holds KV in every layer. Both at prompt + output tokens, at 4k and at 32k tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.random_prompts import prompts
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt

# the text decoder of the published small Qwen3.5 models (hidden 1024, 24 layers, gated
# attention every 4th layer with a quarter-width rotation, 16 + 16 linear heads of 128)
TEXT: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                    for i in range(24)],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True, "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
    "eos_token_id": None,
    "bos_token_id": None,
}
TINY_TEXT: dict[str, Any] = {
    **TEXT, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 4,
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "rope_parameters": {**TEXT["rope_parameters"], "mrope_section": [2, 1, 1],
                        "partial_rotary_factor": 0.5},
}
VISION: dict[str, Any] = {  # one tiny block: the benchmark's prompts are text
    "depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
}
WEIGHT_STD = 0.08  # as the tests' random checkpoints: logits far from ties
LONG_CONTEXTS = (4096, 32768)


def write_checkpoint(path: Path, vocab: int, tiny: bool = False, seed: int = 0) -> int:
    """A seeded random Qwen3.5 checkpoint (tied embeddings) saved by transformers at ``path``;
    returns its parameter count (text and vision, tied weights once)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**(TINY_TEXT if tiny else TEXT), "vocab_size": vocab}
    vision = {**VISION, "out_hidden_size": text["hidden_size"]}
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                        image_token_id=vocab - 4, video_token_id=vocab - 3,
                        vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, WEIGHT_STD)
    model.save_pretrained(path)
    count = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    del model
    gc.collect()
    return count


def left_padded(ids: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` as one batch padded on the left, and its attention mask (0 on the padding)."""
    width = max(len(p) for p in ids)
    batch = torch.full((len(ids), width), pad, dtype=torch.int64)
    mask = torch.zeros_like(batch)
    for row, p in enumerate(ids):
        batch[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return batch, mask


def run_pdserve(engine: LLMEngine, ids: list[list[int]], new: int
                ) -> tuple[float, list[list[int]]]:
    """Generated tokens/s of one whole ``generate`` call over ``ids``, and its tokens."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate([Prompt(token_ids=p) for p in ids], params)
    elapsed = time.perf_counter() - start
    out = [r.token_ids for r in results]
    assert all(len(t) == new for t in out)
    return len(ids) * new / elapsed, out


def run_transformers(model: Any, ids: list[list[int]], new: int
                     ) -> tuple[float, list[list[int]]]:
    """The same for transformers' ``generate`` (greedy, exactly ``new`` tokens per row)."""
    batch, mask = left_padded(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == batch.shape[1] + new
    return len(ids) * new / elapsed, out[:, batch.shape[1]:].tolist()


def memory_figures(engine: LLMEngine, model_dir: Path, tokens: int) -> dict[str, Any]:
    """Bytes one request holds: hybrid (state slot + KV of the full-attention layers) against a
    model of the same shape with every layer full attention, at ``tokens`` and at
    :data:`LONG_CONTEXTS`."""
    assert engine.states is not None, "not a hybrid model"
    text = ModelConfig.from_dir(model_dir).text
    pool = engine.pool
    kv_token = sum(t[0, 0].numel() * t.element_size() for t in (*pool.k, *pool.v))
    per_layer = kv_token // len(pool.layer_ids)
    full_token = per_layer * text.num_hidden_layers
    state = engine.states.pool.bytes_per_slot
    rows = [{"tokens": n, "hybrid_bytes": state + n * kv_token, "full_bytes": n * full_token}
            for n in (tokens, *LONG_CONTEXTS)]
    return {"state_bytes_per_request": state, "kv_bytes_per_token": kv_token,
            "kv_layers": len(pool.layer_ids), "layers": text.num_hidden_layers,
            "full_kv_bytes_per_token": full_token, "per_request": rows}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tiny", action="store_true", help="a 4-layer toy shape (smoke test)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3_5ForConditionalGeneration

    batches = [int(b) for b in args.batches.split(",")]
    rows, new = [], args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3_5"
        start = time.perf_counter()
        params = write_checkpoint(model_dir, args.vocab, args.tiny)
        built_s = time.perf_counter() - start
        most = max(batches)
        engine = LLMEngine(model_dir, EngineConfig(
            num_pages=most * -(-(args.prompt_len + new) // 16) + 16, page_size=16,
            max_num_seqs=max(most, 32), max_num_batched_tokens=max(512, most * args.prompt_len),
            enable_prefix_cache=False))
        hf = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        hf = hf.eval()
        for bs in batches:
            ids = prompts(bs, args.prompt_len, args.vocab)
            run_pdserve(engine, ids, 1)  # warm-up: the batch's prefill, its buffers allocated
            run_transformers(hf, ids, 1)
            ours, got = run_pdserve(engine, ids, new)
            ref, want = run_transformers(hf, ids, new)
            same = sum(a == b for a, b in zip(got, want, strict=True))
            rows.append({"batch": bs, "pdserve_tok_s": round(ours, 2),
                         "transformers_tok_s": round(ref, 2), "ratio": round(ours / ref, 2),
                         "same": same})
        memory = memory_figures(engine, model_dir, args.prompt_len + new)
    report = {"params": params, "build_s": round(built_s, 1), "threads": torch.get_num_threads(),
              "prompt_len": args.prompt_len, "new_tokens": new, "rows": rows,
              "memory": memory}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    if rows and rows[0]["batch"] == 1 and rows[0]["same"] != 1:
        raise SystemExit("batch 1: pdserve's greedy tokens differ from transformers'")


def _print(report: dict[str, Any]) -> None:
    print(f"Qwen3.5 random checkpoint: {report['params']:,} parameters (built in "
          f"{report['build_s']} s), float32, CPU, {report['threads']} threads; prompt "
          f"{report['prompt_len']} tokens, {report['new_tokens']} new")
    print(f"{'batch':>5} {'pdserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'same':>6}")
    for r in report["rows"]:
        print(f"{r['batch']:>5} {r['pdserve_tok_s']:>14} {r['transformers_tok_s']:>19} "
              f"{r['ratio']:>6} {r['same']:>3}/{r['batch']:<2}")
    m = report["memory"]
    print(f"\nper request: state {_mib(m['state_bytes_per_request'])} (linear layers: "
          f"{m['layers'] - m['kv_layers']}) + KV {m['kv_bytes_per_token']} B/token "
          f"({m['kv_layers']} full-attention layers); all {m['layers']} layers full attention: "
          f"{m['full_kv_bytes_per_token']} B/token")
    print(f"{'tokens':>7} {'hybrid':>12} {'all full attn':>14} {'hybrid / full':>14}")
    for r in m["per_request"]:
        print(f"{r['tokens']:>7} {_mib(r['hybrid_bytes']):>12} {_mib(r['full_bytes']):>14} "
              f"{r['hybrid_bytes'] / r['full_bytes']:>14.2f}")


if __name__ == "__main__":
    main()
