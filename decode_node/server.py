"""``pdserve decode``: a decode worker process (gRPC ``DecodeWorker`` + health + reflection)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from decode_node.loop import EngineLoop
from decode_node.service import DecodeService
from engine.llm_engine import EngineConfig, LLMEngine
from proto.pdserve.v1 import worker_pb2_grpc
from proto.server import start_server

SERVICE_NAME = "pdserve.v1.DecodeWorker"


async def serve_decode(model_dir: Path, config: EngineConfig, host: str, port: int) -> None:
    """Run a decode worker until SIGINT/SIGTERM; prints ``READY <port>`` once serving."""
    engine = LLMEngine(model_dir, config)
    service = DecodeService()
    loop = EngineLoop(engine, service.emit)
    service.bind(loop, asyncio.get_running_loop())
    loop.start()
    server, bound, _ = await start_server(
        [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, service, SERVICE_NAME)], host, port
    )
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=5.0)
        loop.stop()
