"""What rank 0 of a tensor-parallel engine and its other ranks say to each other.

Two channels per non-zero rank:

- a pipe between rank 0 and the rank (a ``multiprocessing`` connection, raw bytes only): rank 0
  sends one :class:`StepHeader` per forward (the target's, or an EAGLE draft's), per KV move
  and one to stop, a hybrid model's forward followed in the same message by its
  :class:`StateStep` (:func:`step_message`); the rank sends one
  :class:`RankReport` when its model is loaded (or failed to load) and one if it fails later.
  A rank waits for work on its pipe, never inside a collective, so an idle engine holds no
  collective open (NCCL's watchdog would end it);
- the group's broadcast (``torch.distributed``) for the step's tensors, whose shapes the header
  gives: for a forward, one int64 tensor holding every integer input (:func:`pack_step`) and
  the input rows ``[T, hidden]`` in the model's dtype (the target's embeddings, or the draft
  layer's input) and, when the forward carries Qwen3-VL's DeepStack features of ``V`` visual
  tokens, their rows ``[V]`` (int64) and the features ``[L, V, hidden]`` (model dtype, one per
  stacked layer); for a KV move, one int64 tensor ``src [M] | dst [M]`` of slots.

A hybrid model's state slots travel on the pipe, not in a collective: they are host integers on
rank 0 (the scheduler's), and the kernels want host offsets, so no rank reads its device for
them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.attention.backend import AttentionBatch
from engine.attention.linear.states import LinearStates

_HEADER = struct.Struct("<10q")


class Command(IntEnum):
    FORWARD = 1  # run the target model over the broadcast inputs
    STOP = 2  # leave the group and exit
    DRAFT = 3  # run the EAGLE draft's layer over the broadcast inputs, into the draft pool
    MOVE_KV = 4  # copy the target pool's K/V of slots src to slots dst (num_tokens moves)
    # a hybrid model's speculative verify is over: the first num_tokens sequences of its window
    # keep the state after their accepted rows (LinearStates.keep)
    KEEP_STATES = 5


@dataclass(frozen=True)
class StepHeader:
    """One message from rank 0: a command and the shapes of the step that follows."""

    command: Command
    num_tokens: int = 0  # T
    num_seqs: int = 0  # B
    table_width: int = 0  # P, columns of the page table
    max_q: int = 0
    max_kv: int = 0
    hidden: int = 0  # width of the input rows
    mask_width: int = 0  # W of the draft tree mask [B, max_q, W]; 0: causal
    stack_rows: int = 0  # V, rows taking DeepStack features (0: none this forward)
    stack_layers: int = 0  # L, the decoder layers whose outputs take them

    def encode(self) -> bytes:
        return _HEADER.pack(self.command, self.num_tokens, self.num_seqs, self.table_width,
                            self.max_q, self.max_kv, self.hidden, self.mask_width,
                            self.stack_rows, self.stack_layers)

    @classmethod
    def decode(cls, data: bytes) -> StepHeader:
        if len(data) != _HEADER.size:
            raise ValueError(f"a step header is {_HEADER.size} bytes, got {len(data)}")
        command, *rest = _HEADER.unpack(data)
        return cls(Command(command), *rest)

    def packed_len(self) -> int:
        """Length of :func:`pack_step`'s tensor for this step."""
        t, b = self.num_tokens, self.num_seqs
        if self.command == Command.MOVE_KV:
            return 2 * t
        if self.command == Command.KEEP_STATES:
            return t
        return 4 * t + 3 * b + 1 + b * self.table_width + b * self.max_q * self.mask_width


@dataclass(frozen=True)
class StateStep:
    """A hybrid forward's use of the state pool, in host integers: sequence ``b`` owns rows
    ``q_starts[b]:q_starts[b + 1]`` and state slot ``slots[b]``; the slots ``fresh`` (requests
    computing from token 0) are zeroed first. Every rank applies the same step to its own pool
    (its heads' states), so the slots hold the same requests on every rank. ``window`` above 0:
    a speculative verify of ``window`` rows per sequence, which writes no slot until
    :attr:`Command.KEEP_STATES` (:meth:`LinearStates.prepare_window`).

    State checkpoints (``engine/core/state_checkpoints.py``): ``restore`` holds ``(source,
    slot)`` pairs, flat, copied before the forward (a prefix hit's checkpoint into its
    request's slot); ``save`` ``(slot, checkpoint)`` pairs copied after it (:meth:`saved`)."""

    q_starts: tuple[int, ...]
    slots: tuple[int, ...]
    fresh: tuple[int, ...] = ()
    window: int = 0
    restore: tuple[int, ...] = ()
    save: tuple[int, ...] = ()

    @classmethod
    def verify(cls, slots: Iterable[int], window: int) -> StateStep:
        """The step of a verify forward: sequence ``b`` owns rows ``b * window`` on and reads
        slot ``slots[b]``."""
        slots = tuple(slots)
        return cls(tuple(range(0, (len(slots) + 1) * window, window)), slots, (), window)

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int, int]], restore: Iterable[tuple[int, int]] = (),
           save: Iterable[tuple[int, int]] = ()) -> StateStep:
        """The step of a forward over sequences given as ``(num_tokens, slot, start)`` in
        row order: a sequence starting at token 0 has its slot zeroed first. ``restore``:
        ``(checkpoint, slot)`` copies before the forward; ``save``: ``(slot, checkpoint)``
        copies after it."""
        starts, slots, fresh = [0], [], []
        for num_tokens, slot, start in rows:
            starts.append(starts[-1] + num_tokens)
            slots.append(slot)
            if start == 0:
                fresh.append(slot)
        return cls(tuple(starts), tuple(slots), tuple(fresh), 0,
                   tuple(i for pair in restore for i in pair),
                   tuple(i for pair in save for i in pair))

    def apply(self, states: LinearStates) -> LinearStates:
        """Zero the fresh slots of ``states``' pool, copy the restored checkpoints in, and
        prepare ``states`` for this forward."""
        if self.fresh:
            states.pool.reset(self.fresh)
        if self.restore:
            states.pool.copy_slots(self.restore[0::2], self.restore[1::2])
        slots = torch.tensor(self.slots, dtype=torch.int64).to(states.pool.device)
        if self.window:
            states.prepare_window(slots, self.window)
        else:
            states.prepare(list(self.q_starts), slots)
        return states

    def saved(self, states: LinearStates) -> None:
        """After the forward: copy the slots to save into their checkpoint slots."""
        if self.save:
            states.pool.copy_slots(self.save[0::2], self.save[1::2])

    def encode(self) -> bytes:
        values = (len(self.slots), len(self.fresh), self.window, len(self.restore),
                  len(self.save), *self.q_starts, *self.slots, *self.fresh, *self.restore,
                  *self.save)
        return struct.pack(f"<{len(values)}q", *values)

    @classmethod
    def decode(cls, data: bytes) -> StateStep:
        b, f, window, r, s = struct.unpack("<5q", data[:40])
        size = 8 * (6 + 2 * b + f + r + s)
        if len(data) != size or r % 2 or s % 2:
            raise ValueError(f"a state step of {b} sequences, {f} fresh slots, {r // 2} restores "
                             f"and {s // 2} saves is {size} bytes, got {len(data)}")
        values = struct.unpack(f"<{2 * b + 1 + f + r + s}q", data[40:])
        fresh_end = 2 * b + 1 + f
        return cls(values[: b + 1], values[b + 1 : 2 * b + 1], values[2 * b + 1 : fresh_end],
                   window, values[fresh_end : fresh_end + r], values[fresh_end + r :])


def step_message(header: StepHeader, states: StateStep | None = None) -> bytes:
    """What rank 0 sends on a rank's pipe for ``header``: the header, then ``states``."""
    return header.encode() + (b"" if states is None else states.encode())


def read_step_message(data: bytes) -> tuple[StepHeader, StateStep | None]:
    """The header and state step (None without one) of :func:`step_message`'s bytes."""
    header = StepHeader.decode(data[: _HEADER.size])
    tail = data[_HEADER.size :]
    return header, StateStep.decode(tail) if tail else None


@dataclass(frozen=True)
class RankReport:
    """One message from a non-zero rank: ready (``error`` empty) or failed, and why.

    ``payload``: with the ready report, what the rank's attach hook returned
    (:attr:`engine.parallel.rank.RankSpec.attach`; empty without one), opaque to the engine."""

    rank: int
    error: str = ""
    payload: bytes = b""

    def encode(self) -> bytes:
        error = self.error.encode()
        return struct.pack("<qq", self.rank, len(error)) + error + self.payload

    @classmethod
    def decode(cls, data: bytes) -> RankReport:
        rank, n = struct.unpack("<qq", data[:16])
        return cls(rank, data[16 : 16 + n].decode(errors="replace"), data[16 + n :])


def step_header(rows: torch.Tensor, batch: AttentionBatch,
                command: Command = Command.FORWARD,
                deepstack: tuple[torch.Tensor, ...] = ()) -> StepHeader:
    """The header of a forward (``command``: the target's or the draft's) over ``rows``
    ``[T, hidden]`` with ``batch`` and the DeepStack features ``deepstack`` (one ``[V, hidden]``
    per stacked layer; none: the forward carries none)."""
    width = 0 if batch.tree_mask is None else batch.tree_mask.shape[2]
    stack_rows = deepstack[0].shape[0] if deepstack else 0
    return StepHeader(command, rows.shape[0], batch.num_seqs, batch.page_table.shape[1],
                      batch.max_q, batch.max_kv, rows.shape[1], width, stack_rows,
                      len(deepstack))


def pack_step(mrope: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """Every integer input of a forward in one int64 tensor ``[packed_len]``:
    ``mrope [3, T] | slots [T] | q_lens [B] | kv_lens [B] | q_starts [B + 1] | table [B, P]``
    and, under a draft tree, ``| tree_mask [B, max_q, W]`` (0 or 1)."""
    parts = [mrope, batch.slot_mapping, batch.q_lens, batch.kv_lens, batch.q_starts,
             batch.page_table]
    if batch.tree_mask is not None:
        parts.append(batch.tree_mask)
    return torch.cat([p.reshape(-1).to(torch.int64) for p in parts])


def unpack_step(header: StepHeader, packed: torch.Tensor) -> tuple[torch.Tensor, AttentionBatch]:
    """The mrope positions ``[3, T]`` and attention batch of :func:`pack_step`'s tensor."""
    t, b, p, w = header.num_tokens, header.num_seqs, header.table_width, header.mask_width
    mrope, slots, q_lens, kv_lens, q_starts, table, mask = packed.split(
        [3 * t, t, b, b, b + 1, b * p, b * header.max_q * w])
    i32 = torch.int32
    tree = mask.view(b, header.max_q, w).bool() if w else None
    batch = AttentionBatch(q_lens.to(i32), kv_lens.to(i32), q_starts.to(i32),
                           table.view(b, p).to(i32), slots, header.max_q, header.max_kv, tree)
    return mrope.view(3, t), batch


def move_header(num_moves: int) -> StepHeader:
    """The header of a KV move of ``num_moves`` slots (its tensor: ``src [M] | dst [M]``)."""
    return StepHeader(Command.MOVE_KV, num_moves)


def keep_header(num_seqs: int) -> StepHeader:
    """The header of a :attr:`Command.KEEP_STATES` for the window's first ``num_seqs``
    sequences (the accepted counts follow as one int64 tensor ``[num_seqs]``)."""
    return StepHeader(Command.KEEP_STATES, num_seqs)
