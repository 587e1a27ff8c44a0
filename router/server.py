"""``pdserve router``: the router process (``Generation`` + health + reflection)."""

from __future__ import annotations

import asyncio
import logging

from proto.pdserve.v1 import generate_pb2_grpc
from router.config import RouterConfig
from router.policy import make_policy
from router.preprocess import ModelAssets
from router.service import GenerationService
from router.workers import Readiness, WorkerPool
from serving.auth import ServerSecurity, bearer_token, internal_metadata
from serving.metrics import metrics_registry
from serving.server import SHUTDOWN_GRACE_S, set_serving, start_server, wait_for_signal

SERVICE_NAME = "pdserve.v1.Generation"


async def serve_router(config: RouterConfig, host: str, port: int,
                       security: ServerSecurity | None = None, *,
                       metrics_port: int | None = None) -> None:
    """Run a router until SIGINT/SIGTERM; prints ``READY <port>`` once serving.

    With ``config.http_port`` set, the OpenAI-compatible HTTP door (:mod:`router.http_door`)
    also serves on ``host``, and ``HTTP <port>`` is printed before ``READY``.

    ``security``: TLS and the bearer-token rule of the public port (see :mod:`serving.auth`).

    Workers need not be up yet: unreachable ones are marked unhealthy and retried by the
    background ``GetLoad`` poll. ``READY`` means the port is open; gRPC health (``""`` and
    ``pdserve.v1.Generation``) and the HTTP door's ``/health`` say ``SERVING`` only while the
    pool has a usable worker set (:func:`router.workers.readiness`) and follow it both ways.
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    assets = ModelAssets.from_dir(config.model_dir)
    pool = WorkerPool(config.prefill, config.decode or config.colocated,
                      refresh_s=config.load_refresh_s, timeout_s=config.worker_timeout_s,
                      metadata=internal_metadata(config.internal_token),
                      keepalive=config.keepalive)
    await pool.start()
    policy = make_policy(config.routing)
    await policy.start(pool)
    service = GenerationService(config, assets, pool, policy)
    server, bound, health = await start_server(
        [(generate_pb2_grpc.add_GenerationServicer_to_server, service, SERVICE_NAME)], host, port,
        role="router", stats=service.stats, security=security,
        metrics_port=metrics_port, metrics_collectors=service.latency.collectors(),
        serving=pool.readiness.ready, keepalive=config.keepalive,
    )
    flip = asyncio.Lock()

    async def follow(_: Readiness) -> None:
        """Set health to the pool's readiness now (under a lock, so flips land in order)."""
        async with flip:
            await set_serving(health, ("", SERVICE_NAME), pool.readiness.ready)

    pool.on_change = follow
    await follow(pool.readiness)  # it may have flipped while the server started
    door = None
    if config.http_port is not None:
        from router.http_door import HttpDoor

        sec = security or ServerSecurity()
        door = HttpDoor(service, config.model_name,
                        metrics_registry("router", service.stats, service.latency.collectors()),
                        ssl_context=sec.tls.ssl_context() if sec.tls else None,
                        bearer_token=bearer_token(sec))
        try:
            http_bound = await door.start(host, config.http_port)
        except BaseException:
            await server.stop(grace=None)
            await policy.close()
            await pool.close()
            raise
        print(f"HTTP {http_bound}", flush=True)
    print(f"READY {bound}", flush=True)
    try:
        await wait_for_signal()
    finally:
        if door is not None:
            await door.close()
        await server.stop(grace=SHUTDOWN_GRACE_S)
        await policy.close()
        await pool.close()
