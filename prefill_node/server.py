"""``pdserve prefill``: a prefill worker process (gRPC ``PrefillWorker`` + its transfer
bootstrap endpoint)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from engine.checkpoint import model_fingerprint
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.runner.draft_runner import DraftRunner
from engine.runner.kernel_warmup import warm_kernels
from prefill_node.kv_transfer import (
    PrefillRankTransfer,
    prefill_heads,
    prefill_manager,
    remote_ranks,
)
from prefill_node.loop import PrefillLoop
from prefill_node.service import PrefillService
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admission import DEFAULT_MAX_WAITING
from serving.auth import ServerSecurity
from serving.compute_thread import ComputeThread
from serving.keepalive import DEFAULT_KEEPALIVE, Keepalive
from serving.kv_events import kv_event_hub
from serving.metrics import TransferMetrics
from serving.server import serve_until_signal, start_server
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.plan.states import StateLayout

SERVICE_NAME = "pdserve.v1.PrefillWorker"


async def serve_prefill(
    model_dir: Path, config: EngineConfig, host: str, port: int, *, bootstrap_port: int,
    transfer_backend: str, advertise_host: str, pp_size: int = 1, pp_rank: int = 0,
    pp_next: str | None = None, draft: Path | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING, security: ServerSecurity | None = None,
    bootstrap_config: BootstrapConfig | None = None, metrics_port: int | None = None,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> None:
    """Run a prefill worker until SIGINT/SIGTERM; prints ``READY <port>`` once serving.

    With ``pp_size > 1`` this process is stage ``pp_rank`` of a pipeline-parallel prefill
    (:mod:`prefill_node.pipeline.server`: the first stage or a later one); ``pp_next`` is the
    next stage's gRPC address; ``draft`` goes to the last stage only. ``max_waiting`` bounds
    the rooms waiting here (see :mod:`prefill_node.service`); ``bootstrap_config`` sets the
    handshake timeouts of its bootstrap endpoint. With ``config.tp_size`` above 1 the engine's
    other ranks run in their own processes, each writing its KV heads (a draft's band too) on
    this one's word (:mod:`prefill_node.kv_transfer`), on every pipeline stage too.
    """
    if pp_size > 1 or pp_next:
        from prefill_node.pipeline.layout import StageLayout
        from prefill_node.pipeline.server import StageArgs, serve_first_stage, serve_later_stage

        layout = StageLayout(pp_size, pp_rank)
        args = StageArgs(model_dir, config, host, port, layout, pp_next=pp_next,
                         bootstrap_port=bootstrap_port, transfer_backend=transfer_backend,
                         advertise_host=advertise_host, max_waiting=max_waiting,
                         security=security, bootstrap_config=bootstrap_config,
                         metrics_port=metrics_port, draft=draft, keepalive=keepalive)
        await (serve_first_stage(args) if layout.is_first else serve_later_stage(args))
        return
    text = ModelConfig.from_dir(model_dir).text
    authkey = secrets.token_bytes(32)  # the other TP ranks' agents take orders from this one
    silent_peer_s = (bootstrap_config or BootstrapConfig()).peer_timeout_s
    attach = PrefillRankTransfer(transfer_backend, advertise_host, text.hidden_size, authkey,
                                 silent_peer_s)

    def build() -> tuple[LLMEngine, DraftRunner | None]:
        engine = LLMEngine(model_dir, config, rank_attach=attach, draft=draft)
        # the draft's prompt KV is computed here and travels in its band
        drafter = DraftRunner(engine, engine.load_draft()) if draft is not None else None
        # every kernel a prompt's forwards compile, before any other thread (transfer, gRPC)
        print(warm_kernels(engine).line(), flush=True)
        return engine, drafter

    compute = ComputeThread("prefill-loop")  # builds, warms up and steps the engine
    engine, drafter = await compute.call(build)
    pools = drafter.pools() if drafter is not None else [engine.pool]
    state_pool = engine.states.pool if engine.states is not None else None
    manager = prefill_manager(transfer_backend, pools,
                              hidden_size=engine.model_config.text.hidden_size,
                              hostname=advertise_host, states=state_pool,
                              silent_peer_s=silent_peer_s)
    identity = ModelIdentity(model_fingerprint(model_dir), config.page_size, config.dtype,
                             text.num_hidden_layers,
                             heads=prefill_heads(text, engine.pool, config.tp_size),
                             states=StateLayout.of(text.linear, state_pool, config.tp_size))
    ranks = remote_ranks(engine.rank_payloads, authkey)
    bootstrap = PrefillBootstrapServer(manager, identity, host=host, port=bootstrap_port,
                                       config=bootstrap_config, ranks=ranks)
    service = PrefillService(max_waiting)
    service.kv_events = hub = kv_event_hub(engine)
    loop = PrefillLoop(engine, bootstrap, service.on_done, drafter, compute)
    service.bind(loop, asyncio.get_running_loop(), f"{advertise_host}:{bootstrap.address[1]}")
    loop.start()
    server, bound, _ = await start_server(
        [(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, service, SERVICE_NAME)], host, port,
        role="prefill", stats=service.stats, security=security,
        metrics_port=metrics_port, metrics_collectors=TransferMetrics().watch(manager, *ranks),
        keepalive=keepalive,
    )
    await serve_until_signal(server, bound, loop.stop, bootstrap.close, engine.close,
                             on_signal=hub.close if hub is not None else None)
