"""Starting a gRPC (asyncio) server the same way on every node: our services, the ``Admin``
service (``GetStats``), the standard health service and server reflection, bound to loopback
unless told otherwise, with optional TLS and token checks (:mod:`serving.auth`) and malformed
requests refused as ``INVALID_ARGUMENT`` (:mod:`serving.parsing`)."""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client.registry import Collector

from proto.pdserve.v1 import admin_pb2_grpc
from serving.admin import SERVICE_NAME as ADMIN_SERVICE
from serving.admin import AdminService, StatsSource
from serving.auth import ServerSecurity, TokenInterceptor
from serving.keepalive import DEFAULT_KEEPALIVE, Keepalive
from serving.metrics import metrics_registry, serve_metrics
from serving.parsing import ParseInterceptor

MAX_MESSAGE_BYTES = 64 << 20
SHUTDOWN_GRACE_S = 5.0  # how long in-flight calls may finish after SIGTERM
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

Registration = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


async def start_server(
    services: Sequence[Registration], host: str = "127.0.0.1", port: int = 0, *,
    role: str = "", stats: StatsSource | None = None, security: ServerSecurity | None = None,
    metrics_port: int | None = None, metrics_collectors: Sequence[Collector] = (),
    serving: bool = True, keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a server with ``services`` (``(add_X_to_server, servicer, full_service_name)``).

    With ``stats`` it also serves ``pdserve.v1.Admin`` (``GetStats``) for a node of kind
    ``role``. ``security`` adds TLS (``add_secure_port``) and token requirements, checked by a
    :class:`serving.auth.TokenInterceptor` before any servicer runs.

    Returns the server, the bound port (``port=0`` picks a free one) and its health servicer,
    already ``SERVING`` for every service, or, with ``serving=False``, ``NOT_SERVING`` for the
    whole server (``""``) and ``services`` until the caller flips them with :func:`set_serving`
    (``Admin`` stays ``SERVING``: its figures are always available).

    With ``metrics_port`` (and ``stats``) it also serves Prometheus ``/metrics`` on ``host``
    (:mod:`serving.metrics`, with ``metrics_collectors`` added) and prints ``METRICS <port>``.

    ``keepalive``: how the server pings its clients and how often it lets them ping
    (:mod:`serving.keepalive`).
    """
    security = security or ServerSecurity()
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [TokenInterceptor(security.requirements)] if security.requirements else [])
    interceptors.append(ParseInterceptor())  # inside the token check: callers are known first
    server = grpc.aio.server(options=[*SERVER_OPTIONS, *keepalive.server_options()],
                             interceptors=interceptors)
    names = [name for _, _, name in services]  # ours; their health follows ``serving``
    admin = []  # always SERVING
    if stats is not None:
        services = [*services, (admin_pb2_grpc.add_AdminServicer_to_server,
                                AdminService(role, stats), ADMIN_SERVICE)]
        admin.append(ADMIN_SERVICE)
    for add, servicer, _ in services:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, ["", *names], serving)  # before the port opens
    await set_serving(health_servicer, admin, True)
    reflection.enable_server_reflection(
        [*names, *admin, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    if security.tls is not None:
        bound = server.add_secure_port(address, security.tls.credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    if metrics_port is not None and stats is not None:
        serve_metrics(host, metrics_port, metrics_registry(role, stats, metrics_collectors))
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, names: Sequence[str],
                      serving: bool) -> None:
    """Report every service of ``names`` (``""``: the whole server, which is what Kubernetes'
    gRPC probes ask) as ``SERVING`` or ``NOT_SERVING``."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in names:
        await health_servicer.set(name, status)


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM (graceful shutdown of a node)."""
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_until_signal(
    server: grpc.aio.Server, bound: int, *cleanups: Callable[[], object],
    on_signal: Callable[[], None] | None = None,
) -> None:
    """Print ``READY <bound>``, serve until SIGINT/SIGTERM, then call ``on_signal`` (to end calls
    that never end by themselves, such as event streams), let in-flight calls drain
    (``SHUTDOWN_GRACE_S``) and run ``cleanups`` in order (awaiting any that return awaitables)."""
    print(f"READY {bound}", flush=True)
    try:
        await wait_for_signal()
    finally:
        if on_signal is not None:
            on_signal()
        await server.stop(grace=SHUTDOWN_GRACE_S)
        for cleanup in cleanups:
            result = cleanup()
            if inspect.isawaitable(result):
                await result
