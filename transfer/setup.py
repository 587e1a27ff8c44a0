"""Building a node's KV manager: pick the backend, register the pool and an aux buffer once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from transfer.aux import AuxBuffer
from transfer.base import KVManager
from transfer.errors import TransferError
from transfer.tp.staging import HeadStaging

if TYPE_CHECKING:
    from engine.kv.pool import BufferInfo

BACKENDS = ("mooncake", "ascend")


def make_kv_manager(
    backend: str,
    kv: Sequence[BufferInfo],
    *,
    hidden_size: int,
    aux_rows: int,
    hostname: str,
    staging: HeadStaging | None = None,
    states: Sequence[BufferInfo] = (),
    silent_peer_s: float | None = None,
) -> KVManager:
    """A manager of ``backend`` with ``kv``, a fresh aux buffer, ``staging`` (the buffer
    head-sliced sends gather into, :mod:`transfer.plan.heads`) and a hybrid model's state
    entries ``states`` (:mod:`transfer.plan.states`) registered. ``silent_peer_s`` (a node
    that receives KV, the decode): its transfer connections drop a peer silent that long
    (:mod:`transfer.backends.keepalive`)."""
    manager: KVManager
    if backend == "mooncake":
        from transfer.backends.mooncake import MooncakeKVManager

        manager = MooncakeKVManager(hostname=hostname, kv_device=kv[0].device if kv else "",
                                    silent_peer_s=silent_peer_s)
    elif backend == "ascend":
        from transfer.backends.ascend import AscendKVManager

        manager = AscendKVManager(hostname=hostname)
    else:
        raise TransferError(f"unknown transfer backend {backend!r}; choose from {BACKENDS}")
    manager.register(kv, AuxBuffer(aux_rows, hidden_size), staging=staging, states=states)
    return manager
