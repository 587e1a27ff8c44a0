"""The last stage of a two-stage prefill with the EAGLE draft, in-process (no transfer): fed
the first stage's hidden states chunk by chunk, it writes the same draft KV into the pages it
pushes, and puts the same first token and last-row feature in the aux row, as a whole-model
prefill with the draft (``engine/runner/draft_runner.py``), for text and image prompts batched
together, with an EAGLE-1/2 draft and an EAGLE-3 one (whose target layers lie on both stages). A
room announced without its prompt ids fails there, naming why."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

from engine.builtin.tiny_model import (
    tiny_config_dict,
    write_tiny_draft,
    write_tiny_eagle3_draft,
    write_tiny_model,
)
from engine.config import EngineConfig
from engine.core.request import SamplingParams
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine
from engine.models.eagle.loader import load_draft
from engine.multimodal.inputs import ImageInput, RequestState
from engine.runner.draft_runner import DraftRunner
from prefill_node.pipeline.aux_layers import pack_aux
from prefill_node.pipeline.first_runner import first_stage_runner
from prefill_node.pipeline.later import LaterStage
from prefill_node.pipeline.layout import StageLayout, load_later_stage
from prefill_node.pipeline.link import pack_step_tensors
from proto.convert import sampling_message
from proto.pdserve.v1 import worker_pb2 as wpb
from transfer.aux import AuxRow
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.status import KVPoll

PAGE, CHUNK = 8, 16
FIRST_ONLY = SamplingParams(max_new_tokens=1)
SPECIAL = tiny_config_dict()
IMG, VS, VE = (SPECIAL[k] for k in ("image_token_id", "vision_start_token_id",
                                    "vision_end_token_id"))


class RecordingBootstrap:
    """What :class:`LaterStage` calls on its bootstrap server: every destination is there at
    once, and each room's pushed pages and aux row are recorded instead of sent."""

    def __init__(self) -> None:
        self.rooms: set[int] = set()
        self.pages: dict[int, list[int]] = {}
        self.aux: dict[int, AuxRow] = {}

    @property
    def num_rooms(self) -> int:
        return len(self.rooms)

    def add_room(self, room: int) -> None:
        self.rooms.add(room)

    def poll(self, room: int) -> KVPoll:
        return KVPoll.WaitingForInput

    def send_chunk(self, room: int, pages: Sequence[int], *, last: AuxRow | None = None,
                   finish: bool = False, state_slot: int | None = None) -> KVPoll:
        assert state_slot is None, "a full-attention model has no states to send"
        self.pages.setdefault(room, []).extend(pages)
        if last is not None:
            self.aux[room] = last
        return KVPoll.Success if finish else KVPoll.Transferring

    def abort(self, room: int, reason: str) -> None:
        raise AssertionError(f"room {room} failed: {reason}")

    def release(self, room: int) -> None:
        self.rooms.discard(room)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("pipeline-draft") / "model")
    write_tiny_draft(path / "draft")
    return path


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an EAGLE-3 draft of layers (1, 0, 1): one on each stage, out of
    order and repeated."""
    path = write_tiny_model(tmp_path_factory.mktemp("pipeline-eagle3") / "model")
    write_tiny_eagle3_draft(path / "draft")
    return path


def cases() -> dict[int, tuple[list[int], list[ImageInput]]]:
    """Room -> prompt: several chunks of text, and an image inside text (both batched)."""
    rng = np.random.default_rng(0)
    img = ImageInput(torch.from_numpy(rng.standard_normal((24, 1176)).astype("f4")), (1, 4, 6))
    return {11: (list(range(1, 42)), []), 12: ([3, VS, *[IMG] * 6, VE, *range(30, 50)], [img])}


def config(**kw: Any) -> EngineConfig:
    return EngineConfig(num_pages=64, page_size=PAGE, max_num_batched_tokens=CHUNK, **kw)


class Done:
    """What a prefill left for one room: its first token, the draft's last-row feature
    ``[H]``, and the draft's K and V of the prompt's rows ``[n, heads, head_dim]``."""

    def __init__(self, token: int, seed: torch.Tensor, pool: KVPool, pages: list[int],
                 n: int) -> None:
        assert len(pages) == -(-n // PAGE)
        self.token, self.seed = token, seed.clone()
        # taken when the room ends: its pages go back to the allocator for the next room
        self.kv = [buf[pages].flatten(0, 1)[:n].clone() for buf in (pool.k[0], pool.v[0])]


def whole_model(model_dir: Path) -> dict[int, Done]:
    """The whole-model prefill with the draft, per room."""
    engine = LLMEngine(model_dir, config())
    engine.disable_prefix_cache()
    drafter = DraftRunner(engine, load_draft(model_dir / "draft", engine.model_config.text,
                                             engine.model.dtype))
    for room, (ids, ims) in cases().items():
        engine.add_request(ids, ims, FIRST_ONLY, request_id=str(room))
    done: dict[int, Done] = {}
    while engine.scheduler.has_unfinished():
        out = engine.scheduler.schedule()
        samples, fwd = engine.forward_states(out)
        seeds = drafter.prefill(out, samples, fwd)
        sampled = [it.request for it in out.items if it.needs_sample]
        for req, (token, _) in zip(sampled, samples, strict=True):
            done[int(req.request_id)] = Done(token, seeds[req.request_id], drafter.pool,
                                             req.page_ids, req.num_prompt_tokens)
        engine.scheduler.update(out, samples)
    return done


def announce(engine: LLMEngine, room: int, ids: list[int], images: list[ImageInput],
             *, with_ids: bool = True) -> wpb.StageRoom:
    req = engine.new_request(ids, images, FIRST_ONLY, request_id=str(room))
    engine.scheduler.add(req)
    state = req.payload
    assert isinstance(state, RequestState)
    return wpb.StageRoom(room=room, prompt_tokens=len(ids), mrope_delta=state.delta,
                         sampling=sampling_message(dataclasses.asdict(FIRST_ONLY)),
                         prompt_ids=ids if with_ids else ())


@pytest.mark.parametrize("flavour", ["eagle", "eagle3"])
def test_last_stage_draft_equals_the_whole_model_draft(model_dir: Path, eagle3_dir: Path,
                                                       flavour: str) -> None:
    """With EAGLE-3 the first stage sends its layer's output on with the hidden states, and
    the last stage fuses it with its own layer's."""
    model_dir = eagle3_dir if flavour == "eagle3" else model_dir
    want = whole_model(model_dir)
    first = LLMEngine(model_dir, config(layers=range(0, 1)))
    first.disable_prefix_cache()
    share = load_later_stage(model_dir, config(), StageLayout(2, 1), model_dir / "draft")
    assert share.draft is not None
    assert share.draft.aux_layers == ((1, 0, 1) if flavour == "eagle3" else ())
    runner = first_stage_runner(first, share.draft.aux_layers)
    bootstrap = RecordingBootstrap()
    stage = LaterStage(share, cast(PrefillBootstrapServer, bootstrap), PAGE, None)
    new = [announce(first, room, ids, ims) for room, (ids, ims) in cases().items()]
    got: dict[int, Done] = {}
    steps = 0
    while first.scheduler.has_unfinished():
        out = first.scheduler.schedule()
        hidden, mrope, aux_out = runner.execute(out)
        assert aux_out.shape[1] == (hidden.shape[1] if flavour == "eagle3" else 0)  # layer 0
        items = [wpb.StageItem(room=int(it.request.request_id), start=it.start,
                               num_tokens=it.num_tokens, needs_sample=it.needs_sample)
                 for it in out.items]
        packed = pack_step_tensors(hidden, mrope)
        reply = stage.run_step(wpb.StageStep(new_rooms=new, items=items, hidden=packed[0],
                                             mrope_positions=packed[1], aux=pack_aux(aux_out)))
        assert not reply.failed
        for it in out.items:
            room = int(it.request.request_id)
            if it.needs_sample:
                aux = bootstrap.aux[room]
                got[room] = Done(aux.first_token, torch.tensor(aux.hidden), share.draft.pool,
                                 bootstrap.pages[room], it.start + it.num_tokens)
        new, steps = [], steps + 1
        first.scheduler.update(out, [(s.token, s.logprob) for s in reply.samples])
    assert steps > 2  # chunked: the draft pairs a chunk's last row with the next chunk's token
    assert got.keys() == want.keys() == cases().keys()
    for room, mine in got.items():
        assert mine.token == want[room].token
        torch.testing.assert_close(mine.seed, want[room].seed)
        for kv, ref in zip(mine.kv, want[room].kv, strict=True):
            torch.testing.assert_close(kv, ref)
    assert stage.stats()["kv_pages_used"] == 0 and bootstrap.num_rooms == 0


def test_a_room_without_its_prompt_ids_fails_on_a_draft_stage(model_dir: Path) -> None:
    share = load_later_stage(model_dir, config(), StageLayout(2, 1), model_dir / "draft")
    stage = LaterStage(share, cast(PrefillBootstrapServer, RecordingBootstrap()), PAGE, None)
    first = LLMEngine(model_dir, config(layers=range(0, 1)))
    room = announce(first, 21, [1, 2, 3], [], with_ids=False)
    reply = stage.run_step(wpb.StageStep(new_rooms=[room]))
    assert [(f.room, "prompt ids did not reach" in f.reason) for f in reply.failed] == [(21, True)]
    assert stage.stats()["running_requests"] == 0
