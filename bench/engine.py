"""Engine throughput against transformers' ``generate`` on the same checkpoint, in one run.

    python -m bench.engine [--model DIR] [--batch-sizes 1,8,32] [--prompt-len 128] [--new 64]
        [--device cpu] [--dtype float32]

Prints decode tokens/s of both and the ratio per batch size (greedy, on ``--device`` in
``--dtype``, the same for both; ``auto`` as in ``pdserve generate``). Both see the
same random prompts of exactly ``--prompt-len`` tokens and produce exactly ``--new`` tokens.
Beside them, the engine's host time per decode step (``host ms``: step wall time minus the
model's forward and LM head, :mod:`bench.host_time`) over ``--new`` steps of the same batch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.host_time import measure_host_time
from bench.random_prompts import prompts
from engine.builtin.tiny_model import write_tiny_model
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.device import dtype_name, resolve_device, resolve_dtype
from engine.llm_engine import LLMEngine, Prompt


def _engine(model_dir: Path, device: str, dtype: str) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(num_pages=2048, page_size=16, max_num_seqs=256,
                                             max_num_batched_tokens=4096, device=device,
                                             dtype=dtype))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_ours(engine: LLMEngine, ids: list[list[int]], new: int) -> float:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate([Prompt(token_ids=p) for p in ids], params)  # warm-up (and graph capture)
    _sync(engine.device)
    start = time.perf_counter()
    results = engine.generate([Prompt(token_ids=p) for p in ids], params)
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == new for r in results)
    return len(ids) * new / elapsed


def run_transformers(model_dir: Path, ids: list[list[int]], new: int, device: torch.device,
                     dtype: torch.dtype) -> float:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    model.to(device)
    batch = torch.tensor(ids, device=device)
    kwargs = {"max_new_tokens": new, "eos_token_id": None, "do_sample": False,
              "pad_token_id": 0, "attention_mask": torch.ones_like(batch)}
    with torch.inference_mode():
        model.generate(input_ids=batch[:1], **{**kwargs, "attention_mask": batch[:1] * 0 + 1})
        _sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=batch, **kwargs)
        _sync(device)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == batch.shape[1] + new
    return len(ids) * new / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a fresh tiny model)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--dtype", default="float32",
                        help="auto, float32, bfloat16 or float16")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_tiny_model(Path(tmp) / "tiny")
        vocab = json.loads((model_dir / "config.json").read_text())
        vocab = (vocab.get("text_config") or vocab)["vocab_size"]
        rows = []
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            ids = prompts(bs, args.prompt_len, vocab)
            engine = _engine(model_dir, str(device), dtype_name(dtype))
            ours = run_ours(engine, ids, args.new)
            host = measure_host_time(engine, ids, args.new)
            del engine
            ref = run_transformers(model_dir, ids, args.new, device, dtype)
            rows.append({"batch": bs, "pdserve_tok_s": round(ours, 1),
                         "transformers_tok_s": round(ref, 1), "ratio": round(ours / ref, 2),
                         "host_ms": round(host.host_ms, 3)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'batch':>5} {'pdserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} "
          f"{'host ms':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['pdserve_tok_s']:>14} {r['transformers_tok_s']:>19} "
              f"{r['ratio']:>6} {r['host_ms']:>8}")


if __name__ == "__main__":
    main()
