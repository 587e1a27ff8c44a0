"""``pdserve decode``: a decode worker process (gRPC ``DecodeWorker`` + health + reflection)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from decode_node.clients import BootstrapClients
from decode_node.landing import Landings
from decode_node.loop import DecodeLoop
from decode_node.service import DecodeService
from decode_node.spec.eagle_engine import EagleEngine, spec_refusal
from decode_node.spec.tree import TreeShape
from decode_node.tp_ranks import RankTransfer, landing_agents, rank_registrations
from decode_node.warmup import kernels, warm_up
from engine.checkpoint import model_fingerprint
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admission import DEFAULT_MAX_WAITING
from serving.auth import ServerSecurity
from serving.compute_thread import ComputeThread
from serving.keepalive import DEFAULT_KEEPALIVE, Keepalive
from serving.kv_events import kv_event_hub
from serving.process_exit import keep_until_exit
from serving.server import serve_until_signal, start_server
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.plan.heads import HeadLayout
from transfer.plan.states import StateLayout
from transfer.setup import make_kv_manager

SERVICE_NAME = "pdserve.v1.DecodeWorker"


async def serve_decode(
    model_dir: Path, config: EngineConfig, host: str, port: int, *, transfer_backend: str,
    advertise_host: str, draft: Path | None = None, num_draft_tokens: int = 3,
    draft_topk: int = 1, draft_steps: int | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING, security: ServerSecurity | None = None,
    bootstrap_config: BootstrapConfig | None = None, metrics_port: int | None = None,
    keepalive: Keepalive = DEFAULT_KEEPALIVE,
) -> None:
    """Run a decode worker until SIGINT/SIGTERM; prints ``READY <port>`` once serving.

    With ``draft`` it decodes in EAGLE rounds of ``num_draft_tokens`` (a chain, or a tree of
    ``draft_topk`` children per node, ``draft_steps`` deep) and receives the draft's KV next to
    the target's (``config.lookahead_tokens`` must cover a round: ``TreeShape.lookahead``).
    ``max_waiting`` bounds the admission queue (see :mod:`decode_node.service`);
    ``bootstrap_config`` sets the handshake timeouts of its connections to prefill nodes.
    Its CUDA graphs are captured first (:mod:`decode_node.warmup`), the line saying what was
    printed. With ``config.tp_size`` above 1 the engine's other ranks run in their own
    processes, ended at shutdown. Each registers its key/value heads of every page with a
    transfer engine of its own (:mod:`decode_node.tp_ranks`); rank 0 registers them all with
    each prefill, which writes every rank its heads (:mod:`transfer.plan.heads`), into a rank's
    landing slots when several prefill ranks hold slices of its heads (:mod:`decode_node.landing`).
    """
    text = ModelConfig.from_dir(model_dir).text
    if draft is not None:  # a hybrid model's refusals, before anything loads
        refusal = spec_refusal(text, TreeShape(num_draft_tokens, draft_topk, draft_steps))
        if refusal is not None:
            raise ConfigError(refusal)
    authkey = secrets.token_bytes(32)  # the other TP ranks' landing agents take orders from us
    # a transfer connection whose prefill went silent past the peer timeout is dropped, so a
    # write stalled by a partition cannot land after the failed room's pages are reused
    silent_peer_s = (bootstrap_config or BootstrapConfig()).peer_timeout_s
    attach = RankTransfer(transfer_backend, advertise_host, text.hidden_size, authkey,
                          silent_peer_s)

    def build() -> tuple[LLMEngine, EagleEngine | None]:
        engine = LLMEngine(model_dir, config, rank_attach=attach, draft=draft)
        spec = None
        if draft is not None:
            spec = EagleEngine(engine, engine.load_draft(), num_draft_tokens, draft_topk,
                               draft_steps)
        # every kernel serving compiles and graph it replays, before any other thread
        # (transfer, gRPC) runs
        print(kernels(engine, spec).line(), flush=True)
        print(warm_up(engine, spec).line(), flush=True)
        return engine, spec

    compute = ComputeThread("decode-loop")  # builds, warms up and steps the engine
    engine, spec = await compute.call(build)
    pools = spec.drafter.pools() if spec is not None else [engine.pool]
    state_pool = engine.states.pool if engine.states is not None else None
    manager = make_kv_manager(
        transfer_backend, [b for pool in pools for b in pool.buffer_infos()],
        hidden_size=engine.model_config.text.hidden_size,
        aux_rows=2 * config.max_num_seqs, hostname=advertise_host,
        states=state_pool.buffer_infos() if state_pool is not None else (),
        silent_peer_s=silent_peer_s,
    )
    keep_until_exit(manager)  # its engine's destructor is skipped at exit (serving.process_exit)
    heads = HeadLayout.tensor_parallel(text.num_key_value_heads, config.tp_size,
                                       head_dim=text.head_dim, dtype=engine.config.dtype,
                                       page_size=config.page_size)
    identity = ModelIdentity(model_fingerprint(model_dir), config.page_size, config.dtype,
                             text.num_hidden_layers, heads=heads,
                             states=StateLayout.of(text.linear, state_pool, config.tp_size))
    service = DecodeService(max_waiting)
    service.kv_events = hub = kv_event_hub(engine)
    loop = DecodeLoop(engine, service.emit, spec, compute)
    longest = -(-engine.scheduler.config.max_model_len // config.page_size)
    landings = Landings(pools, manager, heads, min(engine.scratch_page, longest),
                        landing_agents(engine.rank_payloads, authkey))
    clients = BootstrapClients(manager, identity, loop.remote.free_later, bootstrap_config,
                               rank_registrations(engine.rank_payloads, identity), landings)
    service.bind(loop, asyncio.get_running_loop(), clients)
    loop.start()
    server, bound, _ = await start_server(
        [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, service, SERVICE_NAME)], host, port,
        role="decode", stats=service.stats, security=security,
        metrics_port=metrics_port, keepalive=keepalive,
    )
    await serve_until_signal(server, bound, loop.stop, clients.close, engine.close,
                             on_signal=hub.close if hub is not None else None)

