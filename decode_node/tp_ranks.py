"""A tensor-parallel decode's other ranks in the P/D transfer: each registers its own share of
the KV (its key/value heads of every page) with a transfer engine of its own, in its own
process; rank 0 runs every handshake for them (:mod:`transfer.bootstrap.decode`).

:class:`RankTransfer` is the engine's attach hook (:data:`engine.parallel.rank.RankAttach`): it runs
in each rank's process once its pools exist, starts the rank's landing agent
(:mod:`decode_node.rank_landing`) and returns that rank's registration and the agent's port.
Rank 0 completes the registration with what both sides must agree on
(:func:`rank_registrations`) and connects to the agents (:func:`landing_agents`).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_node.rank_landing import LandingAgent, RankLandingAgent
from engine.kv.pool import KVPool
from engine.kv.state_pool import StatePool
from serving.process_exit import keep_until_exit
from transfer.bootstrap.handshake import ModelIdentity
from transfer.bootstrap.messages import Registration, decode, encode
from transfer.errors import MessageError, TransferError
from transfer.setup import make_kv_manager

_PORT = struct.Struct("<I")  # a rank's payload: its agent's port, then its registration


@dataclass(frozen=True)
class RankTransfer:
    """The attach hook of a decode's TP ranks: a KV manager of ``backend`` on ``hostname`` with
    the rank's pools registered (the target's, then a draft's, and its state pool's entries)
    and a one-row aux buffer of
    ``hidden_size`` (the registration needs one; the prefill writes the aux row into rank 0's
    only), and the rank's landing agent (``authkey`` proves rank 0). Both live until the
    rank's process exits."""

    backend: str
    hostname: str
    hidden_size: int
    authkey: bytes = field(repr=False)
    silent_peer_s: float | None = None  # the manager's transfer keepalive (make_kv_manager)

    def __call__(self, pools: Sequence[KVPool], rank: int, states: StatePool | None) -> bytes:
        manager = make_kv_manager(self.backend, [b for p in pools for b in p.buffer_infos()],
                                  hidden_size=self.hidden_size, aux_rows=1,
                                  hostname=self.hostname,
                                  states=states.buffer_infos() if states is not None else (),
                                  silent_peer_s=self.silent_peer_s)
        keep_until_exit(manager)
        agent = LandingAgent(pools, manager, self.authkey)
        keep_until_exit(agent)
        reg = manager.registration(page_size=0, dtype="", model_fingerprint="", tp_rank=rank)
        return _PORT.pack(agent.port) + encode(reg)


def _read(rank: int, payload: bytes) -> tuple[Registration, int]:
    """A rank's registration and agent port from what its hook returned."""
    try:
        (port,) = _PORT.unpack_from(payload)
        reg = decode(payload[_PORT.size :])
    except (struct.error, MessageError) as exc:
        raise TransferError(f"decode rank {rank} reported no registration of its KV") from exc
    if not isinstance(reg, Registration) or reg.tp_rank != rank:
        raise TransferError(f"decode rank {rank} reported no registration of its KV")
    return reg, port


def rank_registrations(payloads: list[bytes], identity: ModelIdentity) -> list[Registration]:
    """The registrations of ranks ``1..`` from what their hooks returned, completed with rank
    0's ``identity`` (model, page size, dtype, every rank's KV heads and state geometry)."""
    heads = identity.heads
    if payloads and heads is None:
        raise TransferError("a tensor-parallel decode must describe its KV heads")
    out = []
    for rank, payload in enumerate(payloads, 1):
        reg, _ = _read(rank, payload)
        assert heads is not None
        out.append(dataclasses.replace(
            reg, page_size=identity.page_size, dtype=identity.dtype,
            model_fingerprint=identity.model_fingerprint,
            kv_head_ranges=[x for pair in heads.ranges for x in pair],
            num_kv_heads=heads.num_kv_heads, head_dim=heads.head_dim,
            state_layout=identity.states.to_list() if identity.states is not None else []))
    return out


def landing_agents(payloads: list[bytes], authkey: bytes) -> list[RankLandingAgent]:
    """Rank 0's connections to the landing agents of ranks ``1..``."""
    out = []
    for rank, payload in enumerate(payloads, 1):
        reg, port = _read(rank, payload)
        out.append(RankLandingAgent(rank, port, authkey, reg.kv_layer_ids))
    return out
