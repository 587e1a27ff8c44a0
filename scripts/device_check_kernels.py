"""Section ``0_kernels`` of ``scripts/device_check.py``: the Triton paged attention equals the
torch reference backend on the device, compiled (the CPU tests run it interpreted).

Shapes are Qwen2-VL-2B's attention (12 query heads over 2 KV heads, head size 128, pages of 16
tokens); batches cover a ragged prefill, a mixed prefill + decode step, a pure decode batch and
verify windows of 4; float32 and bfloat16. Both backends start from the same pool contents; the
K/V they write must be byte-equal and the outputs close.
"""

from __future__ import annotations

from typing import Any

import torch
from device_check_context import Context

from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.kv.pool import KVPool

HEADS, KV_HEADS, DIM, PAGE = 12, 2, 128, 16
NUM_PAGES = 4096
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
BATCHES: dict[str, tuple[list[int], list[int]]] = {  # name: (q_lens, kv_lens)
    "prefill_ragged": ([37, 200, 5], [37, 200, 5]),
    "mixed": ([64, 1, 1, 17], [300, 90, 1025, 17]),
    "decode": ([1] * 32, [(97 * i) % 2000 + 1 for i in range(32)]),
    "verify": ([4] * 8, [4 + 53 * i for i in range(8)]),
}


def _pools(device: str, dtype: torch.dtype) -> list[KVPool]:
    gen = torch.Generator(device=device).manual_seed(0)
    pools = [KVPool(NUM_PAGES, PAGE, KV_HEADS, DIM, [0], dtype, device) for _ in range(2)]
    for a, b in zip(pools[0].entries(), pools[1].entries(), strict=True):
        a.copy_(torch.randn(a.shape, generator=gen, device=device))
        b.copy_(a)
    return pools


def _batch(q_lens: list[int], kv_lens: list[int], device: str) -> AttentionBatch:
    order = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(1)).tolist()
    tables, slots = [], []
    for q, kv in zip(q_lens, kv_lens, strict=True):
        n = -(-kv // PAGE)
        pages, order = order[:n], order[n:]
        tables.append(pages)
        slots += [pages[i // PAGE] * PAGE + i % PAGE for i in range(kv - q, kv)]
    return AttentionBatch.from_lists(q_lens, kv_lens, tables, torch.tensor(slots, device=device))


def check_kernels(ctx: Context, res: dict[str, Any]) -> None:
    """Triton vs torch attention on ``ctx.device`` for every batch and dtype."""
    if not ctx.device.startswith("cuda"):
        res["ok"] = True
        res["summary"] = ("not run off CUDA: tests/engine/attention/test_attention_triton.py "
                          "checks the same kernels on the CPU under TRITON_INTERPRET=1")
        return
    from engine.attention.triton_backend import TritonPagedAttention

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (q_lens, kv_lens) in BATCHES.items():
            ref_pool, tri_pool = _pools(ctx.device, dtype)
            batch = _batch(q_lens, kv_lens, ctx.device)
            gen = torch.Generator(device=ctx.device).manual_seed(2)
            t = batch.num_tokens
            q, k, v = (torch.randn(t, h, DIM, generator=gen, device=ctx.device, dtype=dtype)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            outs = []
            for backend in (TorchPagedAttention(ref_pool), TritonPagedAttention(tri_pool)):
                backend.prepare(batch)
                outs.append(backend.forward(q, k, v, 0).float())
            ctx.sync()
            err = float((outs[0] - outs[1]).abs().max())
            same_kv = all(torch.equal(a, b) for a, b in zip(ref_pool.entries(),
                                                             tri_pool.entries(), strict=True))
            key = f"{name}_{str(dtype).removeprefix('torch.')}"
            results[key] = {"max_abs_err": err, "kv_equal": same_kv,
                            "ok": same_kv and err <= TOL[dtype]}
    res["cases"] = results
    bad = [k for k, r in results.items() if not r["ok"]]
    res["ok"] = not bad
    res["summary"] = (f"{len(results) - len(bad)}/{len(results)} attention cases match the torch "
                      f"backend" + (f"; failing: {', '.join(bad)}" if bad else ""))
