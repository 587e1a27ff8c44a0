"""Section ``g_warm_up`` of ``scripts/device_check.py``: after a worker's start-up warm-up
(:mod:`engine.runner.kernel_warmup`, and with graphs on the start-up capture), serving compiles
no Triton kernel.

For graphs on (a decode worker) and off (as a tensor-parallel or hybrid engine decodes), an
engine on the tiny checkpoint warms up; then prompts of 1 to 700 tokens in 256-token chunks and
a batch of 24 short prompts whose decodes end a step apart (batch sizes 24 down to 1) are
served. The paged-attention kernels' compiled variants are counted (Triton's per-device kernel
caches) before and after serving: the section is ok when serving added none. The CPU tests
check the same by launch keys under ``TRITON_INTERPRET=1``
(``tests/gpu_readiness/test_kernel_warmup.py``).
"""

from __future__ import annotations

from typing import Any

from device_check_context import Context

from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine, Prompt
from engine.runner.kernel_warmup import warm_kernels

KERNELS = ("_extend_kernel", "_decode_kernel", "_merge_kernel")
LENGTHS = (1, 3, 17, 100, 300, 700)
DECODERS = 24


def _compiled() -> int:
    """Compiled variants of the paged-attention kernels in this process, every device."""
    import engine.attention.kernels.paged_attention as pa

    return sum(len(caches[0]) for name in KERNELS
               for caches in getattr(pa, name).device_caches.values())


def _serve(engine: LLMEngine) -> None:
    engine.generate([Prompt(token_ids=[5 + i] * n) for i, n in enumerate(LENGTHS)],
                    SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.generate([Prompt(token_ids=[7, 8, 9, i + 1]) for i in range(DECODERS)],
                    SamplingParams(max_new_tokens=DECODERS, ignore_eos=True))
    for i in range(DECODERS):  # one request ends per step: every batch size once
        engine.add_request([7, 8, i + 1], sampling=SamplingParams(max_new_tokens=i + 1,
                                                                  ignore_eos=True))
    while engine.scheduler.has_unfinished():
        engine.step()


def check_warm_up(ctx: Context, res: dict[str, Any]) -> None:
    """Serving after the warm-up compiles nothing, graphs on and off."""
    if not ctx.device.startswith("cuda"):
        res["ok"] = True
        res["summary"] = ("not run off CUDA: tests/gpu_readiness/test_kernel_warmup.py checks "
                          "the launch keys on the CPU under TRITON_INTERPRET=1")
        return
    model_dir, _ = ctx.tiny()
    runs = {}
    for graphs in (True, False):
        engine = LLMEngine(model_dir, ctx.engine_config(
            num_pages=512, graphs=graphs, dtype="bfloat16", max_num_seqs=32,
            max_num_batched_tokens=256))
        warm = warm_kernels(engine)
        static = engine.runner.decode_graphs
        captured = static.capture_all() if static is not None else []
        before = _compiled()
        _serve(engine)
        ctx.sync()
        runs[f"graphs_{'on' if graphs else 'off'}"] = {
            "warm_up": warm.line(), "warm_up_s": round(warm.seconds, 2),
            "graphs_captured": len(captured), "compiled_while_serving": _compiled() - before}
        del engine
        ctx.free()
    res["runs"] = runs
    late = {k: r["compiled_while_serving"] for k, r in runs.items()
            if r["compiled_while_serving"]}
    res["ok"] = not late
    res["summary"] = ("serving compiled no kernel after the warm-up, graphs on and off"
                      if not late else f"serving still compiled kernels: {late}")
