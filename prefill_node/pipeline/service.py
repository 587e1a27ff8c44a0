"""gRPC services of a later pipeline stage: ``PipelineStage`` (driven by the stage before it)
and a ``PrefillWorker`` face for load reports and aborts (it refuses ``Prefill``: rooms enter
a pipeline at the first stage).

A stage whose tensor-parallel rank died cannot run a step again: the step that found out fails
with ``UNAVAILABLE`` and the stage ends itself with status 1
(:func:`serving.process_exit.end_with_failure`), as a whole prefill does."""

from __future__ import annotations

import asyncio
from functools import partial

import grpc

from engine.errors import TensorParallelError
from prefill_node.pipeline.later import LaterStage
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.admin import load_report
from serving.compute_thread import ComputeThread
from serving.process_exit import end_with_failure
from serving.status import STATUS_ERRORS, abort_with_status
from transfer.aux import aux_figures
from transfer.faults import fault_figures


class LaterStageService(worker_pb2_grpc.PipelineStageServicer):
    """Serves ``PipelineStage`` over a :class:`LaterStage`."""

    def __init__(self, stage: LaterStage, info: wpb.StageInfo,
                 compute: ComputeThread | None = None) -> None:
        """``compute``: the thread the stage's share was loaded on, which runs its steps (one
        thread for every step: see :mod:`serving.compute_thread`; one of its own when None)."""
        self.stage, self.info = stage, info
        self.compute = compute or ComputeThread("stage-steps")

    async def RunStep(  # noqa: N802 - gRPC method name
        self, request: wpb.StageStep, context: grpc.aio.ServicerContext
    ) -> wpb.StageStepReply:
        try:
            return await self.compute.call(partial(self.stage.run_step, request))
        except STATUS_ERRORS as exc:
            if isinstance(exc, TensorParallelError):
                end_with_failure(f"pipeline stage {self.info.pp_rank}: {exc}")
            await abort_with_status(context, exc)

    async def Describe(  # noqa: N802
        self, request: wpb.DescribeStageRequest, context: grpc.aio.ServicerContext
    ) -> wpb.StageInfo:
        return self.info


class LaterStageWorkerFace(worker_pb2_grpc.PrefillWorkerServicer):
    """Serves ``PrefillWorker`` for a later stage: load reports and aborts, no rooms."""

    def __init__(self, stage: LaterStage, info: wpb.StageInfo) -> None:
        self.stage, self.info = stage, info

    async def Prefill(  # noqa: N802
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> wpb.PrefillResponse:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this is pipeline stage {self.info.pp_rank}; send rooms to stage 0")
        raise AssertionError("unreachable")

    async def AbortRoom(  # noqa: N802
        self, request: wpb.AbortRoomRequest, context: grpc.aio.ServicerContext
    ) -> wpb.AbortRoomResponse:
        reason = request.reason or "aborted"
        return wpb.AbortRoomResponse(
            found=await asyncio.to_thread(self.stage.abort, request.room, reason))

    async def GetLoad(  # noqa: N802
        self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> wpb.LoadReport:
        # never behind a step (serving/figures.py)
        return load_report(self.stage.load(), bootstrap=self.info.bootstrap)

    def stats(self) -> dict[str, int]:
        """Figures for ``Admin.GetStats`` (blocking)."""
        manager = self.stage.bootstrap.manager
        return {**self.stage.stats(), **aux_figures(manager.aux), **fault_figures(manager.faults)}
