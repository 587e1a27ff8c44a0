"""``pdserve decode``: a decode worker process (gRPC ``DecodeWorker`` + health + reflection)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from decode_node.clients import BootstrapClients
from decode_node.loop import EngineLoop
from decode_node.service import DecodeService
from engine.checkpoint import model_fingerprint
from engine.llm_engine import EngineConfig, LLMEngine
from proto.pdserve.v1 import worker_pb2_grpc
from proto.server import start_server, wait_for_signal
from transfer.bootstrap import ModelIdentity
from transfer.setup import make_kv_manager

SERVICE_NAME = "pdserve.v1.DecodeWorker"


async def serve_decode(
    model_dir: Path, config: EngineConfig, host: str, port: int, *, transfer_backend: str,
    advertise_host: str,
) -> None:
    """Run a decode worker until SIGINT/SIGTERM; prints ``READY <port>`` once serving."""
    engine = LLMEngine(model_dir, config)
    manager = make_kv_manager(
        transfer_backend, engine.pool.buffer_infos(),
        hidden_size=engine.model_config.text.hidden_size,
        aux_rows=2 * config.max_num_seqs, hostname=advertise_host,
    )
    identity = ModelIdentity(model_fingerprint(model_dir), config.page_size, config.dtype)
    service = DecodeService()
    loop = EngineLoop(engine, service.emit)
    clients = BootstrapClients(manager, identity, loop.remote.free_later)
    service.bind(loop, asyncio.get_running_loop(), clients)
    loop.start()
    server, bound, _ = await start_server(
        [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, service, SERVICE_NAME)], host, port
    )
    print(f"READY {bound}", flush=True)
    try:
        await wait_for_signal()
    finally:
        await server.stop(grace=5.0)
        loop.stop()
        clients.close()

