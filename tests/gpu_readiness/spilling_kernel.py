"""A kernel known to spill, to show the readiness check can fail: a float32 ``[64, 128]`` tile
multiplied by its ``[128, 64]`` transpose on FMA units (``ieee``), all of it held in registers.
Compiled only by ``compile_kernels.py``; never launched."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def spilling_kernel(x_ptr, y_ptr, M: tl.constexpr, K: tl.constexpr):  # type: ignore[no-untyped-def]
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    x = tl.load(x_ptr + m[:, None] * K + k[None, :])  # [M, K] f32
    y = tl.dot(x, tl.trans(x), input_precision="ieee")  # [M, M]
    tl.store(y_ptr + m[:, None] * M + m[None, :], y)
