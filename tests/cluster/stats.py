"""The leak check: every node of a cluster holds nothing once its work is over.

:func:`assert_all_idle` polls ``pdserve.v1.Admin/GetStats`` on every address until each node
reports zero pages, aux slots, state slots, rooms and requests (running or waiting), and fails
naming the nodes still busy with their last figures.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc

GAUGES = ("kv_pages_used", "aux_slots_used", "rooms_active", "requests_running",
          "requests_waiting", "state_slots_used")
Metadata = Sequence[tuple[str, str]]


def _channel(address: str, root_cert: bytes | None) -> grpc.Channel:
    if root_cert is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root_cert))


def get_stats(address: str, *, metadata: Metadata = (), root_cert: bytes | None = None,
              timeout_s: float = 5.0) -> admin_pb2.Stats:
    """One ``GetStats`` call on ``address``."""
    with _channel(address, root_cert) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        return stub.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout_s,
                             metadata=tuple(metadata))


def busy_gauges(stats: admin_pb2.Stats) -> dict[str, int]:
    """The gauges of ``stats`` that are not zero."""
    return {name: getattr(stats, name) for name in GAUGES if getattr(stats, name)}


def assert_all_idle(addresses: Sequence[str], timeout_s: float = 10.0, *,
                    metadata: Metadata = (), root_cert: bytes | None = None) -> None:
    """Wait until every node at ``addresses`` is idle; AssertionError after ``timeout_s``.

    ``metadata`` goes with every call (tokens, when the nodes require them: each node checks only
    its own entry); ``root_cert`` makes the calls over TLS.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    last: dict[str, admin_pb2.Stats] = {}
    while pending:
        for address in list(pending):
            last[address] = get_stats(address, metadata=metadata, root_cert=root_cert)
            if not busy_gauges(last[address]):
                pending.remove(address)
        if not pending:
            return
        if time.monotonic() > deadline:
            busy = {a: (last[a].role, busy_gauges(last[a])) for a in pending}
            raise AssertionError(f"nodes still hold resources after {timeout_s}s: {busy}")
        time.sleep(0.05)
