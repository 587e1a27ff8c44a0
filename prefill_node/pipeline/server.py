"""Starting the processes of a pipeline-parallel prefill (``pdserve prefill --pp-size S``).

Start the stages from the last to the first (each waits up to two minutes for its
``--pp-next``): stage ``r >= 1`` serves ``PipelineStage`` (and a ``PrefillWorker`` face for
load reports); stage 0 serves ``PrefillWorker`` to the router and reports, as its bootstrap
address, every stage's address comma-separated in stage order, which a decode node connects to
one by one.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from engine.checkpoint import model_fingerprint
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import pages_for_budget
from engine.llm_engine import DTYPES, LLMEngine
from prefill_node.pipeline.follower import StageWorker
from prefill_node.pipeline.head import HeadLoop
from prefill_node.pipeline.head_runner import make_head_engine
from prefill_node.pipeline.layout import StageSpec, load_stage
from prefill_node.pipeline.link import Downstream
from prefill_node.pipeline.service import StageService, StageWorkerService
from prefill_node.service import DEFAULT_MAX_WAITING, PrefillService
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admin import StatsSource
from serving.auth import Metadata, ServerSecurity, internal_metadata
from serving.metrics import TransferMetrics
from serving.server import serve_until_signal, start_server
from transfer.bootstrap import BootstrapConfig, ModelIdentity
from transfer.bootstrap_prefill import PrefillBootstrapServer
from transfer.setup import make_kv_manager


def _link(spec: StageSpec, layers: range, pp_next: str | None, metadata: Metadata
          ) -> Downstream | None:
    """Connect to the next stage (sending ``metadata`` on every call) and check it continues
    this one's layers."""
    if spec.is_last:
        if pp_next:
            raise ValueError("the last pipeline stage takes no --pp-next")
        return None
    if not pp_next:
        raise ValueError(f"pipeline stage {spec.rank} of {spec.size} needs --pp-next HOST:PORT")
    down = Downstream(pp_next, metadata)
    info = down.describe()
    expected = (spec.rank + 1, spec.size, layers.stop)
    if (info.pp_rank, info.pp_size, info.layer_start) != expected:
        down.close()
        raise ValueError(f"--pp-next {pp_next} is stage {info.pp_rank} of {info.pp_size} "
                         f"from layer {info.layer_start}; expected stage {expected[0]} of "
                         f"{expected[1]} from layer {expected[2]}")
    return down


async def serve_stage(
    model_dir: Path, config: EngineConfig, host: str, port: int, *, spec: StageSpec,
    pp_next: str | None, bootstrap_port: int, transfer_backend: str, advertise_host: str,
    max_waiting: int = DEFAULT_MAX_WAITING, security: ServerSecurity | None = None,
    bootstrap_config: BootstrapConfig | None = None, metrics_port: int | None = None,
) -> None:
    """Run one pipeline stage until SIGINT/SIGTERM; prints ``READY <port>`` once serving.

    Every stage serves ``Admin`` (stage 0 as ``prefill``, later ones as ``prefill-stage``);
    ``security``'s token rules guard every service, ``PipelineStage`` included: a stage calls
    the next with the internal token of ``bootstrap_config``."""
    identity = ModelIdentity(model_fingerprint(model_dir), config.page_size, config.dtype)
    if spec.is_first:
        text = ModelConfig.from_dir(model_dir).text
        layers = spec.layers(text.num_hidden_layers)
        # pages as if every layer were held: stage 0 admits no more than any later stage holds
        num_pages = config.num_pages or pages_for_budget(
            config.kv_budget_bytes, text.num_hidden_layers, config.page_size,
            text.num_key_value_heads, text.head_dim, DTYPES[config.dtype])
        engine = LLMEngine(model_dir, replace(config, layers=layers, num_pages=num_pages))
        runner = make_head_engine(engine)
        pool, hidden_size = engine.pool, text.hidden_size
    else:
        stage = load_stage(model_dir, config, spec)
        layers, pool, hidden_size = stage.layers, stage.pool, stage.model_config.text.hidden_size
    secret = bootstrap_config.secret if bootstrap_config is not None else None
    down = await asyncio.to_thread(_link, spec, layers, pp_next, internal_metadata(secret))
    manager = make_kv_manager(transfer_backend, pool.buffer_infos(), hidden_size=hidden_size,
                              aux_rows=4, hostname=advertise_host)
    bootstrap = PrefillBootstrapServer(manager, identity, host=host, port=bootstrap_port,
                                       config=bootstrap_config)
    chain = f"{advertise_host}:{bootstrap.address[1]}"
    if down is not None:
        chain += "," + (await asyncio.to_thread(down.describe)).bootstrap
    info = wpb.StageInfo(pp_rank=spec.rank, pp_size=spec.size, layer_start=layers.start,
                         layer_end=layers.stop, bootstrap=chain)
    head: HeadLoop | None = None
    stats: StatsSource
    if spec.is_first:
        assert down is not None
        service = PrefillService(max_waiting)
        stats, role = service.stats, "prefill"
        head = HeadLoop(engine, bootstrap, service.on_done, runner, down)
        service.bind(head, asyncio.get_running_loop(), chain)
        head.start()
        services = [(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, service,
                     "pdserve.v1.PrefillWorker")]
    else:
        worker = StageWorker(stage, bootstrap, config.page_size, down)
        face = StageWorkerService(worker, info)
        stats, role = face.stats, "prefill-stage"
        services = [
            (worker_pb2_grpc.add_PipelineStageServicer_to_server, StageService(worker, info),
             "pdserve.v1.PipelineStage"),
            (worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
             face, "pdserve.v1.PrefillWorker"),
        ]
    server, bound, _ = await start_server(
        services, host, port, role=role, stats=stats, security=security,
        metrics_port=metrics_port, metrics_collectors=TransferMetrics().watch(manager))
    cleanups = [head.stop] if head is not None else []
    cleanups.append(bootstrap.close)
    if down is not None:
        cleanups.append(down.close)
    await serve_until_signal(server, bound, *cleanups)
