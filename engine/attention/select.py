"""Which attention backend a KV pool gets.

CUDA with a Triton that loads: :class:`~engine.attention.triton_backend.TritonPagedAttention`
(paged reads through the page table, CUDA-graph capturable). Everything else, NPU included, and
CUDA without a usable Triton: :class:`~engine.attention.backend.TorchPagedAttention`, the
reference; on CUDA that fallback is logged once with the reason (Triton missing, or failing to
import: a broken install, or one built for another CUDA), since it also turns CUDA graphs off.
An NPU kernel (``torch_npu``'s fused attention) is not built: no NPU has been available to check
one against the reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging

from engine.attention.backend import AttentionBackend, TorchPagedAttention
from engine.kv.pool import KVPool

log = logging.getLogger(__name__)
TRITON_BACKEND = "engine.attention.triton_backend"


@functools.cache
def triton_problem() -> str | None:
    """Why the Triton attention cannot load in this process (None when it can); the first
    answer is kept."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    try:
        importlib.import_module(TRITON_BACKEND)
    except Exception as exc:  # noqa: BLE001 - any import failure means: use the reference
        return f"Triton does not load ({type(exc).__name__}: {exc})"
    return None


def backend_name(pool: KVPool) -> str:
    """``"triton"`` or ``"torch"``: what :func:`make_attention` builds for ``pool``."""
    if pool.device.type == "cuda" and triton_problem() is None:
        return "triton"
    return "torch"


def make_attention(pool: KVPool) -> AttentionBackend:
    """The attention backend for ``pool``'s device (see the module docstring)."""
    if pool.device.type == "cuda" and triton_problem() is not None:
        _warn_fallback(str(triton_problem()))
    if backend_name(pool) == "triton":
        from engine.attention.triton_backend import TritonPagedAttention  # CUDA installs only

        return TritonPagedAttention(pool)
    return TorchPagedAttention(pool)


@functools.cache
def _warn_fallback(problem: str) -> None:
    log.warning("CUDA attention falls back to the torch reference (slower, and no CUDA graphs): "
                "%s", problem)
