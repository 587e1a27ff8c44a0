"""A later stage of a pipeline-parallel prefill (rank >= 1): runs its layers on the hidden
states the stage before it sends and pushes its layers' KV to each room's decode.

Driven entirely by ``RunStep`` calls from the previous stage (:meth:`LaterStage.run_step`),
one at a time: announced rooms are claimed on this stage's bootstrap endpoint; a room is
reported ready once its destination arrived here (and, for a middle stage, on every later
stage); items run through this stage's layers into pages it allocates itself; the last stage
samples the first token and writes the aux row with the last chunk, a middle stage finishes its
chunk without one and forwards the step over its link to the next stage. A last stage with an
EAGLE draft runs it over each chunk's rows after its layers (the announced prompt ids give each
row's next token), into a draft pool mirroring its pages, so the draft KV travels with its
pages, and puts the last row's feature in the aux row. An EAGLE-3 draft fuses the outputs of
target layers of any stage: each stage adds its own to those the step carries and sends them on
(:mod:`prefill_node.pipeline.aux_layers`). A room that fails here is released at
once (writes are synchronous, so none is in flight) and reported failed exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.attention.backend import AttentionBatch
from engine.attention.select import make_attention
from engine.core.page_allocator import OutOfPagesError, PageAllocator
from engine.core.request import Request, SamplingParams, TopLogprobs
from engine.core.state_slots import StateSlotAllocator
from engine.errors import OutOfStateSlotsError
from engine.models.step_extras import NO_EXTRAS, StepExtras
from engine.parallel.messages import StateStep
from engine.runner.draft_runner import draft_row_ids
from engine.runner.input_batch import to_device, token_positions
from engine.sampling.logprobs import top_logprobs
from engine.sampling.penalties import TokenHistory, penalize
from engine.sampling.sampler import Sampler, make_generator
from prefill_node.pipeline.aux_layers import carried, merge_aux, pack_aux, unpack_aux
from prefill_node.pipeline.layout import LaterStageModel
from prefill_node.pipeline.link import NextStageLink, pack_step_tensors, unpack_step_tensors
from prefill_node.rooms import completed_pages
from proto.convert import sampling_kwargs
from proto.pdserve.v1 import worker_pb2 as wpb
from serving.figures import FigureBoard
from transfer.aux import AuxRow
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import TransferError
from transfer.status import KVPoll


@dataclass
class _Room:
    room: int
    sampling: SamplingParams
    generator: torch.Generator | None
    mrope_delta: int
    pages: list[int]
    # for the first token's penalties and grammar (its resumed output) and the draft's rows
    # (or empty)
    prompt_ids: list[int]
    pages_sent: int = 0
    ready_reported: bool = False
    state_slot: int = -1  # a hybrid model's slot here, taken with its first rows
    first_top: TopLogprobs | None = None  # the first token's alternatives, when asked for


class LaterStage:
    """One later pipeline stage; ``link`` leads to the next stage (None on the last);
    ``aux_ids``: the target layers the last stage's EAGLE-3 draft fuses, which this stage
    sends on (:mod:`prefill_node.pipeline.aux_layers`; the last stage takes its draft's)."""

    def __init__(
        self, share: LaterStageModel, bootstrap: PrefillBootstrapServer, page_size: int,
        link: NextStageLink | None, aux_ids: Sequence[int] = (),
    ) -> None:
        self.share = share
        # the target layers the last stage's EAGLE-3 draft fuses (the last stage: its own)
        self.aux_ids = tuple(share.draft.aux_layers) if share.draft is not None else tuple(
            aux_ids)
        self.bootstrap = bootstrap
        self.page_size = page_size
        self.link = link
        self.allocator = PageAllocator(share.pool.num_pages)
        self.slots = StateSlotAllocator(share.states.pool.num_slots) if share.states else None
        self.attn = make_attention(share.pool)
        self.sampler = Sampler()
        self._hidden_size = share.model_config.text.hidden_size
        self._zeros = (0.0,) * self._hidden_size
        self._rooms: dict[int, _Room] = {}
        self._failed: list[wpb.StageAbort] = []  # to report with the next reply
        self._lock = threading.Lock()
        self.board = FigureBoard(self._lock, self._figures)  # refreshed by every step

    @property
    def is_last(self) -> bool:
        return self.link is None

    def stats(self) -> dict[str, int]:
        """The stage's figures now (``Admin.GetStats``, leak checks): waits for a step."""
        return self.board.exact()

    def load(self) -> dict[str, int]:
        """The figures without waiting behind a step (``GetLoad``: :mod:`serving.figures`)."""
        return self.board.now()

    def _figures(self) -> dict[str, int]:
        out = {"running_requests": len(self._rooms), "kv_pages_used": self.allocator.num_used,
               "kv_pages_total": self.allocator.num_pages,
               "rooms_active": self.bootstrap.num_rooms}
        if self.slots is not None:
            out.update(state_slots_used=self.slots.num_used,
                       state_slots_total=self.slots.num_slots)
        return out

    def abort(self, room: int, reason: str) -> bool:
        """Fail a room here (reported to the previous stage with the next reply)."""
        with self._lock:
            if room not in self._rooms:
                return False
            self._drop(room, reason)
            return True

    def run_step(self, step: wpb.StageStep) -> wpb.StageStepReply:
        """Apply one step of the previous stage (see the module docstring)."""
        with self._lock:
            for new in step.new_rooms:
                self._add(new)
            for a in step.aborted:
                if a.room in self._rooms:
                    self._drop(a.room, a.reason, report=False)
            samples: list[tuple[int, float]] = []
            forward = wpb.StageStep()
            if step.items:
                samples, forward = self._compute(step)
            next_failed: list[tuple[int, str]] = []
            if self.link is not None:  # one call to the next stage per call from the previous
                for new in step.new_rooms:
                    if new.room in self._rooms:
                        self.link.announce(new)
                reply = self.link.step(forward.items, forward.hidden, forward.mrope_positions,
                                       forward.aux)
                samples, next_failed = reply.samples, reply.failed
            for room, reason in next_failed:
                if room in self._rooms:
                    self._drop(room, reason, report=False)
                self._failed.append(wpb.StageAbort(room=room, reason=reason))
            self._poll_rooms()
            ready = self._newly_ready()
            failed, self._failed = self._failed, []
            self.board.refresh()
            return wpb.StageStepReply(
                ready=ready, failed=failed,
                samples=[wpb.StageSample(token=t, logprob=lp) for t, lp in samples])

    # ---- internals (lock held) -----------------------------------------------------------

    def _add(self, new: wpb.StageRoom) -> None:
        sampling = SamplingParams(**sampling_kwargs(new.sampling, 1),
                                  resumed_tokens=new.resumed_tokens)
        if self.share.draft is not None and len(new.prompt_ids) != new.prompt_tokens:
            self._failed.append(wpb.StageAbort(room=new.room, reason=(
                "the room's prompt ids did not reach the last pipeline stage, which runs the "
                "EAGLE draft over them")))
            return
        try:
            self.bootstrap.add_room(new.room)
        except TransferError as exc:
            self._failed.append(wpb.StageAbort(room=new.room, reason=str(exc)))
            return
        self._rooms[new.room] = _Room(new.room, sampling, make_generator(sampling.seed),
                                      new.mrope_delta, [], list(new.prompt_ids))

    def _compute(self, step: wpb.StageStep) -> tuple[list[tuple[int, float]], wpb.StageStep]:
        """Run this stage's layers over the rows of live rooms; push their pages. Returns the
        samples (last stage: one per needs_sample item, ``(0, 0.0)`` for rooms not here) and
        the step to forward (middle stage: same items, rows of live rooms replaced)."""
        hidden, mrope = unpack_step_tensors(step, self._hidden_size)
        layers = self.share.layers
        aux = unpack_aux(step, len(carried(self.aux_ids, layers.start)), self._hidden_size)
        rows: list[int] = []
        live: list[wpb.StageItem] = []
        offset = 0
        for item in step.items:
            if item.room in self._rooms and self._reserve(item):
                rows.extend(range(offset, offset + item.num_tokens))
                live.append(item)
            offset += item.num_tokens
        out, tokens, seeds = None, {}, {}
        own: dict[int, torch.Tensor] = {}
        if live:
            live_mrope = mrope[:, rows]
            out, own, batch = self._forward(live, hidden[rows], live_mrope)
            if self.is_last:
                tokens = self._sample(live, out)
                aux_rows = merge_aux(self.aux_ids, layers, aux, own, rows)[rows]
                seeds = self._draft(live, out, aux_rows, live_mrope, batch, tokens)
        self._push(live, tokens, seeds)
        samples = [tokens.get(it.room, (0, 0.0)) for it in step.items if it.needs_sample]
        forward = wpb.StageStep(items=step.items, mrope_positions=step.mrope_positions)
        if not self.is_last:
            if out is not None:
                hidden[rows] = out.float()
            forward.hidden = pack_step_tensors(hidden, mrope)[0]
            forward.aux = pack_aux(merge_aux(self.aux_ids, layers, aux, own, rows))
        return samples, forward

    def _reserve(self, item: wpb.StageItem) -> bool:
        r = self._rooms[item.room]
        need = -(-(item.start + item.num_tokens) // self.page_size) - len(r.pages)
        try:
            r.pages += self.allocator.allocate(max(0, need))
            if self.slots is not None and r.state_slot < 0:
                r.state_slot = self.slots.allocate()
        except (OutOfPagesError, OutOfStateSlotsError) as exc:
            self._drop(item.room, f"pipeline stage is out of memory: {exc}")
            return False
        return True

    @torch.inference_mode()
    def _forward(
        self, items: list[wpb.StageItem], hidden: torch.Tensor, mrope: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], AttentionBatch]:
        """This stage's layers over the items' rows; their output, the outputs of its aux
        layers (by layer id) and the attention batch."""
        ps = self.page_size
        pages = [self._rooms[it.room].pages for it in items]
        table = np.zeros((len(items), max(1, *map(len, pages))), dtype=np.int32)  # [B, P]
        for row, p in enumerate(pages):
            table[row, : len(p)] = p
        q_lens = [it.num_tokens for it in items]
        kv_lens = [it.start + it.num_tokens for it in items]
        item, pos = token_positions([it.start for it in items], q_lens)
        slots = table[item, pos // ps].astype(np.int64) * ps + pos % ps  # [T]
        table_t, slots_t = to_device([table, slots], self.share.pool.device)
        batch = AttentionBatch.build(q_lens, kv_lens, table_t, slots_t)
        self.attn.prepare(batch)
        model = self.share.model
        x = hidden.to(model.dtype)
        states, extras = self._state_step(items)
        with self.share.step(x, mrope, batch, states):  # the other TP ranks run it too
            out, own = model.forward_layers_aux(x, mrope, self.attn, self.share.layers,
                                                final_norm=self.is_last, aux_layers=self.aux_ids,
                                                extras=extras)
        return out, own, batch

    def _state_step(self, items: list[wpb.StageItem]) -> tuple[StateStep | None, StepExtras]:
        """A hybrid stage's use of its state pool in this forward (each item's rows and slot,
        the slots of items starting at token 0 zeroed first), applied here; none without."""
        if self.share.states is None:
            return None, NO_EXTRAS
        step = StateStep.of((it.num_tokens, self._rooms[it.room].state_slot, it.start)
                            for it in items)
        return step, replace(NO_EXTRAS, states=step.apply(self.share.states))

    def _sample(
        self, items: list[wpb.StageItem], out: torch.Tensor
    ) -> dict[int, tuple[int, float]]:
        ends, rooms, offset = [], [], 0
        for it in items:
            offset += it.num_tokens
            if it.needs_sample:
                ends.append(offset - 1)
                rooms.append(self._rooms[it.room])
        if not rooms:
            return {}
        with torch.inference_mode():
            logits = self.share.model.logits(out[ends])
        scores = _penalized(logits, rooms)
        if self.share.structured is not None:  # a room's grammar, from its resumed output on
            reqs = [Request(str(r.room), r.prompt_ids, r.sampling) for r in rooms]
            scores = self.share.structured.mask(reqs, logits, scores)
        toks, lps = self.sampler.sample(logits, [r.sampling for r in rooms],
                                        [r.generator for r in rooms], scores)
        tops = top_logprobs(logits, [r.sampling.top_logprobs for r in rooms])
        for r, top in zip(rooms, tops, strict=True):
            r.first_top = top
        return {r.room: (t, lp) for r, t, lp in zip(rooms, toks, lps, strict=True)}

    def _draft(
        self, items: list[wpb.StageItem], hidden: torch.Tensor, aux: torch.Tensor,
        mrope: torch.Tensor, batch: AttentionBatch, tokens: dict[int, tuple[int, float]],
    ) -> dict[int, torch.Tensor]:
        """The EAGLE draft (if this stage runs one) over the rows just computed (their final
        hidden states, and for EAGLE-3 the outputs of its target layers ``aux``), at their own
        positions and slots (its pool mirrors this stage's pages, so ``batch`` serves it too);
        per room whose prompt ended here, its last row's feature ``[H]`` for the aux row."""
        head = self.share.draft
        if head is None:
            return {}
        ids: list[int] = []
        last: dict[int, int] = {}
        for it in items:
            first = tokens[it.room][0] if it.needs_sample else None
            ids += draft_row_ids(self._rooms[it.room].prompt_ids, it.start, it.num_tokens, first)
            if it.needs_sample:
                last[it.room] = len(ids) - 1
        features = head.target_feature(hidden, aux.to(hidden.dtype))
        feats = head.forward(torch.tensor(ids, device=head.pool.device), features, mrope, batch)
        return {room: feats[row] for room, row in last.items()}

    def _push(self, items: list[wpb.StageItem], tokens: dict[int, tuple[int, float]],
              seeds: dict[int, torch.Tensor]) -> None:
        """Send each item's completed pages; the last chunk's aux row carries the sampled token
        and the draft's last feature (``seeds``; zeros without a draft)."""
        for it in items:
            r = self._rooms.get(it.room)
            if r is None:
                continue
            done = completed_pages(it.start + it.num_tokens, self.page_size, it.needs_sample)
            pages = r.pages[r.pages_sent : done]
            if not pages and not it.needs_sample:
                continue
            r.pages_sent = done
            last = None
            if it.needs_sample and self.is_last:
                token, logprob = tokens[it.room]
                seed = seeds.get(it.room)
                hidden = self._zeros if seed is None else tuple(seed.tolist())
                last = AuxRow(it.room, token, logprob, r.mrope_delta, hidden, top=r.first_top)
            slot = r.state_slot if it.needs_sample and r.state_slot >= 0 else None
            status = self.bootstrap.send_chunk(it.room, pages, last=last,
                                               finish=it.needs_sample, state_slot=slot)
            if status is KVPoll.Failed:
                self._drop(it.room, self.bootstrap.failure_reason(it.room))
            elif it.needs_sample:
                self._drop(it.room, None)  # delivered: Success

    def _poll_rooms(self) -> None:
        for room in list(self._rooms):
            if self.bootstrap.poll(room) is KVPoll.Failed:
                self._drop(room, self.bootstrap.failure_reason(room))

    def _newly_ready(self) -> list[int]:
        out = []
        for r in self._rooms.values():
            if r.ready_reported or self.bootstrap.poll(r.room) < KVPoll.WaitingForInput:
                continue
            if self.link is not None and not self.link.is_ready(r.room):
                continue
            r.ready_reported = True
            out.append(r.room)
        return out

    def _drop(self, room: int, reason: str | None, *, report: bool = True) -> None:
        """Release everything of ``room`` here; ``reason`` None means it succeeded."""
        r = self._rooms.pop(room)
        if reason is not None:
            self.bootstrap.abort(room, reason)
            if report:
                self._failed.append(wpb.StageAbort(room=room, reason=reason))
            if self.link is not None:
                self.link.abort(room, reason)
        elif self.link is not None:
            self.link.forget(room)
        self.bootstrap.release(room)
        self.allocator.free(r.pages)
        if self.slots is not None and r.state_slot >= 0:
            self.slots.free(r.state_slot)


def _penalized(logits: torch.Tensor, rooms: list[_Room]) -> torch.Tensor:
    """``logits`` ``[n, V]`` with each room's penalties for its first token: the repetition
    penalty over the prompt, and the frequency and presence penalties over the output a
    resubmitted room already streamed (its last ``resumed_tokens`` prompt tokens)."""
    rows = [i for i, r in enumerate(rooms) if r.sampling.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    hists = [TokenHistory(rooms[i].prompt_ids, vocab, logits.device,
                          rooms[i].sampling.resumed_tokens) for i in rows]
    counts = torch.stack([h.counts for h in hists])  # [m, V]
    seen = torch.stack([h.prompt_seen for h in hists])  # [m, V]: output is in the prompt
    idx = torch.tensor(rows, device=logits.device)
    out = logits.float().clone()
    out[idx] = penalize(out[idx], [rooms[i].sampling for i in rows], seen, counts)
    return out
