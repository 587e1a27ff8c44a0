"""A prefill process's side of the KV transfer: its KV manager (the pool registered, with a
staging buffer for decodes of larger TP) and the KV heads it describes to decodes.

A prefill holds every KV head in one process (no TP here yet), so a decode with TP ``d`` takes
a slice of each page per rank: the prefill gathers the slice into the staging buffer and writes
whole destination pages (:mod:`transfer.heads`). A prefill with an EAGLE draft registers no
staging buffer (a decode does not run a draft beside TP yet), so it serves equal TP only.
"""

from __future__ import annotations

from engine.device import dtype_name
from engine.kv_cache import BufferInfo, KVPool
from engine.kv_staging import HeadStagingBuffer
from serving.process_exit import keep_until_exit
from transfer.base import KVManager
from transfer.heads import HeadLayout
from transfer.setup import make_kv_manager

STAGING_BYTES = 32 << 20  # two 16 MiB halves: one gathered round while the other is written
AUX_ROWS = 4


def prefill_manager(backend: str, pool: KVPool, buffers: list[BufferInfo], *,
                    hidden_size: int, hostname: str) -> KVManager:
    """A KV manager of ``backend`` with ``buffers`` registered (``pool``'s entries, then a
    draft's when it runs one), and a staging buffer over ``pool`` when ``buffers`` are the
    pool's alone. Its engine lives until the process exits (:mod:`serving.process_exit`)."""
    entries = pool.entries()
    staging = HeadStagingBuffer(entries, STAGING_BYTES) if len(buffers) == len(entries) else None
    manager = make_kv_manager(backend, buffers, hidden_size=hidden_size, aux_rows=AUX_ROWS,
                              hostname=hostname, staging=staging)
    keep_until_exit(manager)
    return manager


def prefill_heads(pool: KVPool) -> HeadLayout:
    """The KV heads a prefill describes: all of ``pool``'s, in one rank."""
    return HeadLayout.tensor_parallel(pool.num_kv_heads, 1, head_dim=pool.head_dim,
                                      dtype=dtype_name(pool.dtype), page_size=pool.page_size)
