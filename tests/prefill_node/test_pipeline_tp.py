"""A two-stage prefill with two tensor-parallel ranks on each stage (CPU processes, gloo) equals
the same pipeline in one process per stage: the first stage's hidden states, the last stage's
first tokens, and each stage's KV of rank 0's heads in the pages it pushed (the last stage's
EAGLE draft band too). Both stages' other ranks hold a layer range (the last one not starting at
layer 0) and end with their stage. The stages' TP sizes may differ. A later stage whose rank
died fails the step ``UNAVAILABLE`` and ends itself."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
import pytest
import torch

from engine.builtin.tiny_model import write_random_draft
from engine.errors import TensorParallelError
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine
from prefill_node.pipeline import service
from prefill_node.pipeline.first_runner import first_stage_runner
from prefill_node.pipeline.later import LaterStage
from prefill_node.pipeline.layout import StageLayout, load_later_stage
from prefill_node.pipeline.link import pack_step_tensors
from proto.pdserve.v1 import worker_pb2 as wpb
from tests.engine.test_generation_vs_transformers import cases
from tests.prefill_node.test_pipeline_draft import PAGE, RecordingBootstrap, announce, config
from transfer.bootstrap.prefill import PrefillBootstrapServer

pytestmark = pytest.mark.slow  # each TP stage starts a rank's process

ROOMS = {31: cases()["text_only"], 32: cases()["one_image"]}


@dataclass
class Run:
    hidden: list[torch.Tensor]  # the first stage's output, per step
    samples: list[tuple[int, float]]
    kv: list[torch.Tensor]  # per stage, layer, K then V: the pushed pages, rank 0's heads


def pushed_kv(pool: KVPool, pages: list[int], heads: int) -> list[torch.Tensor]:
    return [buf[pages][:, :, :heads] for layer in range(len(pool.k))
            for buf in (pool.k[layer], pool.v[layer])]


def run_first(model_dir: Path, tp_size: int, run: Run) -> list[wpb.StageStep]:
    """The first stage over every room; the steps it sends on. A process joins one
    tensor-parallel group at a time, so the stages run one after the other: each room asks for
    one token, so what the first stage schedules does not depend on the samples."""
    first = LLMEngine(model_dir, config(layers=range(0, 1), tp_size=tp_size))
    try:
        first.disable_prefix_cache()
        runner = first_stage_runner(first)
        new = [announce(first, room, ids, ims) for room, (ids, ims) in ROOMS.items()]
        steps, pages = [], []
        while first.scheduler.has_unfinished():
            out = first.scheduler.schedule()
            hidden, mrope, _ = runner.execute(out)
            run.hidden.append(hidden.clone())
            pages += [p for it in out.items for p in it.request.page_ids if p not in pages]
            items = [wpb.StageItem(room=int(it.request.request_id), start=it.start,
                                   num_tokens=it.num_tokens, needs_sample=it.needs_sample)
                     for it in out.items]
            packed = pack_step_tensors(hidden, mrope)
            steps.append(wpb.StageStep(new_rooms=new, items=items, hidden=packed[0],
                                       mrope_positions=packed[1]))
            new = []
            first.scheduler.update(out, [(0, 0.0)] * sum(it.needs_sample for it in out.items))
        run.kv += pushed_kv(first.pool, pages, first.pool.num_kv_heads)
        return steps
    finally:
        first.close()


def run_pipeline(model_dir: Path, first_tp: int, later_tp: int, draft: Path | None) -> Run:
    run = Run([], [], [])
    steps = run_first(model_dir, first_tp, run)
    share = load_later_stage(model_dir, config(tp_size=later_tp), StageLayout(2, 1), draft)
    try:
        assert share.layers == range(1, 3)
        bootstrap = RecordingBootstrap()
        stage = LaterStage(share, cast(PrefillBootstrapServer, bootstrap), PAGE, None)
        for step in steps:
            reply = stage.run_step(step)
            assert not reply.failed
            run.samples += [(s.token, s.logprob) for s in reply.samples]
        pages = sorted({p for ps in bootstrap.pages.values() for p in ps})
        for pool in share.pools():  # the stage's, then the draft's
            run.kv += pushed_kv(pool, pages, pool.num_kv_heads)
        assert stage.stats()["kv_pages_used"] == 0
        return run
    finally:
        share.close()


@pytest.mark.parametrize(("first_tp", "later_tp", "with_draft"),
                         [(2, 2, False), (1, 2, True)])
def test_a_tp_pipeline_equals_the_one_process_pipeline(
    hf_dir: Path, tmp_path: Path, first_tp: int, later_tp: int, with_draft: bool
) -> None:
    """Each stage's TP size is its own: (1, 2) mixes them, with an EAGLE draft on the last
    stage (its layer split over the stage's ranks, its band pushed like the stage's layers)."""
    draft = None
    if with_draft:
        text = json.loads((hf_dir / "config.json").read_text())["text_config"]
        draft = write_random_draft(tmp_path / "draft", text)
    want = run_pipeline(hf_dir, 1, 1, draft)
    got = run_pipeline(hf_dir, first_tp, later_tp, draft)
    assert not mp.active_children(), "a rank's process outlived its stage"
    assert len(got.hidden) == len(want.hidden) > 2  # chunked prompts
    for mine, ref in zip(got.hidden, want.hidden, strict=True):
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)
    assert [t for t, _ in got.samples] == [t for t, _ in want.samples]
    torch.testing.assert_close([lp for _, lp in got.samples], [lp for _, lp in want.samples],
                               atol=1e-4, rtol=1e-4)
    # first stage's layer, then the later's two, then the draft's
    assert len(got.kv) == len(want.kv) == 2 * (3 + with_draft)
    for i, (mine, ref) in enumerate(zip(got.kv, want.kv, strict=True)):
        tp = first_tp if i < 2 else later_tp
        assert mine.shape[2] == 2 // tp  # 2 KV heads over the stage's ranks: rank 0's
        torch.testing.assert_close(mine, ref[:, :, : 2 // tp], atol=1e-4, rtol=1e-4)


class Aborted(Exception):
    pass


class AbortingContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str, **_: object) -> None:
        self.code = code
        raise Aborted(details)


class DeadRankStage:
    def run_step(self, step: wpb.StageStep) -> wpb.StageStepReply:
        raise TensorParallelError("tensor-parallel rank 1 died during a step (exit code -9)")


def test_a_later_stage_whose_rank_died_fails_the_step_and_ends_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ended: list[str] = []
    monkeypatch.setattr(service, "end_with_failure", ended.append)
    servicer = service.LaterStageService(cast(LaterStage, DeadRankStage()),
                                         wpb.StageInfo(pp_rank=1, pp_size=2))
    context = AbortingContext()
    with pytest.raises(Aborted, match="rank 1 died"):
        asyncio.run(servicer.RunStep(wpb.StageStep(), cast(grpc.aio.ServicerContext, context)))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert ended == ["pipeline stage 1: tensor-parallel rank 1 died during a step (exit code -9)"]
