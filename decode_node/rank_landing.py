"""Landing buffers on the other ranks of a tensor-parallel decode.

When several prefill ranks each hold a slice of one decode rank's heads (a prefill of larger
TP), they write whole pages into that rank's landing slots, which are scattered into its pool on
``Success`` (:mod:`decode_node.landing`). A rank's KV lives in its own process, registered with
its own transfer engine, so its landing buffers are made, registered and scattered there, on
rank 0's word:

- in the rank's process, :class:`LandingAgent` (started by the attach hook,
  :mod:`decode_node.tp_ranks`) serves :class:`~transfer.bootstrap.messages.LandingOrder` (make and
  register a buffer of those slices, once per slicing; answer its entries) and
  :class:`~transfer.bootstrap.messages.ScatterOrder` (scatter landing pages into pool pages) over a
  local connection with a shared key (:mod:`transfer.tp.local_agent`);
- on rank 0, :class:`RankLandingAgent` is that rank's agent, and :meth:`~RankLandingAgent.landing`
  returns a :class:`RemoteLanding`: the :class:`~transfer.tp.staging.HeadLanding` a bootstrap
  client lands into, whose scatter runs in the rank's process and returns once done (the room
  is ready only after that).

One order at a time per rank.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.kv.pool import BufferInfo, KVPool
from engine.kv.staging import HeadLandingBuffer
from transfer.base import KVManager
from transfer.bootstrap.messages import (
    LandingOrder,
    LandingReply,
    Message,
    ScatterOrder,
    ScatterReply,
    decode,
)
from transfer.errors import MessageError, TransferError
from transfer.tp.local_agent import AgentLink, AgentServer


class LandingAgent:
    """In a non-zero decode rank's process: make, register (with ``manager``) and scatter
    landing buffers over ``pools``' entries (the target's, then a draft's) on rank 0's word."""

    def __init__(self, pools: Sequence[KVPool], manager: KVManager, authkey: bytes) -> None:
        self.entries = [e for pool in pools for e in pool.entries()]
        self.layer_ids = [i for pool in pools for i in pool.entry_layer_ids()]
        self.device = str(self.entries[0].device)
        self.manager = manager
        self._buffers: list[HeadLandingBuffer] = []
        self._made: dict[tuple[tuple[tuple[int, int], ...], int], int] = {}
        self.port = AgentServer(authkey, self._run, "landing-agent").port

    def _run(self, data: bytes) -> Message:
        try:
            order = decode(data)
        except MessageError as exc:
            return ScatterReply(f"MessageError: {exc}")
        if isinstance(order, LandingOrder):
            return self._landing(order)
        if isinstance(order, ScatterOrder):
            return self._scatter(order)
        return ScatterReply(f"expected a LandingOrder or ScatterOrder, got {type(order).__name__}")

    def _landing(self, order: LandingOrder) -> LandingReply:
        flat = order.slices
        slices = tuple((flat[k], flat[k + 1]) for k in range(0, len(flat) - 1, 2))
        key = (slices, order.num_pages)
        if key not in self._made:
            try:
                buffer = HeadLandingBuffer(self.entries, self.layer_ids, slices, order.num_pages)
                self.manager.register_landing(buffer.buffer_infos())
            except (TransferError, ValueError) as exc:
                return LandingReply(-1, [], [], self.device, f"{type(exc).__name__}: {exc}")
            self._made[key] = len(self._buffers)
            self._buffers.append(buffer)
        landing_id = self._made[key]
        infos = self._buffers[landing_id].buffer_infos()
        return LandingReply(landing_id, [b.ptr for b in infos], [b.bytes_per_page for b in infos],
                            self.device, "")

    def _scatter(self, order: ScatterOrder) -> ScatterReply:
        if not 0 <= order.landing_id < len(self._buffers):
            return ScatterReply(f"no landing buffer {order.landing_id}")
        try:
            self._buffers[order.landing_id].scatter(
                order.landing_pages, order.pages, None if order.slot < 0 else order.slot,
                set(order.layer_ids) or None)
        except (IndexError, ValueError, RuntimeError) as exc:
            return ScatterReply(f"{type(exc).__name__}: {exc}")
        return ScatterReply("")


class RankLandingAgent:
    """On rank 0: decode rank ``rank``'s :class:`LandingAgent` at ``port`` (its KV entries carry
    ``layer_ids``)."""

    def __init__(self, rank: int, port: int, authkey: bytes, layer_ids: Sequence[int]) -> None:
        self.rank = rank
        self.layer_ids = list(layer_ids)
        self._link = AgentLink(port, authkey, f"decode rank {rank}'s landing agent")

    def landing(self, slices: Sequence[tuple[int, int]], num_pages: int) -> RemoteLanding:
        """The rank's landing buffer of ``num_pages`` pages with a slot per slice of its heads,
        made and registered there the first time; ``TransferError`` when it could not be."""
        reply = self.call(LandingOrder([x for s in slices for x in s], num_pages))
        if not isinstance(reply, LandingReply) or reply.reason:
            why = reply.reason if isinstance(reply, LandingReply) else type(reply).__name__
            raise TransferError(f"decode rank {self.rank} made no landing buffer: {why}")
        infos = [BufferInfo(ptr, per_page * num_pages, per_page, lid, reply.device)
                 for ptr, per_page, lid in zip(reply.landing_ptrs, reply.landing_bytes_per_page,
                                               self.layer_ids * len(slices), strict=True)]
        return RemoteLanding(self, reply.landing_id, num_pages, infos, len(slices))

    def call(self, order: LandingOrder | ScatterOrder) -> Message:
        """Send ``order`` and wait for the answer; ``TransferError`` when the agent is gone."""
        return self._link.call(order)

    def close(self) -> None:
        self._link.close()


class RemoteLanding:
    """A landing buffer in another decode rank's process (a
    :class:`~transfer.tp.staging.HeadLanding`): ``infos`` are its entries, slot by slot."""

    def __init__(self, agent: RankLandingAgent, landing_id: int, num_pages: int,
                 infos: list[BufferInfo], num_slots: int) -> None:
        self._agent, self._id = agent, landing_id
        self._infos, self._per_slot = infos, len(infos) // num_slots
        self._num_pages = num_pages

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def buffer_infos(self, slot: int | None = None) -> list[BufferInfo]:
        if slot is None:
            return list(self._infos)
        return self._infos[slot * self._per_slot : (slot + 1) * self._per_slot]

    def scatter(self, landing_pages: Sequence[int], pages: Sequence[int],
                slot: int | None = None, layer_ids: Collection[int] | None = None) -> None:
        """Scatter in the rank's process; ``TransferError`` when it failed there."""
        reply = self._agent.call(ScatterOrder(
            self._id, [int(p) for p in landing_pages], [int(p) for p in pages],
            -1 if slot is None else slot, sorted(layer_ids or ())))
        if not isinstance(reply, ScatterReply) or reply.reason:
            why = reply.reason if isinstance(reply, ScatterReply) else type(reply).__name__
            raise TransferError(f"decode rank {self._agent.rank} did not scatter: {why}")
