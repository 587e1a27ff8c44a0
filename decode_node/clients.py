"""The decode node's bootstrap connections: one registered client per prefill address.

A connection is made (and the node's buffers registered with that prefill) the first time a
room names the address. When a prefill dies its client is retired: new rooms get a fresh
connection (so a prefill restarted on the same address is used again), and the old client is
closed once its failed rooms have released their pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from transfer.base import KVManager
from transfer.bootstrap import BootstrapConfig, ModelIdentity
from transfer.bootstrap_decode import DecodeBootstrapClient
from transfer.errors import TransferError


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a bootstrap ``HOST:PORT``; raises ``TransferError`` when malformed
    (the prefill cannot be reached there)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise TransferError(f"bootstrap address must be HOST:PORT, got {address!r}")
    return host, int(port)


class BootstrapClients:
    def __init__(
        self,
        manager: KVManager,
        identity: ModelIdentity,
        free_pages: Callable[[list[int]], None],
        config: BootstrapConfig | None = None,
    ) -> None:
        self.manager = manager
        self.identity = identity
        self.config = config or BootstrapConfig()
        self._free_pages = free_pages
        self._lock = threading.Lock()
        self._clients: dict[str, DecodeBootstrapClient] = {}
        self._retired: list[DecodeBootstrapClient] = []

    def get(self, address: str) -> DecodeBootstrapClient:
        """The live client for ``address``, connecting (and registering) if needed. Blocking;
        raises ``TransferError`` / ``OSError`` when the prefill cannot be reached or refuses."""
        with self._lock:
            self._close_drained()
            client = self._clients.get(address)
            if client is not None and client.alive:
                return client
            if client is not None:
                self._retired.append(client)
            client = DecodeBootstrapClient(self.manager, self.identity, parse_address(address),
                                           self._free_pages, config=self.config)
            self._clients[address] = client
            return client

    def num_rooms(self) -> int:
        with self._lock:
            return sum(c.num_rooms for c in [*self._clients.values(), *self._retired])

    def close(self) -> None:
        with self._lock:
            for c in [*self._clients.values(), *self._retired]:
                c.close()
            self._clients.clear()
            self._retired.clear()

    def _close_drained(self) -> None:
        for c in [c for c in self._retired if c.num_rooms == 0]:
            c.close()
            self._retired.remove(c)
