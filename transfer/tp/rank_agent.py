"""The other ranks of a tensor-parallel prefill in the P/D transfer.

Every rank holds its own key/value heads of every page, in its own process, registered with a
transfer engine of its own; only that engine can write them out. Rank 0 runs the bootstrap
endpoint and every room, and has each other rank write its heads on its word:

- in the rank's process, :class:`RankAgent` serves
  :class:`~transfer.bootstrap.messages.SendOrder` s from rank 0 over a local connection with a
  shared key (:mod:`transfer.tp.local_agent`) and answers each with a
  :class:`~transfer.bootstrap.messages.SendReply` once the write returned;
- on rank 0, :class:`RemoteRank` stands for that rank: its buffers, as the handshake checks them
  (:class:`transfer.bootstrap.handshake.SourceRank`), and ``send_kvcache`` with the keywords the
  bootstrap server passes, which orders the write and raises the error class the rank's manager
  raised (an :class:`~transfer.errors.EngineCallError` when bytes may have landed, another
  :class:`~transfer.errors.TransferError` when nothing moved). A rank that cannot be reached
  (its process died) raises ``EngineCallError``: what it had in flight is unknown.

One order at a time per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from transfer import errors
from transfer.aux import AuxBuffer
from transfer.base import KVManager, SendResult
from transfer.bootstrap.messages import RankBuffers, SendOrder, SendReply, decode
from transfer.errors import EngineCallError, MessageError, TransferError
from transfer.plan.heads import HeadCopy
from transfer.plan.states import StateCopy
from transfer.tp.local_agent import AgentLink, AgentServer

_ERRORS: dict[str, type[errors.TransferError]] = {
    name: cls for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, errors.TransferError)}


class RankAgent:
    """In a non-zero rank's process: serve rank 0's send orders with ``manager``."""

    def __init__(self, manager: KVManager, authkey: bytes) -> None:
        self.manager = manager
        self.port = AgentServer(authkey, self._run, "rank-agent").port

    def buffers(self) -> RankBuffers:
        """What rank 0 needs of this rank (its registration and this agent's port)."""
        m = self.manager
        return RankBuffers(m.session_id, list(m.kv_ptrs), list(m.kv_bytes_per_page),
                           list(m.kv_layer_ids or []), m.num_pages, m.has_staging, self.port,
                           list(m.state_layer_ids), list(m.state_bytes_per_slot))

    def _run(self, data: bytes) -> SendReply:
        try:
            order = decode(data)
        except MessageError as exc:
            return SendReply(False, "MessageError", str(exc), 0, 0, 0)
        if not isinstance(order, SendOrder):
            return SendReply(False, "MessageError",
                             f"expected a SendOrder, got {type(order).__name__}", 0, 0, 0)
        try:
            heads = HeadCopy(*order.heads) if order.heads else None
            states = order.src_state_slot >= 0
            r = self.manager.send_kvcache(
                order.session_id, order.src_pages, order.dst_ptrs, order.dst_pages,
                dst_layer_ids=order.dst_layer_ids or None,
                dst_bytes_per_page=order.dst_bytes_per_page or None, dst_heads=heads,
                **(_state_keywords(order) if states else {}))
        except TransferError as exc:
            return SendReply(False, type(exc).__name__, str(exc), 0, 0, 0)
        except (TypeError, ValueError) as exc:  # a malformed order: nothing moved
            return SendReply(False, "TransferError", f"{type(exc).__name__}: {exc}", 0, 0, 0)
        return SendReply(True, "", "", r.blocks, r.batches, r.nbytes)


def _state_keywords(order: SendOrder) -> dict[str, Any]:
    """``send_kvcache``'s state keywords as a :class:`SendOrder` carries them."""
    return {"src_state_slot": order.src_state_slot, "dst_state_ptrs": order.dst_state_ptrs,
            "dst_state_slot": order.dst_state_slot,
            "dst_state_layer_ids": order.dst_state_layer_ids,
            "dst_state_bytes_per_slot": order.dst_state_bytes_per_slot,
            "dst_state_copy": StateCopy.from_list(order.state_copy) if order.state_copy
            else None}


class RemoteRank:
    """On rank 0: prefill rank ``rank``, described by its :class:`RankBuffers`, written
    through its agent (see the module docstring)."""

    aux: AuxBuffer | None = None  # rank 0 writes the aux rows
    # called after every send as a manager calls it: (bytes moved, seconds, whether it worked)
    on_send: Callable[[int, float, bool], None] | None = None

    def __init__(self, rank: int, buffers: RankBuffers, authkey: bytes) -> None:
        self.rank = rank
        self.session_id = buffers.session_id
        self.kv_ptrs = list(buffers.kv_ptrs)
        self.kv_bytes_per_page = list(buffers.kv_bytes_per_page)
        self.kv_layer_ids: list[int] | None = list(buffers.kv_layer_ids) or None
        self.num_pages = buffers.num_pages
        self.has_staging = buffers.has_staging
        self.state_layer_ids = list(buffers.state_layer_ids)
        self.state_bytes_per_slot = list(buffers.state_bytes_per_slot)
        self._link = AgentLink(buffers.agent_port, authkey, f"prefill rank {rank}")

    def send_kvcache(
        self, session: str, src_pages: Sequence[int], dst_ptrs: Sequence[int],
        dst_pages: Sequence[int], *, dst_layer_ids: Sequence[int] | None = None,
        dst_bytes_per_page: Sequence[int] | None = None, dst_heads: HeadCopy | None = None,
        src_state_slot: int | None = None, dst_state_ptrs: Sequence[int] | None = None,
        dst_state_slot: int | None = None, dst_state_layer_ids: Sequence[int] | None = None,
        dst_state_bytes_per_slot: Sequence[int] | None = None,
        dst_state_copy: StateCopy | None = None,
    ) -> SendResult:
        """The rank's :meth:`KVManager.send_kvcache` with these arguments, run in its process."""
        heads = [] if dst_heads is None else [
            dst_heads.dst_rank, dst_heads.src_head, dst_heads.dst_head, dst_heads.count,
            dst_heads.src_heads, dst_heads.dst_heads, dst_heads.page_size]
        order = SendOrder(
            session, [int(p) for p in src_pages], list(dst_ptrs), [int(p) for p in dst_pages],
            list(dst_layer_ids or []), list(dst_bytes_per_page or []), heads,
            -1 if src_state_slot is None else src_state_slot, list(dst_state_ptrs or []),
            -1 if dst_state_slot is None else dst_state_slot, list(dst_state_layer_ids or []),
            list(dst_state_bytes_per_slot or []),
            dst_state_copy.to_list() if dst_state_copy is not None else [])
        start = time.perf_counter()
        try:
            reply = self._link.call(order, gone=EngineCallError)
            if not isinstance(reply, SendReply):
                raise EngineCallError(f"prefill rank {self.rank} answered "
                                      f"{type(reply).__name__}")
            if not reply.ok:  # an error class this side does not know may have moved bytes
                error = _ERRORS.get(reply.error, EngineCallError)
                raise error(f"prefill rank {self.rank}: {reply.reason}")
        except EngineCallError:
            self._report(0, start, False)  # an engine failure, as a manager reports it
            raise
        self._report(reply.nbytes, start, True)
        return SendResult(reply.blocks, reply.batches, reply.nbytes)

    def _report(self, nbytes: int, start: float, ok: bool) -> None:
        if self.on_send is not None:
            self.on_send(nbytes, time.perf_counter() - start, ok)

    def close(self) -> None:
        self._link.close()
