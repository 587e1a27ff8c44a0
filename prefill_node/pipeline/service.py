"""gRPC services of a later pipeline stage: ``PipelineStage`` (driven by the previous stage)
and a ``PrefillWorker`` face for load reports and aborts (it refuses ``Prefill``: rooms enter
a pipeline at stage 0)."""

from __future__ import annotations

import asyncio

import grpc

from prefill_node.pipeline.follower import StageWorker
from prefill_node.service import aux_figures
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from transfer.faults import fault_figures


class StageService(worker_pb2_grpc.PipelineStageServicer):
    def __init__(self, worker: StageWorker, info: wpb.StageInfo) -> None:
        self.worker, self.info = worker, info

    async def RunStep(  # noqa: N802 - gRPC method name
        self, request: wpb.StageStep, context: grpc.aio.ServicerContext
    ) -> wpb.StageStepReply:
        try:
            return await asyncio.to_thread(self.worker.run_step, request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises

    async def Describe(  # noqa: N802
        self, request: wpb.DescribeStageRequest, context: grpc.aio.ServicerContext
    ) -> wpb.StageInfo:
        return self.info


class StageWorkerService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: StageWorker, info: wpb.StageInfo) -> None:
        self.worker, self.info = worker, info

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
            found=await asyncio.to_thread(self.worker.abort, request.room, reason))

    async def GetLoad(  # noqa: N802
        self, request: wpb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> wpb.LoadReport:
        return wpb.LoadReport(bootstrap=self.info.bootstrap, **self.worker.stats())

    def stats(self) -> dict[str, int]:
        """Figures for ``Admin.GetStats`` (blocking)."""
        manager = self.worker.bootstrap.manager
        return {**self.worker.stats(), **aux_figures(manager.aux), **fault_figures(manager.faults)}
