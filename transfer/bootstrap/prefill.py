"""The prefill side of the handshake: the bootstrap endpoint and per-room sending.

Threads: one accepting connections, one reader per decode connection, one sweeper enforcing the
bootstrap timeout and the heartbeat deadline, and a pool of room writers running the chunks'
writes (so a write stalled by a partition does not hold its caller past its room's failure).
The prefill scheduler calls :meth:`add_room`, :meth:`poll` (the gate: compute only once it says
``WaitingForInput``), :meth:`send_chunk`, :meth:`abort` and, once a room is terminal,
:meth:`release`.

A decode with tensor-parallel ranks registers once per rank (one connection each, its
``Registration.tp_rank``) and sends each room's destination over every one of them: the same
pages, the aux slot on rank 0's only. A room here has one *target* per decode rank and is
``WaitingForInput`` once every rank's destination arrived; each chunk goes into every target
(from each prefill rank that holds some of that rank's heads, its slice of them:
:func:`transfer.bootstrap.handshake.plan_sends`), the aux row into the target holding the slot.

Invariants: the final word on a room (``Status``, ``Abort`` or ``AbortAck``) is sent to each
target exactly once and only when no write into the room is in flight; a room that failed cannot
start another write; a room the scheduler never claimed is dropped by the sweeper once it fails.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from transfer.aux import AuxRow
from transfer.base import KVManager
from transfer.bootstrap.handshake import (
    BootstrapConfig,
    ModelIdentity,
    RankSender,
    check_token,
    landing_slot,
    plan_sends,
    plan_state_sends,
)
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
from transfer.bootstrap.wire import FramedSocket, tune
from transfer.errors import EngineCallError, MessageError, TransferError
from transfer.faults import make_injector
from transfer.plan.heads import HeadCopy
from transfer.plan.states import StateCopy
from transfer.status import KVPoll, advance

NO_AUX_SLOT = -1  # Destination.aux_slot of a room this prefill finishes without an aux row
# threads that run send_chunk's writes: a write stalled on a partitioned decode holds one until
# the transfer engine's own timeout (Mooncake: MC_TRANSFER_TIMEOUT) ends it
ROOM_WRITERS = 16
AUX_WRITERS = 4  # threads that write aux rows, each beside its chunk's pages


@dataclass(eq=False)
class _Conn:
    """One registered decode connection (one rank of the decode) and what each prefill rank
    writes into it: ``(rank, head slice)``, the slice None for whole pages."""

    sock: FramedSocket
    reg: Registration
    last_seen: float
    sends: list[tuple[int, HeadCopy | None]] = field(default_factory=list)
    # what each prefill rank writes of its linear-attention states into it: (rank, copy)
    state_sends: list[tuple[int, StateCopy]] = field(default_factory=list)
    alive: bool = True

    @property
    def lands(self) -> bool:
        """Pages go whole into the decode's landing entries (``Destination.landing_pages``):
        one prefill rank writes a slice of the rank's heads (:func:`plan_sends`)."""
        return bool(self.reg.landing_ptrs) and any(c is not None for _, c in self.sends)

    @property
    def decode_tp(self) -> int:
        """The TP size of the decode this rank belongs to (1 when it describes no heads)."""
        return max(1, len(self.reg.kv_head_ranges) // 2)


@dataclass(frozen=True)
class _Job:
    """One write of one prefill rank into one decode rank: its KV send (the index into
    ``conn.sends``; None: states only) and its state copy (None: no states)."""

    conn: _Conn
    dest: Destination
    cursor: int
    send: int | None
    states: StateCopy | None


@dataclass(eq=False)
class _Chunk:
    """One :meth:`PrefillBootstrapServer.send_chunk` call's writes, run on a room writer
    thread: into each target (its connection, destination and the room's cursor) the source
    pages, then (``state_slot``) a hybrid model's states, then the aux row ``last``."""

    room: _Room
    writes: list[tuple[_Conn, Destination, int]]
    src: list[int]
    last: AuxRow | None
    finish: bool
    aux_to: list[_Target]
    state_slot: int | None
    done: bool = False  # the writes ended and the room's outcome is recorded (lock held)
    crash: Exception | None = None  # an error that is not a TransferError

    @property
    def ends(self) -> bool:
        """The room's last chunk: ``Status(Success)`` follows it."""
        return self.last is not None or self.finish


@dataclass(eq=False)
class _Target:
    """One decode rank's part of a room: its connection, its destination (None when it aborted
    before sending one) and its final word."""

    conn: _Conn
    dest: Destination | None = None
    peer_aborted: bool = False  # that rank sent Abort: answer AbortAck
    final_sent: bool = False
    outbox: list[Message] = field(default_factory=list)


@dataclass(eq=False)
class _Room:
    """Prefill-side state of one room (guarded by the server lock)."""

    room: int
    created: float
    claimed: bool  # the scheduler called add_room (and will call release)
    status: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    targets: dict[int, _Target] = field(default_factory=dict)  # by decode TP rank
    cursor: int = 0  # destination pages already written
    skip: int = 0  # source pages still to drop: the decode holds them (Destination.cached_pages)
    inflight: int = 0  # send_chunk calls in progress
    quiesced: bool = True  # no failed engine call may still land bytes
    aborted_here: bool = False  # the scheduler called abort(): tell the decode Abort

    def ready(self) -> list[_Target]:
        """The targets that have a destination, once every rank of the decode sent one (else
        empty)."""
        dests = [t for t in self.targets.values() if t.dest is not None]
        if not dests or len(dests) < dests[0].conn.decode_tp:
            return []
        return dests


class PrefillBootstrapServer:
    """Bootstrap endpoint of a prefill node, bound to ``host:port`` (port 0: any free port).

    ``ranks``: a tensor-parallel prefill's other ranks, ``ranks[i]`` is rank ``i + 1``
    (:class:`transfer.tp.rank_agent.RemoteRank`); each writes its heads into the decode ranks that
    hold them (:func:`transfer.bootstrap.handshake.plan_sends`), ``manager`` (rank 0) the aux
    rows."""

    def __init__(
        self,
        manager: KVManager,
        identity: ModelIdentity,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: BootstrapConfig | None = None,
        ranks: Sequence[RankSender] = (),
    ) -> None:
        self.manager = manager
        self.identity = identity
        self._ranks: list[RankSender] = [manager, *ranks]
        self._writers: ThreadPoolExecutor | None = None  # the ranks' writes of one chunk
        self.config = config or BootstrapConfig()
        if manager.faults is None:  # the manager's writes and this endpoint's sends share it
            manager.faults = make_injector(self.config.faults)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a room failed, or a write ended
        self._room_writers: ThreadPoolExecutor | None = None  # send_chunk's writes
        # aux rows, written beside their chunk's pages (never waiting on anything else)
        self._aux_writers = ThreadPoolExecutor(AUX_WRITERS, "bootstrap-aux-write")
        self._writing = 0  # chunks submitted to the room writers and not ended
        self._rooms: dict[int, _Room] = {}
        self._conns: list[_Conn] = []
        self._refused: tuple[float, str] | None = None  # (when, why) of the last refused decode
        # source pages dropped because the decode had them cached, and their bytes
        self.pages_not_sent = 0
        self.bytes_not_sent = 0
        self._stop = threading.Event()
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(self.config.tick_s * 4)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="bootstrap-accept", daemon=True),
            threading.Thread(target=self._sweep_loop, name="bootstrap-sweep", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- scheduler API -------------------------------------------------------------------

    @property
    def num_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def add_room(self, room: int) -> None:
        """Claim ``room`` for a request; its destination may already have arrived."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                self._rooms[room] = _Room(room, time.monotonic(), claimed=True)
            elif r.claimed:
                raise TransferError(f"room {room} is already claimed")
            else:
                r.claimed = True

    @property
    def writes_in_flight(self) -> int:
        """Chunks whose writes have not ended: each holds a room writer thread (a write stalled
        by a partition holds it until the transfer engine ends the write)."""
        with self._lock:
            return self._writing

    def poll(self, room: int) -> KVPoll:
        """The room's status; compute may start once it is ``WaitingForInput`` or later."""
        with self._lock:
            return self._room(room).status

    def failure_reason(self, room: int) -> str:
        with self._lock:
            return self._room(room).reason

    def send_chunk(
        self, room: int, src_pages: Sequence[int], *, last: AuxRow | None = None,
        finish: bool = False, state_slot: int | None = None,
    ) -> KVPoll:
        """Write the room's next ``len(src_pages)`` prompt pages (in prompt order, from the
        first) to their destination pages.

        The first ``Destination.cached_pages`` prompt pages are not written: the decode holds
        them already (delta transfer). So callers pass every page of the prompt, cached or not.

        Pass the aux row as ``last`` on the last chunk: it is written beside the pages, and
        ``Status(Success)`` follows both (the decode reads the row only then). A pipeline stage
        that does not own the aux row (its destination's slot is :data:`NO_AUX_SLOT`) passes
        ``finish=True`` instead: its last chunk is followed by ``Status(Success)`` with no aux
        row written. Returns the room's
        status afterwards (``Failed`` when the room failed before or during the write).

        A write that stalls (a partitioned decode) returns ``Failed`` as soon as the room fails
        (the decode's heartbeat timeout, an abort); the write goes on on its own thread until
        the transfer engine ends it, and only then is the room's final word sent. What it may
        still land on the decode is the decode's quarantine's business
        (:mod:`transfer.bootstrap.decode`).

        ``state_slot`` (a hybrid model, on the last chunk only): the request's state slot here;
        its final linear-attention states go into the decode's ``Destination.state_slot`` with
        the chunk's pages, before the aux row. A decode that registered state entries gets no
        ``Success`` without them.
        """
        src = [int(p) for p in src_pages]
        with self._lock:
            r = self._room(room)
            if r.status is KVPoll.Failed:
                return r.status
            targets = r.ready()
            if not targets:
                raise TransferError(f"room {room} has no destination yet: poll() gates compute")
            drop = min(r.skip, len(src))
            r.skip -= drop
            self.pages_not_sent += drop
            self.bytes_not_sent += drop * sum(sum(t.conn.reg.kv_bytes_per_page) for t in targets)
            src = src[drop:]
            if not src and last is None and not finish:
                return r.status
            dest = _dest(targets[0])
            if r.cursor + len(src) > len(dest.pages):
                self._fail(r, f"{r.cursor + len(src)} pages sent, destination has "
                              f"{len(dest.pages)}", quiesced=True)
                return self._finish_locked(r)
            aux_to = [t for t in targets if _dest(t).aux_slot != NO_AUX_SLOT]
            if last is not None and not aux_to:
                self._fail(r, "the decode asked for no aux row from this prefill", quiesced=True)
                return self._finish_locked(r)
            problem = _state_problem(targets, state_slot, last is not None or finish)
            if problem:
                self._fail(r, problem, quiesced=True)
                return self._finish_locked(r)
            writes = [(t.conn, _dest(t), r.cursor) for t in targets]
            r.cursor += len(src)
            r.inflight += 1
            r.status = advance(r.status, KVPoll.Transferring)
            if self._room_writers is None:
                self._room_writers = ThreadPoolExecutor(ROOM_WRITERS, "bootstrap-room-write")
            job = _Chunk(r, writes, src, last, finish, aux_to,
                         state_slot if last is not None or finish else None)
            self._writing += 1
            self._room_writers.submit(self._write_chunk, job)
            # the write may stall (a partitioned decode): a room that fails meanwhile (the
            # peer's heartbeat timeout, an abort) returns at once, its write goes on alone
            while not job.done and r.status is not KVPoll.Failed:
                self._changed.wait()
            if job.crash is not None:
                raise job.crash
            return r.status

    def _write_chunk(self, job: _Chunk) -> None:
        """One :meth:`send_chunk`'s writes, on a room writer thread (lock not held): pages and
        states, and beside them (on an aux writer: one round trip less on a path with latency)
        the aux row, which the decode reads only once ``Status(Success)`` came, sent after
        both; then the room's outcome, and its final word once no write into it is in flight.
        An error other than a :class:`TransferError` (a bug) fails the room and is raised
        again by the send_chunk that waits for it."""
        r, errors = job.room, []
        aux: Future[None] | None = None
        if job.last is not None:  # beside the pages: Status, sent after both, tells the decode
            to = job.aux_to[0]
            aux = self._aux_writers.submit(self._send_aux, to.conn.reg, _dest(to).aux_slot,
                                           dataclasses.replace(job.last, room=r.room))
        try:
            if job.src or job.state_slot is not None:
                self._write_ranks(job.writes, job.src, job.state_slot)
        except Exception as exc:
            errors.append(exc)
        if aux is not None and aux.exception() is not None:
            errors.append(cast(Exception, aux.exception()))
        crashes = [e for e in errors if not isinstance(e, TransferError)]
        job.crash = crashes[0] if crashes else None  # handed to the waiting caller, never lost
        # an EngineCallError first: bytes may have landed
        error = next((e for e in errors if isinstance(e, EngineCallError)),
                     errors[0] if errors else None)
        with self._lock:
            r.inflight -= 1
            self._writing -= 1
            if job.crash is not None:
                self._fail(r, f"transfer failed: {job.crash!r}", quiesced=False)
            elif error is not None:
                self._fail(r, f"transfer failed: {error}", not isinstance(error, EngineCallError))
            elif job.ends and r.status is not KVPoll.Failed:
                r.status = advance(r.status, KVPoll.Success)
            self._finish_locked(r)
            job.done = True
            self._changed.notify_all()

    def _write_ranks(self, writes: list[tuple[_Conn, Destination, int]], src: list[int],
                     state_slot: int | None = None) -> None:
        """Write ``src`` (and, with ``state_slot``, the states of that slot) into every decode
        rank of ``writes`` (its connection, destination and the room's cursor), each prefill
        rank's share on a thread of its own when several write; returns once every write
        returned, raising the first error (an :class:`EngineCallError` first: bytes may have
        landed)."""
        jobs: dict[int, list[_Job]] = {}
        for conn, dest, cursor in writes:
            states = dict(conn.state_sends) if state_slot is not None else {}
            for slot, (rank, _) in enumerate(conn.sends):
                jobs.setdefault(rank, []).append(_Job(conn, dest, cursor, slot,
                                                      states.pop(rank, None)))
            for rank, copy in states.items():  # ranks that write states only
                jobs.setdefault(rank, []).append(_Job(conn, dest, cursor, None, copy))
        if len(jobs) == 1:
            ((rank, mine),) = jobs.items()
            self._write_rank(rank, mine, src, state_slot)
            return
        if self._writers is None:
            self._writers = ThreadPoolExecutor(len(self._ranks), "bootstrap-rank-write")
        futures = [self._writers.submit(self._write_rank, rank, mine, src, state_slot)
                   for rank, mine in jobs.items()]
        failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
        if failures:
            raise next((e for e in failures if isinstance(e, EngineCallError)), failures[0])

    def _write_rank(self, rank: int, jobs: list[_Job], src: list[int],
                    state_slot: int | None) -> None:
        """Prefill rank ``rank``'s writes of ``src`` into decode ranks (each with the index of
        its send there): their destination pages from the cursor on, or the pages of its
        landing slot (whole pages of its heads, a plain copy); a job with a state copy also
        writes slot ``state_slot``'s states, one without a send index only them."""
        sender = self._ranks[rank]
        for job in jobs:
            reg, dest, cursor = job.conn.reg, job.dest, job.cursor
            states: dict[str, Any] = {}
            if job.states is not None:
                states = {"src_state_slot": state_slot, "dst_state_ptrs": reg.state_ptrs,
                          "dst_state_slot": dest.state_slot,
                          "dst_state_layer_ids": reg.state_layer_ids,
                          "dst_state_bytes_per_slot": reg.state_bytes_per_slot,
                          "dst_state_copy": job.states}
            pages = src if job.send is not None else []
            heads = job.conn.sends[job.send][1] if job.send is not None else None
            if job.conn.lands and job.send is not None:
                land = landing_slot(reg, job.send)
                sender.send_kvcache(
                    reg.session_id, pages, land.landing_ptrs,
                    dest.landing_pages[cursor : cursor + len(pages)],
                    dst_layer_ids=reg.kv_layer_ids or None,
                    dst_bytes_per_page=land.landing_bytes_per_page, **states,
                )
            else:
                sender.send_kvcache(
                    reg.session_id, pages, reg.kv_ptrs, dest.pages[cursor : cursor + len(pages)],
                    dst_layer_ids=reg.kv_layer_ids or None,
                    dst_bytes_per_page=reg.kv_bytes_per_page, dst_heads=heads, **states,
                )

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        """Fail ``room``; the decode hears ``Abort`` once no write into it is in flight."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.status.is_terminal:
                return
            r.aborted_here = True
            self._fail(r, reason, quiesced=True)
            self._finish_locked(r)

    def release(self, room: int) -> None:
        """Drop a terminal room the scheduler is done with."""
        with self._lock:
            r = self._room(room)
            if not r.status.is_terminal:
                raise TransferError(f"room {room} is {r.status.name}; abort it before release")
            del self._rooms[room]

    def close(self) -> None:
        """Stop the threads and close every connection."""
        self._stop.set()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.sock.close()
        for t in self._threads:
            t.join(timeout=2)
        for pool in (self._room_writers, self._writers, self._aux_writers):
            if pool is not None:
                pool.shutdown(wait=True)

    # ---- internals (call with the lock held unless named otherwise) ----------------------

    def _room(self, room: int) -> _Room:
        r = self._rooms.get(room)
        if r is None:
            raise TransferError(f"unknown room {room}")
        return r

    def _fail(self, r: _Room, reason: str, quiesced: bool) -> None:
        if r.status is not KVPoll.Failed:
            r.reason = reason
        r.status = KVPoll.Failed
        r.quiesced = r.quiesced and quiesced
        self._changed.notify_all()  # a send_chunk waiting on the room's write returns

    def _finish_locked(self, r: _Room) -> KVPoll:
        """Queue the room's final word to each target once it is terminal and quiet; flush
        the targets' outboxes."""
        quiet = r.status.is_terminal and r.inflight == 0
        for t in r.targets.values():
            if quiet and not t.final_sent:
                t.final_sent = True
                if t.peer_aborted:
                    t.outbox.append(AbortAck(r.room))
                elif r.aborted_here:
                    t.outbox.append(Abort(r.room, r.reason))
                else:
                    t.outbox.append(Status(r.room, int(r.status), r.reason, r.quiesced))
            if t.outbox and t.conn.alive:
                msgs = list(t.outbox)
                t.outbox.clear()
                threading.Thread(target=self._send_all, args=(t.conn, msgs), daemon=True).start()
        if not r.claimed and r.status is KVPoll.Failed and r.inflight == 0:
            self._rooms.pop(r.room, None)
        return r.status

    def _send_all(self, conn: _Conn, msgs: list[Message]) -> None:
        """Send outside the lock; a dead socket is the reader's and sweeper's business."""
        if self.manager.faults is not None:  # fault injection: delayed or dropped messages
            msgs = self.manager.faults.outgoing(msgs)
        try:
            for m in msgs:
                conn.sock.send(m)
        except OSError:
            self._drop_conn(conn, "lost the decode connection while sending")

    def _send_aux(self, reg: Registration, dst_slot: int, row: AuxRow) -> None:
        aux = self.manager.aux
        if aux is None:
            raise TransferError("the prefill manager has no aux buffer")
        slot = aux.alloc()
        if slot is None:
            raise TransferError("no free aux slot on the prefill")
        try:
            aux.write(slot, row)
            self.manager.send_aux(reg.session_id, slot, reg.aux_ptr, reg.aux_row_bytes, dst_slot)
        finally:
            aux.free(slot)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """Registration, then messages until the connection ends (thread per connection)."""
        tune(sock, self.config.peer_timeout_s)
        fs = FramedSocket(sock)
        try:
            sock.settimeout(self.config.connect_timeout_s)
            reg = fs.recv()
            if not isinstance(reg, Registration):
                raise MessageError(f"expected Registration, got {type(reg).__name__}")
            check_token(self.config.secret, reg)
            plan = plan_sends(self.identity, self._ranks, reg)
            state_plan = plan_state_sends(self.identity, self._ranks, reg)
            mine = self.identity.heads
            fs.send(RegisterReply(True, "", [x for pair in mine.ranges for x in pair]
                                  if mine is not None else [],
                                  sorted(set(self.manager.kv_layer_ids or []))))
            sock.settimeout(None)
        except (OSError, TransferError) as exc:
            with self._lock:
                self._refused = (time.monotonic(), str(exc))
            try:
                fs.send(RegisterReply(False, str(exc)))
            except (OSError, TransferError):
                pass
            fs.close()
            return
        conn = _Conn(fs, reg, time.monotonic(), plan, state_plan)
        with self._lock:
            self._conns.append(conn)
        try:
            while conn.alive:
                self._handle(conn, fs.recv())
        except (OSError, MessageError):
            self._drop_conn(conn, "lost the decode connection")

    def _handle(self, conn: _Conn, msg: Message) -> None:
        with self._lock:
            conn.last_seen = time.monotonic()
            if isinstance(msg, Heartbeat):
                r = None
            elif isinstance(msg, Destination):
                r = self._on_destination(conn, msg)
            elif isinstance(msg, Abort):
                r = self._on_abort(conn, msg)
            else:
                raise MessageError(f"unexpected {type(msg).__name__} from a decode")
            if r is not None:
                self._finish_locked(r)
        if isinstance(msg, Heartbeat):
            self._send_all(conn, [HeartbeatAck(msg.seq)])

    def _on_abort(self, conn: _Conn, a: Abort) -> _Room | None:
        r = self._rooms.get(a.room)
        t = r.targets.get(conn.reg.tp_rank) if r is not None else None
        if r is None or (t is not None and (t.conn is not conn or t.final_sent)):
            # Nothing of this connection's can still be written into that room: ack at once.
            threading.Thread(
                target=self._send_all, args=(conn, [AbortAck(a.room)]), daemon=True
            ).start()
            return None
        if t is None:  # that rank aborts before its destination came
            t = r.targets[conn.reg.tp_rank] = _Target(conn)
        t.peer_aborted = True
        self._fail(r, f"aborted by decode: {a.reason}", quiesced=True)
        return r

    def _on_destination(self, conn: _Conn, d: Destination) -> _Room:
        r = self._rooms.get(d.room)
        if r is None:
            r = self._rooms[d.room] = _Room(d.room, time.monotonic(), claimed=False)
        t = r.targets.get(conn.reg.tp_rank)
        if t is not None and (t.dest is not None or t.conn is not conn):
            # A second destination from one rank: refuse it without touching the first.
            threading.Thread(
                target=self._send_all,
                args=(conn, [Abort(d.room, "aborted: duplicate destination for this room")]),
                daemon=True,
            ).start()
            return r
        if t is None:
            t = r.targets[conn.reg.tp_rank] = _Target(conn)
        t.dest = d
        problem = _destination_problem(conn, d)
        others = [o for o in r.targets.values() if o is not t and o.dest is not None]
        if not problem and others:
            problem = _mismatch(others[0], t)
        if problem:
            self._fail(r, problem, quiesced=True)
        elif r.ready() and r.status is KVPoll.Bootstrapping:
            r.skip = d.cached_pages
            r.status = advance(r.status, KVPoll.WaitingForInput)
        return r

    def _drop_conn(self, conn: _Conn, reason: str) -> None:
        """Fail every room of a dead or silent decode; nothing more is sent to it."""
        with self._lock:
            if not conn.alive:
                return
            conn.alive = False
            if conn in self._conns:
                self._conns.remove(conn)
            for r in list(self._rooms.values()):
                mine = [t for t in r.targets.values() if t.conn is conn]
                for t in mine:
                    t.final_sent = True  # nothing more goes to a dead connection
                    t.outbox.clear()
                if mine:
                    if not r.status.is_terminal:
                        self._fail(r, reason, quiesced=True)
                    self._finish_locked(r)
        conn.sock.abort()

    def _refusal_note(self, r: _Room) -> str:
        """Why a decode was last refused, if that happened while ``r`` waited (or just before
        it opened): the likely reason its destination never came."""
        if self._refused is None or self._refused[0] < r.created - self.config.connect_timeout_s:
            return ""
        return f" (a decode's registration was refused meanwhile: {self._refused[1]})"

    def _sweep_loop(self) -> None:
        cfg = self.config
        while not self._stop.wait(cfg.tick_s):
            now = time.monotonic()
            with self._lock:
                silent = [c for c in self._conns if now - c.last_seen > cfg.peer_timeout_s]
                for r in list(self._rooms.values()):
                    if now - r.created <= cfg.bootstrap_timeout_s or r.status.is_terminal:
                        continue
                    if r.status is KVPoll.Bootstrapping:
                        self._fail(r, "bootstrap timeout: no destination arrived"
                                   + self._refusal_note(r), quiesced=True)
                    elif not r.claimed:
                        self._fail(r, "bootstrap timeout: no request for this room", True)
                    else:
                        continue
                    self._finish_locked(r)
            for c in silent:
                self._drop_conn(c, "decode heartbeat timeout")


def _dest(t: _Target) -> Destination:
    assert t.dest is not None, "a ready target has a destination"
    return t.dest


def _destination_problem(conn: _Conn, d: Destination) -> str:
    """Why ``d`` does not fit the decode rank that sent it ("" when it does)."""
    reg = conn.reg
    bad = [p for p in d.pages if not 0 <= p < reg.num_pages]
    bad += [p for p in d.landing_pages if not 0 <= p < reg.landing_num_pages]
    slot_ok = 0 <= d.aux_slot < reg.aux_num_rows or d.aux_slot == NO_AUX_SLOT
    landing_ok = len(d.landing_pages) == (len(d.pages) if conn.lands else 0)
    if bad or not slot_ok or d.cached_pages < 0 or not landing_ok:
        return (f"destination out of range (pages {bad[:4]}, aux slot {d.aux_slot}, cached "
                f"pages {d.cached_pages}, {len(d.landing_pages)} landing pages for "
                f"{len(d.pages)})")
    if conn.state_sends and not 0 <= d.state_slot < reg.num_state_slots:
        return (f"destination state slot {d.state_slot} is outside the decode's "
                f"{reg.num_state_slots} slots")
    return ""


def _state_problem(targets: list[_Target], state_slot: int | None, ends: bool) -> str:
    """Why a chunk cannot go with ``state_slot`` ("" when it can): states only on the last
    chunk, and there they go wherever this prefill has state sends."""
    wants = any(t.conn.state_sends for t in targets)
    if state_slot is not None and not ends:
        return "states go with the last chunk only"
    if ends and wants and state_slot is None:
        return "the decode expects linear-attention states and none were sent"
    return ""


def _mismatch(first: _Target, t: _Target) -> str:
    """Why ``t``'s destination cannot belong with ``first``'s in one room of one decode ("" when
    it can): the decode's ranks send the same pages, cached count and state slot, one of them
    the aux slot, and describe the same TP layout."""
    a, b = _dest(first), _dest(t)
    if first.conn.reg.kv_head_ranges != t.conn.reg.kv_head_ranges:
        return "destinations of one room came from decodes of different TP layouts"
    if a.pages != b.pages or a.cached_pages != b.cached_pages or a.state_slot != b.state_slot:
        return (f"decode ranks {first.conn.reg.tp_rank} and {t.conn.reg.tp_rank} sent "
                "different pages for one room")
    if NO_AUX_SLOT not in (a.aux_slot, b.aux_slot):
        return "two decode ranks each asked for the aux row of one room"
    return ""
