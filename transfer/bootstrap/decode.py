"""The decode side of the handshake: one connection to one prefill node's bootstrap endpoint.

Threads: one reader of the prefill's messages and one sweeper that sends heartbeats and enforces
the bootstrap, waiting, heartbeat and quarantine timeouts. The decode scheduler calls
:meth:`add_room`, :meth:`send_destination` (pages it reserved; an aux slot is taken here),
:meth:`poll`, then :meth:`commit` on ``Success`` (the pages become the request's) or
:meth:`release` on ``Failed``.

Ownership invariant: between ``send_destination`` and ``commit``/``release`` the client owns the
room's pages and aux slot. A released failed room's pages go back through ``free_pages`` only
once the prefill has said it will write no more (a quiesced ``Status``, ``Abort`` or
``AbortAck``), or after ``quarantine_s`` without such word and, if the prefill has gone
silent and the manager bounds how late a stalled write can land (``KVManager.late_write_s``),
once it was silent for that long: a write stalled by a partition never lands in pages given
to another request.

Landing (``landing=(buffer, slot)``, :mod:`transfer.plan.heads`): the prefill ranks each hold
exactly a slice of this rank's heads, so they write whole pages into landing entries: those of
``slot`` (a prefill process serving one rank), or, with ``slot`` None, one slot per prefill rank
that writes here (a TP prefill behind one endpoint; the registration carries every slot). The
client takes one landing page per destination page in ``send_destination`` (from
``landing_pages`` when clients share the buffer), scatters them into the room's pages when
``Success`` arrives (no write is in flight then) and frees them at once; a failed room's landing
pages are freed with its pages.

Tensor-parallel decode (``rank``): every rank's KV lives in its own process and its own transfer
engine, but rank 0 runs every handshake. It registers each other rank with a client of its own,
given that rank's :class:`~transfer.bootstrap.messages.Registration` (which the rank's process
built): the prefill writes into that rank's engine directly, and such a client sends only
destinations without the aux row (``aux=False``), which rank 0's client of the same prefill holds.
Such a client's landing buffer lives in the rank's process too (:mod:`decode_node.rank_landing`).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer.aux import AuxBuffer, AuxRow
from transfer.base import KVManager
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.bootstrap.messages import (
    Abort,
    AbortAck,
    Destination,
    Heartbeat,
    HeartbeatAck,
    Message,
    RegisterReply,
    Registration,
    Status,
)
from transfer.bootstrap.prefill import NO_AUX_SLOT
from transfer.bootstrap.wire import FramedSocket, tune
from transfer.errors import IncompatiblePeerError, MessageError, PageListError, TransferError
from transfer.faults import make_injector
from transfer.status import KVPoll, advance
from transfer.tp.staging import HeadLanding, LandingPages


@dataclass(eq=False)
class _Room:
    """Decode-side state of one room (guarded by the client lock)."""

    room: int
    created: float
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    pages: list[int] | None = None
    aux_slot: int | None = None
    sent_at: float = 0.0
    failed_at: float = 0.0
    quiesced: bool = False  # the prefill will write nothing more into the pages
    released: bool = False  # the scheduler gave the room up
    expects_aux: bool = True  # False: a pipeline stage that finishes without an aux row
    landing: list[int] | None = None  # landing pages the prefill writes instead of ``pages``


class DecodeBootstrapClient:
    """A decode node's registered connection to one prefill bootstrap endpoint."""

    def __init__(
        self,
        manager: KVManager,
        identity: ModelIdentity,
        prefill_address: tuple[str, int],
        free_pages: Callable[[list[int]], None],
        *,
        config: BootstrapConfig | None = None,
        landing: tuple[HeadLanding, int | None] | None = None,
        rank: Registration | None = None,
        landing_pages: LandingPages | None = None,
    ) -> None:
        """Connect and register; raises :class:`IncompatiblePeerError` if refused.

        ``landing``: the landing buffer and the slot this prefill's slice lands in, or None for
        every slot (one per prefill rank that fills a slice of this rank's heads, see the
        module docstring); None when the prefill writes into the pool pages. ``landing_pages``:
        the buffer's free pages when other clients share them (default: this client's own).
        ``rank``: another TP rank's registration, sent instead of ``manager``'s (see the module
        docstring)."""
        self.manager = manager
        self.config = config or BootstrapConfig()
        if manager.faults is None:  # one injector per manager, shared by its clients
            manager.faults = make_injector(self.config.faults)
        self._free_pages = free_pages
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._stop = threading.Event()
        self._alive = True
        self._last_ack = time.monotonic()
        self._seq = 0
        aux = manager.aux
        if aux is None:
            raise TransferError("the decode manager has no aux buffer")
        self._aux: AuxBuffer = aux
        self._landing = landing
        self._landing_pages = landing_pages or LandingPages(
            landing[0].num_pages if landing is not None else 0)
        sock = socket.create_connection(prefill_address, timeout=self.config.connect_timeout_s)
        tune(sock, self.config.peer_timeout_s)
        self._sock = FramedSocket(sock)
        if rank is not None and landing is not None:  # the rank's own landing entries
            infos = landing[0].buffer_infos(landing[1])
            rank = dataclasses.replace(
                rank, landing_ptrs=[b.ptr for b in infos],
                landing_bytes_per_page=[b.bytes_per_page for b in infos],
                landing_num_pages=landing[0].num_pages)
        self._remote_rank = rank is not None
        reg = dataclasses.replace(rank, auth_token=self.config.secret or "") if rank else \
            manager.registration(
                page_size=identity.page_size, dtype=identity.dtype,
                model_fingerprint=identity.model_fingerprint,
                auth_token=self.config.secret or "", heads=identity.heads,
                tp_rank=identity.tp_rank,
                landing=landing[0].buffer_infos(landing[1]) if landing is not None else (),
                states=identity.states,
            )
        self._num_pages = reg.num_pages
        self.tp_rank = reg.tp_rank
        try:
            self._sock.send(reg)
            reply = self._sock.recv()
        except (OSError, MessageError) as exc:
            self._sock.close()
            raise TransferError(f"bootstrap registration failed: {exc}") from exc
        if not isinstance(reply, RegisterReply) or not reply.ok:
            self._sock.close()
            reason = reply.reason if isinstance(reply, RegisterReply) else type(reply).__name__
            raise IncompatiblePeerError(f"prefill refused the registration: {reason}")
        flat = reply.prefill_head_ranges
        # the prefill's KV heads over its TP ranks, as (start, count) (empty: it says nothing)
        self.prefill_ranges = tuple((flat[k], flat[k + 1]) for k in range(0, len(flat) - 1, 2))
        # the layers the prefill writes (a pipeline stage writes its own only; None: unknown)
        self._prefill_layers = set(reply.prefill_layer_ids) or None
        sock.settimeout(None)
        self._threads = [
            threading.Thread(target=self._read_loop, name="bootstrap-read", daemon=True),
            threading.Thread(target=self._sweep_loop, name="bootstrap-sweep", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- scheduler API -------------------------------------------------------------------

    @property
    def num_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    @property
    def free_landing_pages(self) -> list[int]:
        """The landing pages no room holds (empty without landing)."""
        return self._landing_pages.free

    @property
    def alive(self) -> bool:
        """False once the prefill is known dead (closed connection or missed heartbeats)."""
        with self._lock:
            return self._alive

    def add_room(self, room: int) -> None:
        """Track ``room`` from the moment the request arrives (``Bootstrapping``)."""
        with self._lock:
            if room in self._rooms:
                raise TransferError(f"room {room} is already live on this decode")
            self._rooms[room] = _Room(room, time.monotonic())
            if not self._alive:
                self._fail(self._rooms[room], "prefill peer is dead")

    def send_destination(self, room: int, pages: Sequence[int], *, aux: bool = True,
                         cached_pages: int = 0, state_slot: int = -1) -> None:
        """Hand the room's reserved pages to the client and tell the prefill where to write.

        ``cached_pages``: how many of the prompt's first pages this decode holds already (its
        prefix cache); ``pages`` are the destinations of the prompt's pages after those.
        ``state_slot``: a hybrid model's state slot the prompt's final linear-attention states
        go into (the caller's, held as the pages are: until :meth:`commit`, or until the pages
        come back after :meth:`release`); -1 without states.

        Takes an aux slot. From here the client owns ``pages`` until :meth:`commit` or
        :meth:`release`. Raises if no aux slot is free (the pages stay the caller's).

        ``aux=False`` (a pipeline stage that does not own the aux row): no slot is taken, the
        prefill is told :data:`NO_AUX_SLOT`, ``Success`` needs no aux row and the room is
        finished with :meth:`commit_without_aux`.
        """
        page_list = [int(p) for p in pages]
        if not all(0 <= p < self._num_pages for p in page_list):
            raise PageListError(f"destination pages outside 0..{self._num_pages - 1}")
        if aux and self._remote_rank:
            raise TransferError(f"decode rank {self.tp_rank}'s client sends no aux slot: "
                                "rank 0's client of the same prefill holds it")
        with self._lock:
            r = self._room(room)
            if r.pages is not None or r.status is not KVPoll.Bootstrapping:
                raise TransferError(f"room {room} is {r.status.name}; cannot send a destination")
            landing = None
            if self._landing is not None:
                landing = self._landing_pages.take(len(page_list))
                if landing is None:
                    raise TransferError(f"{len(page_list)} pages but fewer free landing pages "
                                        "on the decode")
            slot = self._aux.alloc() if aux else NO_AUX_SLOT
            if slot is None:
                if landing:
                    self._landing_pages.give(landing)
                raise TransferError("no free aux slot on the decode")
            r.pages, r.aux_slot, r.expects_aux = page_list, (slot if aux else None), aux
            r.landing = landing
            r.sent_at = time.monotonic()
            r.status = advance(r.status, KVPoll.WaitingForInput)
            msg = Destination(room, list(r.pages), slot, cached_pages, list(r.landing or []),
                              state_slot)
        self._send(msg)

    def poll(self, room: int) -> KVPoll:
        with self._lock:
            return self._room(room).status

    def failure_reason(self, room: int) -> str:
        with self._lock:
            return self._room(room).reason

    def commit(self, room: int) -> AuxRow:
        """Take a ``Success`` room's aux row; its pages now belong to the caller."""
        with self._lock:
            r = self._room(room)
            if r.status is not KVPoll.Success or r.aux_slot is None:
                raise TransferError(f"room {room} is {r.status.name}, not Success")
            row = self._aux.read(r.aux_slot)
            self._aux.free(r.aux_slot)
            del self._rooms[room]
            return row

    def commit_without_aux(self, room: int) -> None:
        """Take a ``Success`` room sent with ``aux=False``; its pages now belong to the caller."""
        with self._lock:
            r = self._room(room)
            if r.status is not KVPoll.Success or r.expects_aux:
                raise TransferError(f"room {room} is {r.status.name} and expects an aux row "
                                    f"{r.expects_aux}: not a Success room without aux")
            del self._rooms[room]

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        """Fail ``room`` here and tell the prefill (which answers ``AbortAck``)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.is_terminal:
                return
            self._fail(r, reason)
            notify = r.pages is not None
        if notify:
            self._send(Abort(room, reason))

    def release(self, room: int) -> None:
        """Give up a ``Failed`` room; its pages and slot are freed once safe."""
        with self._lock:
            r = self._room(room)
            if r.status is not KVPoll.Failed:
                raise TransferError(f"room {room} is {r.status.name}; only Failed rooms release")
            r.released = True
            self._collect(r, time.monotonic())

    def close(self) -> None:
        """Stop the threads and close the connection."""
        self._stop.set()
        self._sock.close()
        for t in self._threads:
            t.join(timeout=2)

    # ---- internals (call with the lock held unless named otherwise) ----------------------

    def _room(self, room: int) -> _Room:
        r = self._rooms.get(room)
        if r is None:
            raise TransferError(f"unknown room {room}")
        return r

    def _fail(self, r: _Room, reason: str) -> None:
        if r.status is not KVPoll.Failed:
            r.reason = reason
            r.failed_at = time.monotonic()
        r.status = KVPoll.Failed
        if r.pages is None:
            r.quiesced = True  # the prefill never learnt where to write

    def _collect(self, r: _Room, now: float) -> None:
        """Free a released failed room once the prefill is quiet, or once the quarantine
        passed and, if the prefill has gone silent (no word for a heartbeat interval: a
        partition, or a dead prefill), no write stalled by that silence can still land: the
        manager's transfer connections drop a peer silent for ``late_write_s``
        (:mod:`transfer.backends.keepalive`), and the prefill's data went silent no later
        than a heartbeat interval after its last word here (on a live link another word comes
        every interval)."""
        if not r.released:
            return
        if not r.quiesced:
            if now - r.failed_at < self.config.quarantine_s:
                return
            late, beat = self.manager.late_write_s, self.config.heartbeat_interval_s
            silent = now - self._last_ack
            if late is not None and beat + self.config.tick_s < silent < late + beat:
                return
        del self._rooms[r.room]
        if r.aux_slot is not None:
            self._aux.free(r.aux_slot)
        self._free_landing(r)
        if r.pages:
            self._free_pages(r.pages)

    def _free_landing(self, r: _Room) -> None:
        if r.landing:
            self._landing_pages.give(r.landing)
        r.landing = None

    def _land(self, r: _Room) -> bool:
        """Scatter a successful room's landing pages into its pages, then free them. A scatter
        that fails (another rank's landing agent gone or refusing) fails the room instead: the
        prefill has finished writing, so its pages wait only for the release."""
        if self._landing is not None and r.landing and r.pages is not None:
            buf, slot = self._landing
            try:
                buf.scatter(r.landing, r.pages, slot, self._prefill_layers)
            except TransferError as exc:
                self._fail(r, f"landing the prefill's pages failed: {exc}")
                r.quiesced = True
                return False
        self._free_landing(r)
        return True

    def _send(self, msg: Message) -> None:
        if self.manager.faults is not None and not self.manager.faults.outgoing([msg]):
            return  # fault injection: dropped
        try:
            self._sock.send(msg)
        except OSError:
            self._peer_dead("lost the prefill connection")

    def _read_loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._handle(self._sock.recv())
        except (OSError, MessageError) as exc:
            if not self._stop.is_set():
                self._peer_dead(f"lost the prefill connection: {exc}")

    def _handle(self, msg: Message) -> None:
        with self._lock:
            self._last_ack = time.monotonic()
            if isinstance(msg, HeartbeatAck):
                return
            if not isinstance(msg, (Status, Abort, AbortAck)):
                raise MessageError(f"unexpected {type(msg).__name__} from a prefill")
            r = self._rooms.get(msg.room)
            if r is None:
                return
            if isinstance(msg, Status) and msg.status == KVPoll.Success:
                self._on_success(r)
            elif isinstance(msg, Status):
                self._fail(r, f"prefill failed the room: {msg.reason}")
                r.quiesced = r.quiesced or msg.quiesced
            else:
                reason = msg.reason if isinstance(msg, Abort) else r.reason
                self._fail(r, f"aborted by prefill: {reason}")
                r.quiesced = True
            self._collect(r, time.monotonic())

    def _on_success(self, r: _Room) -> None:
        if r.status is not KVPoll.Failed and r.pages is not None and not r.expects_aux:
            if self._land(r):
                r.status = advance(r.status, KVPoll.Success)  # no aux row to check
            return
        if r.status is KVPoll.Failed or r.aux_slot is None:
            r.quiesced = True  # the prefill has finished writing
            return
        echoed = self._aux.read(r.aux_slot).room
        if echoed != r.room:
            self._fail(r, f"aux row corrupt: room {echoed} echoed for room {r.room}")
            r.quiesced = True
            return
        if self._land(r):
            r.status = advance(r.status, KVPoll.Success)

    def _peer_dead(self, reason: str) -> None:
        """Fail every unfinished room (their pages wait out the quarantine) and drop the
        connection: nothing more is sent to a dead prefill."""
        with self._lock:
            self._alive = False
            for r in list(self._rooms.values()):
                if not r.status.is_terminal:
                    self._fail(r, reason)
        self._sock.abort()

    def _sweep_loop(self) -> None:
        cfg = self.config
        next_beat = 0.0
        while not self._stop.wait(cfg.tick_s):
            now = time.monotonic()
            if self._alive and now >= next_beat:
                self._seq += 1
                self._send(Heartbeat(self._seq))
                next_beat = now + cfg.heartbeat_interval_s
            aborts = []
            with self._lock:
                dead = self._alive and now - self._last_ack > cfg.peer_timeout_s
                for r in list(self._rooms.values()):
                    late = now - r.created > cfg.bootstrap_timeout_s
                    if r.status is KVPoll.Bootstrapping and late:
                        self._fail(r, "bootstrap timeout: no destination was sent")
                    elif (r.status is KVPoll.WaitingForInput
                          and now - r.sent_at > cfg.waiting_timeout_s):
                        self._fail(r, "waiting timeout: the prefill never finished")
                        aborts.append(Abort(r.room, "waiting timeout"))
                    self._collect(r, now)
            if dead:
                self._peer_dead("prefill heartbeat timeout")
            for a in aborts:
                self._send(a)
