"""The decode node's bootstrap connections: registered clients per prefill address, one per
tensor-parallel rank of this decode.

The connections are made (and every rank's buffers registered with that prefill) the first time
a room names the address: rank 0's with its own manager, every other rank's with the
registration its process built (:mod:`decode_node.tp_ranks`). When a prefill dies its clients
are retired: new rooms get fresh connections (so a prefill restarted on the same address is used
again), and the old clients are closed once their failed rooms have released their pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from decode_node.landing import Landings
from transfer.base import KVManager
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.bootstrap.messages import Registration
from transfer.errors import TransferError


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a bootstrap ``HOST:PORT``; raises ``TransferError`` when malformed
    (the prefill cannot be reached there)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise TransferError(f"bootstrap address must be HOST:PORT, got {address!r}")
    return host, int(port)


class BootstrapClients:
    """``ranks``: the registrations of this decode's TP ranks ``1..`` (empty with one rank).
    ``landings``: every rank's landing buffers (:mod:`decode_node.landing`); with them, a rank
    registers again with a prefill whose ranks each fill a slice of its heads, taking a landing
    slot per such prefill rank (the first registration told it the prefill's layout)."""

    def __init__(
        self,
        manager: KVManager,
        identity: ModelIdentity,
        free_pages: Callable[[list[int]], None],
        config: BootstrapConfig | None = None,
        ranks: Sequence[Registration] = (),
        landings: Landings | None = None,
    ) -> None:
        self.manager = manager
        self._landings = landings
        self.identity = identity
        self.config = config or BootstrapConfig()
        self._ranks = list(ranks)
        self._free_pages = free_pages
        self._lock = threading.Lock()
        self._clients: dict[str, list[DecodeBootstrapClient]] = {}
        self._retired: list[DecodeBootstrapClient] = []

    def get(self, address: str) -> list[DecodeBootstrapClient]:
        """The live clients for ``address``, one per TP rank with rank 0's last (the one that
        holds a room's aux slot), connecting (and registering) if needed. Blocking; raises
        ``TransferError`` / ``OSError`` when the prefill cannot be reached or refuses a rank."""
        with self._lock:
            self._close_drained()
            group = self._clients.pop(address, [])
            if group and all(c.alive for c in group):
                self._clients[address] = group
                return list(group)
            self._retired.extend(group)
            host = parse_address(address)
            group = []
            try:
                for reg in self._ranks:
                    group.append(DecodeBootstrapClient(self.manager, self.identity, host,
                                                       self._free_pages, config=self.config,
                                                       rank=reg))
                group.append(DecodeBootstrapClient(self.manager, self.identity, host,
                                                   self._free_pages, config=self.config))
                if self._landings is not None:
                    self._land(group, host)
            except BaseException:
                for c in group:
                    c.close()
                raise
            self._clients[address] = group
            return list(group)

    def _land(self, group: list[DecodeBootstrapClient], host: tuple[str, int]) -> None:
        """Register again, with its landing slots, every rank of ``group`` (rank 0's client
        last) whose heads the prefill's ranks write in slices (the first registration told its
        layout)."""
        assert self._landings is not None
        ranges = group[-1].prefill_ranges
        for i, client in enumerate(group):
            rank = client.tp_rank
            landing = self._landings.for_prefill(ranges, rank)
            if landing is None:
                continue
            client.close()
            buffer, pages = landing
            group[i] = DecodeBootstrapClient(
                self.manager, self.identity, host, self._free_pages, config=self.config,
                rank=self._ranks[rank - 1] if rank else None, landing=(buffer, None),
                landing_pages=pages)

    def num_rooms(self) -> int:
        with self._lock:
            return sum(c.num_rooms for c in self._all())

    def close(self) -> None:
        with self._lock:
            for c in self._all():
                c.close()
            self._clients.clear()
            self._retired.clear()
            if self._landings is not None:
                self._landings.close()

    def _all(self) -> list[DecodeBootstrapClient]:
        return [*(c for group in self._clients.values() for c in group), *self._retired]

    def _close_drained(self) -> None:
        for c in [c for c in self._retired if c.num_rooms == 0]:
            c.close()
            self._retired.remove(c)
