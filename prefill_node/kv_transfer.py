"""A prefill's side of the KV transfer: its KV managers (each rank's pool registered, with a
staging buffer for decodes of larger TP) and the KV heads it describes to decodes.

A decode rank that holds a slice of a prefill rank's heads gets it gathered into that rank's
staging buffer and written as whole destination pages (:mod:`transfer.plan.heads`). An EAGLE draft's
band is split over the ranks like the target's layers (:mod:`engine.parallel.rank`), so its entries
are staged and sliced like any other.

With ``--tp-size N`` every rank holds its heads of every page in its own process: each other
rank registers them with a transfer engine of its own and writes them on rank 0's word
(:class:`PrefillRankTransfer`, the engine's attach hook, starts its
:class:`~transfer.tp.rank_agent.RankAgent`; rank 0 holds a
:class:`~transfer.tp.rank_agent.RemoteRank` for it, :func:`remote_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import TextConfig
from engine.device import dtype_name
from engine.kv.pool import KVPool
from engine.kv.staging import HeadStagingBuffer
from engine.kv.state_pool import StatePool
from serving.process_exit import keep_until_exit
from transfer.base import KVManager
from transfer.bootstrap.messages import RankBuffers, decode, encode
from transfer.errors import TransferError
from transfer.plan.heads import HeadLayout
from transfer.setup import make_kv_manager
from transfer.tp.rank_agent import RankAgent, RemoteRank

STAGING_BYTES = 32 << 20  # two 16 MiB halves: one gathered round while the other is written
AUX_ROWS = 4


def prefill_manager(backend: str, pools: Sequence[KVPool], *, hidden_size: int,
                    hostname: str, states: StatePool | None = None,
                    silent_peer_s: float | None = None) -> KVManager:
    """A KV manager of ``backend`` with ``pools``' entries registered (the target's, then a
    draft's when it runs one), a staging buffer over them and a hybrid model's state entries
    (``states``); its transfer connections drop a decode silent for ``silent_peer_s`` (the
    handshake's peer timeout: :mod:`transfer.backends.keepalive`). Its engine lives until the
    process exits (:mod:`serving.process_exit`)."""
    buffers = [b for pool in pools for b in pool.buffer_infos()]
    staging = HeadStagingBuffer([e for pool in pools for e in pool.entries()], STAGING_BYTES)
    manager = make_kv_manager(backend, buffers, hidden_size=hidden_size, aux_rows=AUX_ROWS,
                              hostname=hostname, staging=staging,
                              states=states.buffer_infos() if states is not None else (),
                              silent_peer_s=silent_peer_s)
    keep_until_exit(manager)
    return manager


def prefill_heads(text: TextConfig, pool: KVPool, tp_size: int = 1) -> HeadLayout:
    """The KV heads a prefill describes: ``text``'s over its ``tp_size`` ranks (``pool`` is
    rank 0's: its dtype and page size)."""
    return HeadLayout.tensor_parallel(text.num_key_value_heads, tp_size,
                                      head_dim=text.head_dim, dtype=dtype_name(pool.dtype),
                                      page_size=pool.page_size)


@dataclass(frozen=True)
class PrefillRankTransfer:
    """The attach hook of a prefill's TP ranks (:data:`engine.parallel.rank.RankAttach`): a KV
    manager of ``backend`` on ``hostname`` with the rank's pools and a staging buffer registered,
    and the agent that writes on rank 0's word (``authkey`` proves rank 0); returns the rank's
    :class:`~transfer.bootstrap.messages.RankBuffers`, encoded. Both live until the process
    exits."""

    backend: str
    hostname: str
    hidden_size: int
    authkey: bytes = field(repr=False)
    silent_peer_s: float | None = None  # the managers' transfer keepalive (prefill_manager)

    def __call__(self, pools: Sequence[KVPool], rank: int, states: StatePool | None) -> bytes:
        manager = prefill_manager(self.backend, pools, hidden_size=self.hidden_size,
                                  hostname=self.hostname, states=states,
                                  silent_peer_s=self.silent_peer_s)
        agent = RankAgent(manager, self.authkey)
        keep_until_exit(agent)
        return encode(agent.buffers())


def remote_ranks(payloads: list[bytes], authkey: bytes) -> list[RemoteRank]:
    """Rank 0's stand-ins for ranks ``1..``, from what their hooks returned, connected."""
    out = []
    for rank, payload in enumerate(payloads, 1):
        buffers = decode(payload)
        if not isinstance(buffers, RankBuffers):
            raise TransferError(f"prefill rank {rank} reported no registration of its KV")
        out.append(RemoteRank(rank, buffers, authkey))
    return out
