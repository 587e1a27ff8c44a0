"""Starting the processes of a pipeline-parallel prefill (``pdserve prefill --pp-size S``).

Start the stages from the last to the first (each waits up to two minutes for its
``--pp-next``). A later stage (rank >= 1, :func:`serve_later_stage`) serves ``PipelineStage``
and a ``PrefillWorker`` face for load reports; the first stage (rank 0,
:func:`serve_first_stage`) serves ``PrefillWorker`` to the router and reports, as its bootstrap
address, every stage's address comma-separated in stage order, which a decode node connects to
one by one.

With ``--draft`` the last stage runs the EAGLE draft and pushes its KV in the draft band; its
``Describe`` names that band, which every stage before it reports on and checks decodes against
(a decode with a draft is refused unless the pipeline has the same one).

With ``--tp-size N`` a stage is rank 0 of ``N`` processes holding its layers' heads; its other
ranks register their KV and write it on its word (:mod:`prefill_node.kv_transfer`), and its
bootstrap endpoint describes its heads over its ``N`` ranks. Each stage's ``N`` is its own.

Every stage serves ``Admin`` (the first as ``prefill``, later ones as ``prefill-stage``);
``security``'s token rules guard every service, ``PipelineStage`` included: a stage calls the
next with the internal token of ``bootstrap_config``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from engine.checkpoint import model_fingerprint
from engine.config import EngineConfig, ModelConfig, TextConfig
from engine.device import resolve_device, resolve_dtype
from engine.kv.pool import KVPool, pages_for_budget
from engine.kv.state_pool import StatePool
from engine.llm_engine import LLMEngine
from prefill_node.kv_transfer import (
    PrefillRankTransfer,
    prefill_heads,
    prefill_manager,
    remote_ranks,
)
from prefill_node.pipeline.first import FirstStageLoop
from prefill_node.pipeline.first_runner import first_stage_runner
from prefill_node.pipeline.later import LaterStage
from prefill_node.pipeline.layout import DRAFT_ON_EARLY_STAGE, StageLayout, load_later_stage
from prefill_node.pipeline.link import NextStageLink
from prefill_node.pipeline.service import LaterStageService, LaterStageWorkerFace
from prefill_node.service import PrefillService
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admin import StatsSource
from serving.admission import DEFAULT_MAX_WAITING
from serving.auth import Metadata, ServerSecurity, internal_metadata
from serving.compute_thread import ComputeThread
from serving.keepalive import Keepalive
from serving.metrics import TransferMetrics
from serving.server import Registration, serve_until_signal, start_server
from transfer.base import KVManager
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.plan.states import StateLayout
from transfer.tp.rank_agent import RemoteRank


@dataclass(frozen=True)
class StageArgs:
    """How a stage process was started (the ``pdserve prefill`` flags it uses)."""

    model_dir: Path
    config: EngineConfig
    host: str
    port: int
    layout: StageLayout
    pp_next: str | None
    bootstrap_port: int
    transfer_backend: str
    advertise_host: str
    max_waiting: int = DEFAULT_MAX_WAITING  # the first stage's admission bound
    security: ServerSecurity | None = None
    bootstrap_config: BootstrapConfig | None = None
    metrics_port: int | None = None
    draft: Path | None = None  # the EAGLE draft directory (the last stage only)
    keepalive: Keepalive = Keepalive()  # of its server and its link to the next stage

    def __post_init__(self) -> None:
        if self.draft is not None and not self.layout.is_last:
            raise ValueError(DRAFT_ON_EARLY_STAGE)


@dataclass(frozen=True)
class _Endpoints:
    """What every stage sets up around its layers: KV transfer and the link to the next."""

    manager: KVManager
    bootstrap: PrefillBootstrapServer
    link: NextStageLink | None
    chain: str  # the bootstrap addresses of this stage and every later one, comma-separated
    draft_band: tuple[int, ...]  # the KV layer ids of the pipeline's draft (empty: none)
    aux_ids: tuple[int, ...]  # the target layers its EAGLE-3 draft fuses (empty: none)
    ranks: tuple[RemoteRank, ...]  # the stand-ins of the stage's other TP ranks


async def serve_first_stage(args: StageArgs) -> None:
    """Run the first stage until SIGINT/SIGTERM; prints ``READY <port>`` once serving."""
    text = ModelConfig.from_dir(args.model_dir).text
    config = args.config
    layers = args.layout.layers(text.num_hidden_layers)
    # pages as if every layer were held: the first stage admits no more than any later holds
    num_pages = config.num_pages or pages_for_budget(
        config.kv_budget_bytes, text.num_hidden_layers, config.page_size,
        text.num_key_value_heads, text.head_dim,
        resolve_dtype(config.dtype, resolve_device(config.device)))
    authkey = secrets.token_bytes(32)  # the other TP ranks' agents take orders from this one
    # no prefix cache on a pipeline (FirstStageLoop), so no state checkpoint slots either
    compute = ComputeThread("prefill-loop")  # builds and steps the stage's engine
    engine = await compute.call(partial(
        LLMEngine, args.model_dir, replace(config, layers=layers, num_pages=num_pages,
                                           enable_prefix_cache=False),
        rank_attach=_rank_attach(args, text, authkey)))
    ends = await _open_endpoints(args, layers, [engine.pool], text,
                                 remote_ranks(engine.rank_payloads, authkey),
                                 states=engine.states.pool if engine.states else None)
    assert ends.link is not None  # the first stage is never the last: size > 1
    runner = first_stage_runner(engine, ends.aux_ids)
    service = PrefillService(args.max_waiting)
    loop = FirstStageLoop(engine, ends.bootstrap, service.on_done, runner, ends.link,
                          send_prompt_ids=bool(ends.draft_band), compute=compute)
    service.bind(loop, asyncio.get_running_loop(), ends.chain)
    loop.start()
    await _serve(args, ends, [(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, service,
                               "pdserve.v1.PrefillWorker")],
                 "prefill", service.stats, engine.close, loop.stop)


async def serve_later_stage(args: StageArgs) -> None:
    """Run a later stage until SIGINT/SIGTERM; prints ``READY <port>`` once serving."""
    text = ModelConfig.from_dir(args.model_dir).text
    authkey = secrets.token_bytes(32)
    compute = ComputeThread("stage-steps")  # loads the share and runs every step on it
    share = await compute.call(partial(load_later_stage, args.model_dir, args.config,
                                       args.layout, args.draft,
                                       _rank_attach(args, text, authkey)))
    aux = share.draft.aux_layers if share.draft is not None else ()
    ends = await _open_endpoints(args, share.layers, share.pools(), text,
                                 remote_ranks(share.rank_payloads, authkey), aux,
                                 states=share.states.pool if share.states else None)
    stage = LaterStage(share, ends.bootstrap, args.config.page_size, ends.link, ends.aux_ids)
    info = wpb.StageInfo(pp_rank=args.layout.rank, pp_size=args.layout.size,
                         layer_start=share.layers.start, layer_end=share.layers.stop,
                         bootstrap=ends.chain, draft_layer_ids=ends.draft_band,
                         aux_layer_ids=ends.aux_ids)
    face = LaterStageWorkerFace(stage, info)
    await _serve(args, ends, [
        (worker_pb2_grpc.add_PipelineStageServicer_to_server,
         LaterStageService(stage, info, compute),
         "pdserve.v1.PipelineStage"),
        (worker_pb2_grpc.add_PrefillWorkerServicer_to_server, face, "pdserve.v1.PrefillWorker"),
    ], "prefill-stage", face.stats, share.close)


def _rank_attach(args: StageArgs, text: TextConfig, authkey: bytes) -> PrefillRankTransfer:
    """The attach hook of this stage's other TP ranks (unused with one rank)."""
    return PrefillRankTransfer(args.transfer_backend, args.advertise_host, text.hidden_size,
                               authkey, _silent_peer_s(args))


def _silent_peer_s(args: StageArgs) -> float:
    """How long the stage's transfer connections let a silent decode live: the handshake's
    peer timeout (:mod:`transfer.backends.keepalive`)."""
    return (args.bootstrap_config or BootstrapConfig()).peer_timeout_s


async def _open_endpoints(args: StageArgs, layers: range, pools: list[KVPool],
                          text: TextConfig, ranks: Sequence[RemoteRank],
                          aux_ids: Sequence[int] = (), *, states: StatePool | None = None
                          ) -> _Endpoints:
    """Link to the next stage (waiting for it), register ``pools`` (the stage's, then the
    draft's) and a hybrid model's ``states`` (the stage's linear-attention layers) for
    transfer (:mod:`prefill_node.kv_transfer`) and open the bootstrap
    endpoint, with the stage's other TP ``ranks`` writing their heads (``pools`` are rank 0's);
    it accepts a decode with a draft only when the pipeline's last stage
    runs the same one (the draft band: this stage's own on the last, else the next's; so are
    ``aux_ids``, the target layers an EAGLE-3 draft fuses, given on the last stage)."""
    secret = args.bootstrap_config.secret if args.bootstrap_config is not None else None
    linked = await asyncio.to_thread(_link, args.layout, layers, args.pp_next,
                                     internal_metadata(secret), args.keepalive)
    link, later = None, ""  # later: the bootstrap addresses of the later stages
    if linked is None:
        band = tuple(sorted({lid for p in pools for lid in p.layer_ids
                             if lid >= text.num_hidden_layers}))
    else:
        link, info = linked
        band, later = tuple(info.draft_layer_ids), "," + info.bootstrap
        aux_ids = tuple(info.aux_layer_ids)
    identity = ModelIdentity(model_fingerprint(args.model_dir), args.config.page_size,
                             args.config.dtype, text.num_hidden_layers,
                             pipeline_draft_band=band,
                             heads=prefill_heads(text, pools[0], args.config.tp_size),
                             states=StateLayout.of(text.linear, states, args.config.tp_size))
    manager = prefill_manager(args.transfer_backend, pools, hidden_size=text.hidden_size,
                              hostname=args.advertise_host, states=states,
                              silent_peer_s=_silent_peer_s(args))
    bootstrap = PrefillBootstrapServer(manager, identity, host=args.host,
                                       port=args.bootstrap_port, config=args.bootstrap_config,
                                       ranks=ranks)
    chain = f"{args.advertise_host}:{bootstrap.address[1]}{later}"
    return _Endpoints(manager, bootstrap, link, chain, band, tuple(aux_ids), tuple(ranks))


def _link(layout: StageLayout, layers: range, pp_next: str | None, metadata: Metadata,
          keepalive: Keepalive) -> tuple[NextStageLink, wpb.StageInfo] | None:
    """Connect to the next stage (sending ``metadata`` on every call, pinging it as
    ``keepalive`` says) and check it continues this one's layers; the link and the next
    stage's description."""
    if layout.is_last:
        if pp_next:
            raise ValueError("the last pipeline stage takes no --pp-next")
        return None
    if not pp_next:
        raise ValueError(f"pipeline stage {layout.rank} of {layout.size} needs "
                         "--pp-next HOST:PORT")
    link = NextStageLink(pp_next, metadata, keepalive)
    info = link.describe()
    expected = (layout.rank + 1, layout.size, layers.stop)
    if (info.pp_rank, info.pp_size, info.layer_start) != expected:
        link.close()
        raise ValueError(f"--pp-next {pp_next} is stage {info.pp_rank} of {info.pp_size} "
                         f"from layer {info.layer_start}; expected stage {expected[0]} of "
                         f"{expected[1]} from layer {expected[2]}")
    return link, info


async def _serve(args: StageArgs, ends: _Endpoints, services: Sequence[Registration],
                 role: str, stats: StatsSource, close_ranks: Callable[[], object],
                 *stop_first: Callable[[], object]) -> None:
    """Serve ``services`` (and ``Admin`` as ``role``) until a signal; then run ``stop_first``,
    close the endpoints and end the stage's other TP ranks (``close_ranks``)."""
    server, bound, _ = await start_server(
        services, args.host, args.port, role=role, stats=stats, security=args.security,
        metrics_port=args.metrics_port,
        metrics_collectors=TransferMetrics().watch(ends.manager, *ends.ranks),
        keepalive=args.keepalive)
    cleanups = [*stop_first, ends.bootstrap.close]
    if ends.link is not None:
        cleanups.append(ends.link.close)
    cleanups.append(close_ranks)
    await serve_until_signal(server, bound, *cleanups)
