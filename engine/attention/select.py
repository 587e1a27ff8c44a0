"""Which attention backend a KV pool gets.

CUDA with Triton installed: :class:`~engine.attention.triton_backend.TritonPagedAttention` (paged
reads through the page table, CUDA-graph capturable). Everything else, NPU included, and CUDA
without Triton: :class:`~engine.attention.backend.TorchPagedAttention`, the reference. An NPU kernel
(``torch_npu``'s fused attention) is not built: no NPU has been available to check one against
the reference.
"""

from __future__ import annotations

import importlib.util

from engine.attention.backend import AttentionBackend, TorchPagedAttention
from engine.kv.pool import KVPool


def backend_name(pool: KVPool) -> str:
    """``"triton"`` or ``"torch"``: what :func:`make_attention` builds for ``pool``."""
    if pool.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def make_attention(pool: KVPool) -> AttentionBackend:
    """The attention backend for ``pool``'s device (see the module docstring)."""
    if backend_name(pool) == "triton":
        from engine.attention.triton_backend import TritonPagedAttention  # CUDA installs only

        return TritonPagedAttention(pool)
    return TorchPagedAttention(pool)
