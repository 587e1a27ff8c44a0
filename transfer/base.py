"""The KV manager contract every transfer backend implements.

A manager owns the local side of the transfer: the KV buffer entries and aux buffer it registered
with its engine (once), and the push of pages into a peer's buffers. ``send_kvcache`` is defined
here, once, with one keyword signature; backends only supply the engine calls
(:meth:`KVManager._register_ranges`, :meth:`KVManager._write`). Every registered range carries
the device its bytes live on (:class:`~transfer.backends.memory.MemoryRange`): KV buffers wherever
the pool put them (host, GPU or NPU), the aux buffer always on the host. KV then moves device to
device and aux rows host to host, both through the same engine. Backends never override
``send_kvcache``, so a caller's keywords mean the same on every backend. Besides this project's
own keywords it takes those that callers written for SGLang's KV managers pass (``executor``,
``dst_device_kv_indices``, ``dst_kv_item_len``, ``dst_attn_tp_size``, see
:meth:`KVManager.send_kvcache`); any other keyword, a misspelled one included, is a
``TypeError`` naming it rather than silently dropped.

A hybrid model's linear-attention states are *state entries* beside the KV entries
(:mod:`transfer.plan.states`): registered with them, paired with the peer's by global layer id
by the same rule, and moved by the same ``send_kvcache`` (its ``*_state_*`` keywords: one slot
of every entry into the peer's reserved slot), in the same engine calls as the call's pages.

Invariant: every check (page lists, layer pairing, bytes per page) runs before the first byte
moves; a failure after that raises :class:`~transfer.errors.EngineCallError`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transfer.aux import AuxBuffer
from transfer.backends.memory import MemoryRange
from transfer.bootstrap.messages import Registration
from transfer.errors import EngineCallError, LayerPairingError, PageListError, TransferError
from transfer.faults import FaultInjector
from transfer.plan.blocks import as_page_list, batches, build_blocks, contiguous_runs
from transfer.plan.head_blocks import head_geometry, strided_blocks
from transfer.plan.heads import HeadCopy, HeadLayout
from transfer.plan.layers import check_bytes_per_page, pair_entries
from transfer.plan.states import StateCopy, StateLayout, entry_kinds, state_blocks
from transfer.tp.staged_send import send_staged
from transfer.tp.staging import HeadStaging

if TYPE_CHECKING:
    from engine.kv.pool import BufferInfo


@dataclass(frozen=True)
class SendResult:
    """What one send moved: engine blocks, engine calls and bytes."""

    blocks: int
    batches: int
    nbytes: int


class KVManager(ABC):
    """Local KV and aux buffers registered with a transfer engine, and the push into a peer."""

    def __init__(self, *, batch_limit: int = 1024) -> None:
        if batch_limit <= 0:
            raise ValueError(f"batch_limit must be positive, got {batch_limit}")
        self.batch_limit = batch_limit
        self.kv_ptrs: list[int] = []
        self.kv_bytes_per_page: list[int] = []
        self.kv_layer_ids: list[int] | None = None
        self.kv_devices: list[str] = []  # where each KV entry lives: "cpu", "cuda:N", "npu:N"
        self.num_pages = 0
        # state entries (hybrid models): one slot of each is bytes_per_slot at ptr + slot * it
        self.state_ptrs: list[int] = []
        self.state_bytes_per_slot: list[int] = []
        self.state_layer_ids: list[int] = []
        self.num_state_slots = 0
        self.aux: AuxBuffer | None = None
        self.staging: HeadStaging | None = None  # head-sliced sends gather here
        self._staging_lock = threading.Lock()  # one staged send at a time
        self._writer: ThreadPoolExecutor | None = None  # writes staged rounds (started lazily)
        self._registered = False
        self.faults: FaultInjector | None = None  # fault injection (tests): None when off
        # how long after its link went silent a stalled write into this node can still land
        # (None: unbounded, as long as the sender's kernel retransmits): the decode holds a
        # failed room's pages at least this long (transfer.backends.keepalive)
        self.late_write_s: float | None = None
        # called after every send with (bytes, seconds, ok): the node's transfer metrics
        self.on_send: Callable[[int, float, bool], None] | None = None

    @property
    def has_staging(self) -> bool:
        """Whether a staging buffer is registered (head-sliced sends gather into it)."""
        return self.staging is not None

    @property
    @abstractmethod
    def session_id(self) -> str:
        """This manager's engine address as peers name it (``host:port``)."""

    @abstractmethod
    def _register_ranges(self, ranges: list[MemoryRange]) -> None:
        """Register ``ranges`` with the engine, each as memory of its device; raise on failure.

        A range whose device the engine cannot register raises :class:`TransferError` before
        the first engine call.
        """

    @abstractmethod
    def _write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """One engine batch write of at most ``batch_limit`` blocks; returns 0 on success."""

    def register(
        self, kv: Sequence[BufferInfo], aux: AuxBuffer | None = None, *, use_layer_ids: bool = True,
        staging: HeadStaging | None = None, landing: Sequence[BufferInfo] = (),
        states: Sequence[BufferInfo] = (),
    ) -> None:
        """Register the KV buffer entries (and the aux buffer) with the engine, exactly once.

        Each entry is registered as memory of its ``device``; nothing is recorded unless every
        range registered. ``use_layer_ids=False`` publishes no layer ids, so pairing is
        positional. ``staging``: the buffer head-sliced sends into a destination rank that holds
        fewer heads gather into, ``landing``: the buffers source ranks that each hold part of
        this rank's heads write whole pages into (:mod:`transfer.plan.heads`); both registered with
        the entries. ``states``: a hybrid model's state entries (:mod:`transfer.plan.states`;
        ``bytes_per_page`` is bytes per slot), always published with their layer ids.
        """
        if self._registered:
            raise TransferError("buffers are already registered; a manager registers once")
        if not kv:
            raise TransferError("no KV buffer entries to register")
        ranges = [MemoryRange(b.ptr, b.nbytes, b.device) for b in kv]
        if aux is not None:  # aux rows are small per-room records the host reads and writes
            ranges.append(MemoryRange(aux.ptr, aux.nbytes))
        if staging is not None:
            ranges.append(MemoryRange(staging.ptr, staging.nbytes, staging.device))
        ranges.extend(MemoryRange(b.ptr, b.nbytes, b.device) for b in (*landing, *states))
        entry_kinds([b.layer_id for b in states])  # at most a conv and a recurrent entry each
        self._register_ranges(ranges)
        self.kv_ptrs = [b.ptr for b in kv]
        self.kv_bytes_per_page = [b.bytes_per_page for b in kv]
        self.kv_layer_ids = [b.layer_id for b in kv] if use_layer_ids else None
        self.kv_devices = [b.device for b in kv]
        self.num_pages = min(b.nbytes // b.bytes_per_page for b in kv)
        self.state_ptrs = [b.ptr for b in states]
        self.state_bytes_per_slot = [b.bytes_per_page for b in states]
        self.state_layer_ids = [b.layer_id for b in states]
        self.num_state_slots = min((b.nbytes // b.bytes_per_page for b in states), default=0)
        self.aux = aux
        self.staging = staging
        self._registered = True

    def register_landing(self, landing: Sequence[BufferInfo]) -> None:
        """Register landing entries (:mod:`transfer.plan.heads`) after :meth:`register`: a decode
        sizes them once it knows a prefill's TP layout."""
        if not self._registered:
            raise TransferError("register() the KV buffers before landing entries")
        self._register_ranges([MemoryRange(b.ptr, b.nbytes, b.device) for b in landing])

    def registration(self, *, page_size: int, dtype: str, model_fingerprint: str,
                     auth_token: str = "", heads: HeadLayout | None = None,
                     tp_rank: int = 0, landing: Sequence[BufferInfo] = (),
                     states: StateLayout | None = None) -> Registration:
        """The message a decode node publishes once per connection (``auth_token``: the
        cluster's internal shared secret, "" without one; ``heads``: the decode's KV heads over
        its TP ranks, of which this manager serves ``tp_rank``; ``landing``: the landing
        entries the prefill it registers with writes into, in KV entry order; ``states``: the
        geometry of its state entries over its TP ranks, None without any)."""
        aux = self._require_aux()
        ranges = [x for pair in heads.ranges for x in pair] if heads is not None else []
        return Registration(
            session_id=self.session_id,
            kv_ptrs=list(self.kv_ptrs),
            kv_bytes_per_page=list(self.kv_bytes_per_page),
            kv_layer_ids=list(self.kv_layer_ids or []),
            num_pages=self.num_pages,
            aux_ptr=aux.ptr,
            aux_row_bytes=aux.row_bytes,
            aux_num_rows=aux.num_rows,
            page_size=page_size,
            dtype=dtype,
            model_fingerprint=model_fingerprint,
            auth_token=auth_token,
            tp_rank=tp_rank,
            kv_head_ranges=ranges,
            num_kv_heads=heads.num_kv_heads if heads is not None else 0,
            head_dim=heads.head_dim if heads is not None else 0,
            landing_ptrs=[b.ptr for b in landing],
            landing_bytes_per_page=[b.bytes_per_page for b in landing],
            landing_num_pages=min((b.nbytes // b.bytes_per_page for b in landing), default=0),
            state_ptrs=list(self.state_ptrs),
            state_bytes_per_slot=list(self.state_bytes_per_slot),
            state_layer_ids=list(self.state_layer_ids),
            num_state_slots=self.num_state_slots,
            state_layout=states.to_list() if states is not None else [],
        )

    def send_kvcache(
        self,
        session: str,
        src_pages: Sequence[int],
        dst_ptrs: Sequence[int],
        dst_pages: Sequence[int],
        executor: Executor | None = None,
        *,
        dst_layer_ids: Sequence[int] | None = None,
        dst_bytes_per_page: Sequence[int] | None = None,
        dst_kv_item_len: int | None = None,
        dst_device_kv_indices: Sequence[int] | None = None,
        dst_attn_tp_size: int | None = None,
        dst_heads: HeadCopy | None = None,
        src_state_slot: int | None = None,
        dst_state_ptrs: Sequence[int] | None = None,
        dst_state_slot: int | None = None,
        dst_state_layer_ids: Sequence[int] | None = None,
        dst_state_bytes_per_slot: Sequence[int] | None = None,
        dst_state_copy: StateCopy | None = None,
    ) -> SendResult:
        """Write local pages ``src_pages`` into the peer's pages ``dst_pages`` of every entry.

        ``dst_ptrs`` are the peer's buffer entry base addresses, ``dst_layer_ids`` its global
        layer id per entry (paired with ours by id, in order of occurrence) and
        ``dst_bytes_per_page`` its bytes per page per entry (checked against ours when given).
        Runs of pages consecutive on both sides go as one block; all blocks go in as few engine
        calls as ``batch_limit`` allows.

        ``dst_heads``: the head slice this rank writes into the destination rank when the two
        sides differ in tensor-parallel size (:func:`transfer.plan.heads.plan_head_copies`); None or
        a whole copy is the plain page copy. A slice that is the destination's whole page is
        gathered into the registered staging buffer and goes page-sized, as many blocks as the
        plain copy; any other slice goes one block per token (see :mod:`transfer.plan.heads`). A
        slice that lands (``HeadCopy.lands``) goes page-sized as a plain send (no ``dst_heads``)
        into the destination's landing entries for it instead, which the destination scatters.
        ``dst_bytes_per_page`` are then the destination rank's (fewer or more heads per page).

        States (a hybrid model, :mod:`transfer.plan.states`): with ``src_state_slot``, slot
        ``src_state_slot`` of every local state entry goes into slot ``dst_state_slot`` of the
        peer's state entries ``dst_state_ptrs`` (global ids ``dst_state_layer_ids``, bytes per
        slot ``dst_state_bytes_per_slot``), paired by id as KV entries are, whole or, between
        sides of different TP size, ``dst_state_copy``'s spans; in the same engine calls as
        the pages (which may be none). Without ``src_state_slot`` no other state keyword may
        be given.

        The keywords of callers written for SGLang's KV managers:

        - ``executor`` (SGLang's fifth positional argument): ignored, writes here are
          synchronous; it must be ``None`` or a :class:`concurrent.futures.Executor`;
        - ``dst_kv_item_len``: the peer's bytes per page of every entry, checked like
          ``dst_bytes_per_page``;
        - ``dst_device_kv_indices``: ignored; the decode here keeps one page list per room,
          so its pages are ``dst_pages``;
        - ``dst_attn_tp_size``: must be ``None`` or 1; a head-sliced transfer is asked for with
          ``dst_heads``, which carries the ranges rather than a size.

        Any other keyword is a ``TypeError`` naming it.
        """
        del dst_device_kv_indices
        if executor is not None and not isinstance(executor, Executor):
            raise TypeError(
                f"send_kvcache: executor must be None or a concurrent.futures.Executor, got "
                f"{type(executor).__name__} (pass the destination arguments by keyword)"
            )
        if dst_attn_tp_size not in (None, 1):
            raise TransferError(
                f"send_kvcache: dst_attn_tp_size={dst_attn_tp_size} asks for a head-sliced "
                "transfer; pass the planned slice as dst_heads "
                "(transfer.plan.heads.plan_head_copies)"
            )
        if not self._registered:
            raise TransferError("register() the KV buffers before sending")
        state = self._state_blocks(src_state_slot, dst_state_ptrs, dst_state_slot,
                                   dst_state_layer_ids, dst_state_bytes_per_slot, dst_state_copy)
        src = as_page_list(src_pages, "src_pages")
        dst = as_page_list(dst_pages, "dst_pages")
        if src and max(src) >= self.num_pages:
            raise PageListError(f"source page {max(src)} is outside 0..{self.num_pages - 1}")
        pairs = pair_entries(self.kv_layer_ids, dst_layer_ids, len(self.kv_ptrs), len(dst_ptrs))
        if dst_heads is not None and not dst_heads.whole:
            if dst_kv_item_len is not None:
                dst_bytes_per_page = [dst_kv_item_len] * len(dst_ptrs)
            if not state[0]:
                return self._send_heads(session, src, dst, dst_ptrs, pairs, dst_heads,
                                        dst_bytes_per_page)
            start = time.perf_counter()  # the pages and the states: one send, one report
            try:
                sent = self._send_heads(session, src, dst, dst_ptrs, pairs, dst_heads,
                                        dst_bytes_per_page, report=False)
                more = self._write_blocks(session, *state, report=False)
            except EngineCallError:
                self._report(0, start, False)
                raise
            result = SendResult(sent.blocks + more.blocks, sent.batches + more.batches,
                                sent.nbytes + more.nbytes)
            self._report(result.nbytes, start, True)
            return result
        if dst_bytes_per_page is not None:
            if len(dst_bytes_per_page) != len(dst_ptrs):
                raise LayerPairingError(
                    f"{len(dst_bytes_per_page)} bytes-per-page values for {len(dst_ptrs)} "
                    "destination entries"
                )
            check_bytes_per_page(pairs, self.kv_bytes_per_page, dst_bytes_per_page)
        if dst_kv_item_len is not None:
            uniform = [dst_kv_item_len] * len(dst_ptrs)
            check_bytes_per_page(pairs, self.kv_bytes_per_page, uniform)
        runs = contiguous_runs(src, dst)
        srcs, dsts, lens = build_blocks(pairs, self.kv_ptrs, dst_ptrs, self.kv_bytes_per_page, runs)
        return self._write_blocks(session, srcs + state[0], dsts + state[1], lens + state[2])

    def _state_blocks(
        self, src_slot: int | None, dst_ptrs: Sequence[int] | None, dst_slot: int | None,
        dst_ids: Sequence[int] | None, dst_bytes: Sequence[int] | None, copy: StateCopy | None,
    ) -> tuple[list[int], list[int], list[int]]:
        """The blocks of a send's states (none without ``src_slot``); every check of
        :meth:`send_kvcache`'s state keywords, before a byte moves."""
        given = [dst_ptrs, dst_slot, dst_ids, dst_bytes, copy]
        if src_slot is None:
            if any(v is not None for v in given):
                raise TypeError("send_kvcache: state keywords without src_state_slot")
            return [], [], []
        if dst_ptrs is None or dst_slot is None or dst_ids is None or dst_bytes is None:
            raise TypeError("send_kvcache: src_state_slot needs dst_state_ptrs, "
                            "dst_state_slot, dst_state_layer_ids and dst_state_bytes_per_slot")
        if not self.state_ptrs:
            raise TransferError("no state entries were registered; register() them first")
        if not 0 <= src_slot < self.num_state_slots:
            raise PageListError(
                f"source state slot {src_slot} is outside 0..{self.num_state_slots - 1}")
        if dst_slot < 0:
            raise PageListError(f"destination state slot {dst_slot} is negative")
        if not len(dst_ptrs) == len(dst_ids) == len(dst_bytes):
            raise LayerPairingError(
                f"ragged destination states: {len(dst_ptrs)} entries, {len(dst_ids)} layer "
                f"ids, {len(dst_bytes)} sizes")
        pairs = pair_entries(self.state_layer_ids, dst_ids, len(self.state_ptrs), len(dst_ptrs))
        return state_blocks(pairs, entry_kinds(self.state_layer_ids), self.state_ptrs,
                            self.state_bytes_per_slot, src_slot, dst_ptrs, dst_bytes, dst_slot,
                            copy)

    def _send_heads(
        self, session: str, src: list[int], dst: list[int], dst_ptrs: Sequence[int],
        pairs: list[tuple[int, int]], copy: HeadCopy, dst_bpp: Sequence[int] | None,
        *, report: bool = True,
    ) -> SendResult:
        """A head-sliced send (``copy`` is not whole); every check runs before a byte moves.
        ``report``: tell ``on_send`` once for the send (the caller reports a send it is part
        of itself)."""
        if dst_bpp is not None and len(dst_bpp) != len(dst_ptrs):
            raise LayerPairingError(
                f"{len(dst_bpp)} bytes-per-page values for {len(dst_ptrs)} destination entries"
            )
        if len(src) != len(dst):
            raise PageListError(f"{len(src)} source pages but {len(dst)} destination pages")
        head_bytes, dst_page = head_geometry(pairs, self.kv_bytes_per_page, copy, dst_bpp)
        if not copy.dst_contiguous or not src:
            srcs, dsts, lens = strided_blocks(pairs, self.kv_ptrs, dst_ptrs,
                                              self.kv_bytes_per_page, dst_page, src, dst, copy,
                                              head_bytes)
            return self._write_blocks(session, srcs, dsts, lens, report=report)
        if self.staging is None:
            raise TransferError(
                f"a send of {copy.count} of {copy.src_heads} heads into a rank holding "
                f"{copy.dst_heads} needs a staging buffer; register() one"
            )
        start = time.perf_counter()
        with self._staging_lock:  # one send uses the staging buffer at a time
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-staged-write")
            try:
                parts = send_staged(
                    lambda s, d, n: self._write_blocks(session, s, d, n, report=False),
                    self.staging, self._writer, pairs, len(self.kv_ptrs), dst_ptrs, src, dst,
                    copy, dst_page)
            except EngineCallError:
                if report:
                    self._report(0, start, False)
                raise
        result = SendResult(blocks=sum(p.blocks for p in parts),
                            batches=sum(p.batches for p in parts),
                            nbytes=sum(p.nbytes for p in parts))
        if report:  # one report per send, as for the plain copy
            self._report(result.nbytes, start, True)
        return result

    def _report(self, nbytes: int, start: float, ok: bool) -> None:
        """Tell ``on_send`` of one send that began at ``start`` (``time.perf_counter()``)."""
        if self.on_send is not None:
            self.on_send(nbytes, time.perf_counter() - start, ok)

    def send_aux(self, session: str, src_slot: int, dst_aux_ptr: int, dst_row_bytes: int,
                 dst_slot: int) -> SendResult:
        """Write local aux row ``src_slot`` into the peer's aux row ``dst_slot``."""
        aux = self._require_aux()
        if dst_row_bytes != aux.row_bytes:
            raise TransferError(
                f"aux rows differ in size: local {aux.row_bytes}, peer {dst_row_bytes} bytes"
            )
        dst = dst_aux_ptr + dst_slot * dst_row_bytes
        return self._write_blocks(session, [aux.row_ptr(src_slot)], [dst], [aux.row_bytes])

    def _write_blocks(
        self, session: str, srcs: list[int], dsts: list[int], lens: list[int], *,
        report: bool = True,
    ) -> SendResult:
        """Write the blocks in batches; ``report``: tell ``on_send`` (the caller reports a send
        made of several of these itself)."""
        calls, start, nbytes = 0, time.perf_counter(), sum(lens)
        for part in batches(len(srcs), self.batch_limit):
            if self.faults is None:
                ret = self._write(session, srcs[part], dsts[part], lens[part])
            else:  # injected failures take the path of the engine's own errors
                ret = self.faults.write(self._write, session, srcs[part], dsts[part], lens[part])
            calls += 1
            if ret != 0:
                if report:
                    self._report(0, start, False)
                raise EngineCallError(
                    f"engine write to {session} failed with code {ret} "
                    f"(batch {calls}, {part.stop - part.start} blocks)"
                )
        if report:
            self._report(nbytes, start, True)
        return SendResult(blocks=len(srcs), batches=calls, nbytes=nbytes)

    def _require_aux(self) -> AuxBuffer:
        if self.aux is None:
            raise TransferError("no aux buffer was registered")
        return self.aux
