"""Worker pool: one channel per worker, local load counters refreshed by periodic ``GetLoad``
calls, least-loaded selection, and DNS discovery of workers.

Load of a worker = the larger of what this router has outstanding on it (updated the moment a
request is assigned or released) and what the worker last reported (which also covers other
routers' work). Workers whose last ``GetLoad`` failed sort after healthy ones but are still
picked when nothing else is left, so the caller gets ``UNAVAILABLE`` naming the address.

DNS discovery: an address ``dns:NAME:PORT`` stands for every A record of ``NAME`` (a Kubernetes
headless service lists the IPs of its ready pods), each at ``PORT``. The pool resolves it at
:meth:`WorkerPool.start` and every ``dns_refresh_s`` after: new IPs become workers; a worker whose
IP vanished gets no new requests from then on (it leaves :attr:`WorkerPool.prefill` /
:attr:`WorkerPool.decode` at once) and its channel is closed only once no request of this router
runs on it (and at least one refresh period after it vanished, so a request admitted just
before is not cut). A failed lookup changes nothing (a DNS hiccup must not drop a live cluster);
an empty answer retires every worker of that name. Plain ``HOST:PORT`` workers never change.

Readiness (:func:`readiness`): the router can serve once at least one decode worker answered its
last ``GetLoad`` and, when the pool has prefill entries (disaggregated mode), at least one prefill
worker did too and reported its bootstrap address (any prefill pairs with any decode). The pool
re-checks the rule after every poll round and every on-demand probe and calls
:attr:`WorkerPool.on_change` when the answer flips (the router's health follows it).

On-demand probe (:meth:`WorkerPool.ensure`): a request that picks a worker whose last poll failed,
or a prefill whose bootstrap address is not known yet, asks that worker right then, waiting up to
``CONNECT_WAIT_S`` for its connection, so a worker that is up is never refused because the
background poll has not reached it yet. Channels retry a lost connection at least every
``MAX_RECONNECT_BACKOFF_MS``, so a worker that comes (back) up is seen within about a second.

No sticky failures: a worker a request failed on (:meth:`Worker.note_failure`) is asked again
(``GetLoad``) before it gets another request, and for a cool-down it sorts after every worker
that is not cooling down. The cool-down doubles with each failure in a row (``COOLDOWN_BASE_S``
up to ``COOLDOWN_MAX_S``); failures during a cool-down (other requests meeting the same fault)
do not count; it is never dropped, so it serves again once it answers (alone, at once). A request
that completes on it (:meth:`Worker.note_success`) ends the cool-down and resets the count.

Cache epoch: :attr:`Worker.cache_epoch` counts the times its prefix cache may have been lost: a
request failed on it, or its ``GetLoad`` reports a new ``instance_id`` (it restarted). The
cache-aware policy (:mod:`router.policy`) drops what it believed of the worker's cache then.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from router.config import split_dns
from router.errors import WorkerFailure
from serving.auth import Metadata
from serving.keepalive import DEFAULT_KEEPALIVE, Keepalive
from serving.server import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)
MAX_RECONNECT_BACKOFF_MS = 1000  # a down worker's channel retries its connection this often
CONNECT_WAIT_S = 2.0  # how long an on-demand probe waits for a worker's connection
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]
PREFILL = "prefill"
DECODE = "decode"
DNS_REFRESH_S = 5.0  # period of DNS re-resolution of dns:NAME:PORT workers
COOLDOWN_BASE_S = 1.0  # cool-down after a worker's first request failure in a row
COOLDOWN_MAX_S = 30.0  # cool-downs double with each failure in a row up to this
Resolver = Callable[[str], Sequence[str]]  # host name -> its IPv4 addresses (blocking)


def resolve_a_records(name: str) -> list[str]:
    """Every IPv4 address ``name`` resolves to (all A records of a headless service), sorted.

    Raises OSError (``socket.gaierror``) when the lookup fails.
    """
    infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass
class Worker:
    """One worker process and this router's view of its load."""

    address: str
    kind: str  # PREFILL or DECODE (a colocated worker is a DECODE worker)
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    outstanding_tokens: int = 0  # prompt tokens of this router's requests not yet released
    running: int = 0  # this router's requests assigned here and not yet released
    report: wpb.LoadReport = field(default_factory=wpb.LoadReport)
    healthy: bool = False  # its last GetLoad succeeded (False until the first one)
    error: str = "not asked yet"  # why the last GetLoad failed ("" after a success)
    source: str = ""  # the dns:NAME:PORT entry that found it; "" for a plain HOST:PORT
    retired_ticks: int = 0  # DNS refreshes since it vanished (retiring workers only)
    metadata: Metadata = ()  # sent on every call (the internal token, when configured)
    failures: int = 0  # request failures blamed on it since its last completed request
    cooldown_until: float = 0.0  # time.monotonic() before which it sorts after the others
    suspect: bool = False  # a request failed on it since its last successful GetLoad
    cache_epoch: int = 0  # +1 whenever its prefix cache may be gone (see the module docstring)

    @property
    def decode_stub(self) -> worker_pb2_grpc.DecodeWorkerStub:
        """The stub of a DECODE worker."""
        assert isinstance(self.stub, worker_pb2_grpc.DecodeWorkerStub)
        return self.stub

    @property
    def prefill_stub(self) -> worker_pb2_grpc.PrefillWorkerStub:
        """The stub of a PREFILL worker."""
        assert isinstance(self.stub, worker_pb2_grpc.PrefillWorkerStub)
        return self.stub

    def score(self) -> tuple[int, int, int]:
        """Sort key: :attr:`rank`, then (prefill) outstanding prompt tokens and requests, or
        (decode) requests and outstanding prompt tokens."""
        tokens = max(self.outstanding_tokens, self.report.waiting_tokens)
        if self.kind == DECODE:
            return (self.rank, self.load, tokens)
        return (self.rank, tokens, self.load)

    @property
    def rank(self) -> int:
        """0: healthy and not cooling down; 1: cooling down; 2: its last ``GetLoad`` failed."""
        return 2 if not self.healthy else 1 if self.cooling else 0

    @property
    def load(self) -> int:
        """Requests on it: this router's, or all that it last reported, whichever is more."""
        rep = self.report
        return max(self.running, rep.running_requests + rep.waiting_requests)

    def take_report(self, report: wpb.LoadReport) -> None:
        """A successful ``GetLoad``: keep ``report``; a new instance id means a restart."""
        old = self.report.instance_id
        if old and report.instance_id != old:
            self.cache_epoch += 1
            log.warning("%s worker %s restarted (instance %s, was %s)", self.kind, self.address,
                        report.instance_id or "?", old)
        self.report = report
        self.healthy, self.error, self.suspect = True, "", False

    @property
    def cooling(self) -> bool:
        """Whether a recent request failure still puts it after the other workers."""
        return time.monotonic() < self.cooldown_until

    def note_failure(self, why: str) -> None:
        """A request failed on this worker: ask it again (``GetLoad``) before its next request
        and cool it down (see the module docstring)."""
        self.suspect = True
        self.cache_epoch += 1
        if self.cooling:
            return  # the same fault, seen by another request: no escalation
        self.failures += 1
        delay = min(COOLDOWN_MAX_S, COOLDOWN_BASE_S * 2 ** (self.failures - 1))
        self.cooldown_until = time.monotonic() + delay
        log.warning("%s worker %s failed a request (%s); cooling down %.0f s",
                    self.kind, self.address, why, delay)

    def note_success(self) -> None:
        """A request completed on this worker: its cool-down ends."""
        self.failures, self.cooldown_until = 0, 0.0

    def acquire(self, prompt_tokens: int) -> None:
        self.outstanding_tokens += prompt_tokens
        self.running += 1

    def release(self, prompt_tokens: int) -> None:
        """Undo one :meth:`acquire`; call exactly once per acquire."""
        self.outstanding_tokens -= prompt_tokens
        self.running -= 1


class WorkerPool:
    """All workers of one kind-set; call :meth:`start` inside the event loop, :meth:`close`
    at shutdown.

    ``prefill`` and ``decode`` entries are ``HOST:PORT`` or ``dns:NAME:PORT`` (see the module
    docstring); :attr:`prefill` and :attr:`decode` are the workers new requests may go to, and
    DNS discovery updates them in place. Every worker's channel pings it as ``keepalive`` says
    (:mod:`serving.keepalive`): a partitioned worker's calls end ``UNAVAILABLE`` within its time
    and timeout instead of hanging until their deadlines.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 refresh_s: float = 1.0, timeout_s: float = 5.0,
                 dns_refresh_s: float = DNS_REFRESH_S,
                 resolver: Resolver = resolve_a_records, metadata: Metadata = (),
                 keepalive: Keepalive = DEFAULT_KEEPALIVE) -> None:
        self.metadata = metadata
        self.channel_options = [*CHANNEL_OPTIONS, *keepalive.channel_options()]
        self.prefill = [self._make(a, PREFILL) for a in prefill if split_dns(a) is None]
        self.decode = [self._make(a, DECODE) for a in decode if split_dns(a) is None]
        # (kind, "dns:NAME:PORT", NAME, PORT) for every DNS entry
        self._dns: list[tuple[str, str, str, int]] = [
            (kind, a, *dns) for kind, entries in ((PREFILL, prefill), (DECODE, decode))
            for a in entries if (dns := split_dns(a)) is not None]
        self.retiring: list[Worker] = []  # vanished from DNS, channel still open
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.dns_refresh_s = dns_refresh_s
        self.resolver = resolver
        self.need_prefill = bool(prefill)  # disaggregated: a usable pair needs a prefill
        self.readiness = Readiness(False, "workers not polled yet")
        self.on_change: Callable[[Readiness], Awaitable[None]] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def all(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    async def start(self) -> None:
        """Resolve DNS entries and poll every worker once, then keep both up in the background."""
        if self._dns:
            await self.discover()
            self._tasks.append(asyncio.create_task(
                self._forever(self.dns_refresh_s, self.discover)))
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._forever(self.refresh_s, self.refresh)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in [*self.all, *self.retiring]:
            await w.channel.close()

    async def refresh(self) -> None:
        """One ``GetLoad`` on every worker, concurrently; then re-check readiness."""
        await asyncio.gather(*(self._refresh_one(w) for w in self.all))
        await self._recheck()

    async def ensure(self, w: Worker) -> None:
        """Ask ``w`` now if its last poll failed, a request failed on it since (or, for a
        prefill, its bootstrap address is unknown), waiting up to ``CONNECT_WAIT_S`` for its
        connection; then re-check readiness. The caller reads the outcome from ``w.healthy``,
        ``w.report`` and ``w.error``."""
        if w.healthy and not w.suspect and (w.kind == DECODE or w.report.bootstrap):
            return
        await self._refresh_one(w, wait_s=min(self.timeout_s, CONNECT_WAIT_S))
        await self._recheck()

    async def _refresh_one(self, w: Worker, wait_s: float | None = None) -> None:
        """One ``GetLoad`` on ``w``; with ``wait_s`` it waits that long for a connection
        (``wait_for_ready``) instead of failing at once on a channel that is down."""
        try:
            w.take_report(await w.stub.GetLoad(
                wpb.GetLoadRequest(), timeout=self.timeout_s if wait_s is None else wait_s,
                metadata=w.metadata, wait_for_ready=wait_s is not None))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            name = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            error = f"GetLoad failed: {name}"
            if error != w.error:  # once per change, not once per poll
                log.warning("worker %s: %s", w.address, error)
            w.healthy, w.error = False, error

    async def _recheck(self) -> None:
        """Apply :func:`readiness` to the current workers; tell :attr:`on_change` on a flip."""
        now = readiness(self.prefill, self.decode, self.need_prefill)
        if now.ready == self.readiness.ready:
            self.readiness = now  # same answer, fresher reason
            return
        self.readiness = now
        (log.info if now.ready else log.warning)("router %s: %s",
                                                 "ready" if now.ready else "not ready",
                                                 now.reason)
        if self.on_change is not None:
            await self.on_change(now)

    async def _forever(self, period_s: float, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await step()
            except Exception:  # a background loop must outlive one bad round
                log.exception("worker pool background step failed")

    async def discover(self) -> None:
        """Resolve every DNS entry once and apply the answer (see the module docstring)."""
        await self._close_idle_retired()
        for kind, source, name, port in self._dns:
            try:
                ips = await asyncio.to_thread(self.resolver, name)
            except OSError as exc:
                log.warning("cannot resolve %s (keeping its %s workers): %s", name, kind, exc)
                continue
            self._apply(kind, source, [f"{ip}:{port}" for ip in ips])
        await self._recheck()

    def _apply(self, kind: str, source: str, addresses: Sequence[str]) -> None:
        """Make the workers found through ``source`` exactly ``addresses``."""
        workers = self.prefill if kind == PREFILL else self.decode
        wanted = dict.fromkeys(addresses)
        keep = []
        for w in workers:
            if w.source != source or w.address in wanted:
                keep.append(w)
                wanted.pop(w.address, None)  # also skips one a static entry already names
            else:
                log.warning("%s worker %s left %s; retiring it", kind, w.address, source)
                w.retired_ticks = 0
                self.retiring.append(w)
        for address in wanted:
            back = next((w for w in self.retiring
                         if w.kind == kind and w.address == address), None)
            if back is not None:  # the same pod (IP) is back before its channel closed
                self.retiring.remove(back)
                keep.append(back)
            else:
                log.info("%s worker %s joined via %s", kind, address, source)
                keep.append(self._make(address, kind, source))
        workers[:] = keep

    async def _close_idle_retired(self) -> None:
        """Close the channels of retired workers idle for at least one refresh period."""
        for w in list(self.retiring):
            w.retired_ticks += 1
            if w.running == 0 and w.retired_ticks >= 1:
                self.retiring.remove(w)
                await w.channel.close(grace=self.timeout_s)

    def _make(self, address: str, kind: str, source: str = "") -> Worker:
        """A worker of ``kind`` at ``address`` on a channel of its own (not connected yet)."""
        channel = grpc.aio.insecure_channel(address, options=self.channel_options)
        stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
        if kind == PREFILL:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        return Worker(address, kind, channel, stub, source=source, metadata=self.metadata)

    @staticmethod
    def pick(workers: Sequence[Worker]) -> Worker:
        """The least loaded of ``workers`` (first one on ties).

        Raises :class:`router.errors.WorkerFailure` (``UNAVAILABLE``) when there is none, which
        only happens while DNS discovery has found no worker yet.
        """
        if not workers:
            raise WorkerFailure(grpc.StatusCode.UNAVAILABLE,
                                "no worker is available yet (DNS discovery found none)")
        return min(workers, key=lambda w: w.score())


@dataclass(frozen=True)
class Readiness:
    """Whether the router can serve a request now; ``reason`` says why (or why not)."""

    ready: bool
    reason: str


def readiness(prefill: Sequence[Worker], decode: Sequence[Worker],
              need_prefill: bool) -> Readiness:
    """The readiness rule (see the module docstring): a reachable decode worker and, when
    ``need_prefill``, a reachable prefill worker whose bootstrap address is known."""
    decodes = [w for w in decode if w.healthy]
    if not decodes:
        return Readiness(False, "no decode worker is reachable" + _why(decode))
    if not need_prefill:
        return Readiness(True, f"{len(decodes)} of {len(decode)} workers reachable")
    prefills = [w for w in prefill if w.healthy and w.report.bootstrap]
    if not prefills:
        return Readiness(False, "no prefill worker is reachable with a known bootstrap "
                                "address" + _why(prefill))
    return Readiness(True, f"{len(prefills)} of {len(prefill)} prefill and {len(decodes)} of "
                           f"{len(decode)} decode workers reachable")


def _why(workers: Sequence[Worker]) -> str:
    """`` (ADDR: cause; ...)`` for the first few ``workers``, or `` (none known yet)``."""
    if not workers:
        return " (none known yet)"
    causes = [f"{w.address}: {w.error or 'no bootstrap address reported'}" for w in workers[:4]]
    return f" ({'; '.join(causes)}{'; ...' if len(workers) > 4 else ''})"
