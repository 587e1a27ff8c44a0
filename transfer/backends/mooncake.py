"""KV manager over Mooncake's transfer engine (``mooncake.engine.TransferEngine``).

TCP by default with the peer-to-peer handshake (metadata server ``P2PHANDSHAKE``: no metadata
service, a peer is named ``host:rpc_port``); RDMA with ``protocol="rdma"`` and a device name.
Push model: the prefill writes into pages the decode reserved. Each buffer is registered once.

Memory: the CUDA build (``mooncake-transfer-engine``, extra ``cuda``) registers GPU memory as
well as host memory; the non-CUDA build (``mooncake-transfer-engine-non-cuda``, extra
``mooncake``) registers host memory only, and a KV pool on a GPU is refused with an error naming
the extra before the engine is called (:func:`transfer.backends.memory.check_registrable`). GPU
ranges are registered with their device as the location (``"cuda:N"``, the name the engine itself
gives a device pointer), host ranges with the wildcard so the engine finds their NUMA node.
"""

from __future__ import annotations

import os
import time
from typing import Any

from transfer.backends.engine_import import load_transfer_engine
from transfer.backends.keepalive import (
    ConnectionKeepalive,
    TcpKeepalive,
    drop_silent_peers,
    listening_tcp_fds,
)
from transfer.backends.memory import MemoryRange, check_registrable
from transfer.base import KVManager
from transfer.errors import EngineCallError

P2P_HANDSHAKE = "P2PHANDSHAKE"
# Mooncake's TCP transport opens a new connection for every slice of a transfer unless told to
# keep them (it reads its settings from the environment only): over a 50 ms round trip a 512 KiB
# send took 583 ms that way and 152 ms over kept connections (bench.netns_transfer, 2026-12-06)
TCP_CONNECTION_POOL = ("MC_TCP_ENABLE_CONNECTION_POOL", "1")
STALE_WRITE_S = 1.0  # a TCP write that fails sooner is made again (MooncakeKVManager._write)
STALE_TRIES = 5  # at most: a peer's pooled connections (4 lanes) may all be stale, then one


def create_mooncake_engine(
    hostname: str, *, protocol: str = "tcp", device_name: str = "",
    metadata_server: str = P2P_HANDSHAKE, kv_device: str = "",
    keepalive: TcpKeepalive | None = None,
) -> Any:
    """A started ``TransferEngine`` listening on ``hostname``.

    ``kv_device`` (where the KV cache will live, "" unknown) only picks the install hint of a
    :class:`~transfer.errors.BackendUnavailableError` when the engine cannot be loaded
    (:mod:`transfer.backends.engine_import`). ``keepalive``: set on the TCP sockets the engine
    listens on, so a connection into this node whose peer went silent is dropped
    (:mod:`transfer.backends.keepalive`); before the engine's address is known to anyone, so
    every connection it accepts has it.
    """
    if protocol == "tcp":
        os.environ.setdefault(*TCP_CONNECTION_POOL)  # an operator's own setting wins
    engine = load_transfer_engine(kv_device)()
    before = listening_tcp_fds() if keepalive is not None else set()
    ret = engine.initialize(hostname, metadata_server, protocol, device_name)
    if ret != 0:
        raise EngineCallError(
            f"TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}) "
            f"returned {ret}"
        )
    if keepalive is not None:
        drop_silent_peers(listening_tcp_fds() - before, keepalive)
    return engine


class MooncakeKVManager(KVManager):
    """Mooncake-backed manager; pass ``engine`` to reuse an initialized engine. ``kv_device``
    (where the KV cache will live) picks the install hint if the engine cannot be loaded.
    ``silent_peer_s``: the connections of the engine it creates, into it (a decode's) and out
    of it (a prefill's, swept after each write), drop a peer silent that long
    (:mod:`transfer.backends.keepalive`); this sets
    :attr:`~transfer.base.KVManager.late_write_s`."""

    def __init__(
        self,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = P2P_HANDSHAKE,
        engine: Any = None,
        batch_limit: int = 1024,
        kv_device: str = "",
        silent_peer_s: float | None = None,
    ) -> None:
        super().__init__(batch_limit=batch_limit)
        self.hostname = hostname
        self.protocol = protocol
        self.kv_device = kv_device
        keepalive = None
        self._outgoing: ConnectionKeepalive | None = None
        if silent_peer_s is not None and engine is None and protocol == "tcp":
            keepalive = TcpKeepalive.within(silent_peer_s)
            self.late_write_s = float(keepalive.latest_s)
            self._outgoing = ConnectionKeepalive(keepalive)
        self.engine = engine if engine is not None else self._create_engine(
            hostname, protocol, device_name, metadata_server, keepalive
        )
        self._ranges: list[MemoryRange] = []  # what this manager registered, for close()

    def _create_engine(
        self, hostname: str, protocol: str, device_name: str, metadata_server: str,
        keepalive: TcpKeepalive | None,
    ) -> Any:
        return create_mooncake_engine(
            hostname, protocol=protocol, device_name=device_name, metadata_server=metadata_server,
            kv_device=self.kv_device, keepalive=keepalive,
        )

    @property
    def session_id(self) -> str:
        return f"{self.hostname}:{self.engine.get_rpc_port()}"

    def _register_ranges(self, ranges: list[MemoryRange]) -> None:
        check_registrable(ranges)
        for r in ranges:
            ret = self.engine.register_memory(r.ptr, r.nbytes, location=r.location)
            if ret != 0:
                raise EngineCallError(
                    f"register_memory({r.ptr:#x}, {r.nbytes}, location={r.location!r}) "
                    f"of {r.device} memory returned {ret}"
                )
            self._ranges.append(r)

    def _write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
        """One engine write; over TCP, one that fails at once is made again, up to
        :data:`STALE_TRIES` writes: the engine pools its connections to a peer, and each one
        its peer dropped meanwhile (a peer restarted, or a partition the keepalive ended) fails
        the first write on it; the engine drops it, and the same bytes into the same pages go
        over the next. A write that stalled before failing is not made again."""
        ret = 0
        for _ in range(STALE_TRIES if self.protocol == "tcp" else 1):
            start = time.monotonic()
            ret = int(self.engine.batch_transfer_sync_write(session, srcs, dsts, lens))
            if ret == 0 or time.monotonic() - start >= STALE_WRITE_S:
                break
        if self._outgoing is not None:  # the connections this write opened get keepalive
            self._outgoing.sweep()
        return ret

    def close(self) -> None:
        """Stop the staged-send writer thread and unregister every range this manager
        registered."""
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        for r in self._ranges:
            self.engine.unregister_memory(r.ptr)
        self._ranges.clear()
