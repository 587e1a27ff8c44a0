"""The ``pdserve.v1.Admin`` servicer every node serves: ``GetStats`` over a node's own counters.

A node gives a :data:`StatsSource`: a blocking callable returning its figures by name, in the
names of ``LoadReport`` (``waiting_requests``, ``running_requests``, ``kv_pages_used``, ...) or of
``Stats`` (``requests_waiting``, ``requests_total``, ...). It is called off the event loop, since
a node's figures sit behind its engine thread's lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from proto.pdserve.v1 import admin_pb2, admin_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb

SERVICE_NAME = "pdserve.v1.Admin"
StatsSource = Callable[[], Mapping[str, float]]
# LoadReport names -> Stats names (the rest are equal or not part of Stats)
_RENAMES = {"waiting_requests": "requests_waiting", "running_requests": "requests_running"}
_FIELDS = frozenset(admin_pb2.Stats.DESCRIPTOR.fields_by_name) - {"role"}


def to_stats(role: str, figures: Mapping[str, float]) -> admin_pb2.Stats:
    """``figures`` as a ``Stats`` message; names that are no ``Stats`` field are dropped."""
    out = admin_pb2.Stats(role=role)
    for name, value in figures.items():
        name = _RENAMES.get(name, name)
        if name in _FIELDS:
            setattr(out, name, value if isinstance(value, float) else max(0, int(value)))
    return out


class AdminService(admin_pb2_grpc.AdminServicer):
    """Serves ``GetStats`` for a node of kind ``role`` from ``source``."""

    def __init__(self, role: str, source: StatsSource) -> None:
        self.role = role
        self.source = source

    async def GetStats(  # noqa: N802 - gRPC method name
        self, request: admin_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Stats:
        return to_stats(self.role, await asyncio.to_thread(self.source))


_LOAD_FIELDS = frozenset(wpb.LoadReport.DESCRIPTOR.fields_by_name)


def load_report(figures: Mapping[str, float], bootstrap: str = "", *, instance_id: str = "",
                page_size: int = 0) -> wpb.LoadReport:
    """A worker's ``LoadReport`` from its figures (names that are no field are dropped), its
    instance id and page size and, for a prefill worker, its bootstrap address."""
    fields: dict[str, Any] = {k: v for k, v in figures.items() if k in _LOAD_FIELDS}
    return wpb.LoadReport(**fields, bootstrap=bootstrap, instance_id=instance_id,
                          page_size=page_size)
