"""The persistent batch: per-request step state kept across steps, so that a step gathers its
positions, KV slots, mrope deltas and page tables with a few array operations over the
scheduled items instead of Python loops over tokens.

Rows. The scheduler gives each running request a row (``Request.batch_row``, in
``[0, max_num_seqs)``) at admission and takes it back when the request finishes or is aborted;
``Scheduler.check_invariants`` checks that the rows held are exactly the running requests'.
:class:`InputBatch` keeps, per row, on the host:

* ``page_table[row, :synced[row]]``: the request's first ``synced[row]`` pages, and beside it
  ``slot_base = page_table * page_size`` (int64), so a token's slot is one gather and one add.
  The scheduler stays the source of truth: a running request's ``page_ids`` only ever grow, so
  a sync writes just the pages appended since the previous one;
* ``deltas[row]``: the request's mrope delta (fixed for its life);
* the request that last synced the row (its holder), so a row taken over by a new request is
  rewritten from scratch. A finished holder stays referenced until its row is taken over (at
  most one finished request per row; its pages are back in the allocator by then).

Entries past a row's synced pages hold page 0 or a former holder's pages: valid page ids that
attention never reads unmasked. Every gather first checks that each request holds the pages of
the tokens it touches, so a stale entry is never used as a real page. Token ids are not mirrored:
a step takes them from the requests' own lists (one element per decode item, C-speed slices for
prompt chunks), so each token still becomes a tensor element exactly once.

The host arrays are numpy: an element write or a gather over a few dozen rows costs well under a
microsecond there and several in torch. A step's gathered arrays reach the pool's device with
one copy (:func:`to_device`; on CPU none: the tensors share the arrays' memory). On CPU a decode
step of the same shape as the previous one (items, samples, page-table width) refills that
step's staged arrays in place and hands out the same tensors, with no torch call at all: the
tensors of a step are valid until the next :meth:`InputBatch.prepare` (everything derived from
them by an operation, such as the mrope positions, is a new tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from engine.attention.backend import AttentionBatch
from engine.core.request import Request
from engine.core.scheduler import ScheduledItem
from engine.multimodal.inputs import RequestState

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


@dataclass(frozen=True)
class StepInputs:
    """One forward's inputs over ``B`` items and ``T`` tokens, on the batch's device; valid
    until the batch's next :meth:`InputBatch.prepare` (see the module docstring)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, each token's absolute index in its request
    deltas: torch.Tensor  # [T] int64, the mrope delta of each token's request
    # [S] int64, last token row of each item with needs_sample; ``slice(None)`` when that is
    # every row in order (a decode step sampling every item), so indexing by it is a view
    sample_rows: torch.Tensor | slice
    attention: AttentionBatch  # slots [T], page tables [B, ceil(max kv / page_size)], lengths


@dataclass
class _Staging:
    """Host arrays of one decode-step shape and the CPU tensors that view them: a decode step
    of the same shape refills the arrays and hands out the same tensors, which costs no torch
    call (each costs several microseconds with the caches a forward leaves behind). When the
    step's rows are the previous step's, in the same order, only the page tables and deltas of
    rows synced since then are rewritten."""

    shape: tuple[int, int, int]  # (items, samples, page-table width)
    host64: np.ndarray  # ids, positions, deltas, slots [items] each, then sample rows
    host32: np.ndarray  # q_lens (all 1), kv_lens [items] each, then q_starts [items + 1]
    table: np.ndarray  # [items, width] int32
    tensors: tuple[torch.Tensor, ...]  # ids, pos, deltas, slots, sample, q, kv, q_starts, table
    rows: list[int]  # the batch rows the table and deltas hold, in item order
    index: dict[int, int]  # batch row -> item index, for ``rows``

    @classmethod
    def allocate(cls, num: int, samples: int, width: int) -> _Staging:
        host64 = np.zeros(4 * num + samples, dtype=np.int64)
        host32 = np.concatenate([np.ones(2 * num, dtype=np.int32),
                                 np.arange(num + 1, dtype=np.int32)])  # kv_lens: every step
        table = np.zeros((num, width), dtype=np.int32)
        t64, t32 = torch.from_numpy(host64), torch.from_numpy(host32)
        tensors = (*t64.split([num] * 4 + [samples]), *t32.split([num, num, num + 1]),
                   torch.from_numpy(table))
        return cls((num, samples, width), host64, host32, table, tensors, [], {})


class InputBatch:
    """Per-row page tables and mrope deltas of the running requests (see the module
    docstring). Capacity grows on demand (rows and page columns double), so the batch needs no
    configuration beyond the page size and the device its step tensors go to."""

    def __init__(self, page_size: int, device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self._table = np.zeros((0, 0), dtype=np.int32)  # [rows, max pages] host page tables
        self._slot_base = np.zeros((0, 0), dtype=np.int64)  # [rows, max pages] page * page_size
        self._deltas: list[int] = []  # mrope delta per row
        self._synced: list[int] = []  # pages of each row's table written so far
        self._holder: list[Request | None] = []
        self._stage: _Staging | None = None  # the last decode step's arrays (CPU)
        self._dirty: set[int] = set()  # rows synced since the last staged decode step

    # ---- rows ----------------------------------------------------------------------------------

    def rows(self, reqs: Sequence[Request], ends: Sequence[int]) -> np.ndarray:
        """Sync the rows of ``reqs`` and return them ``[B]`` (int64). Request ``i`` must be
        running and hold the pages of tokens ``[0, ends[i])``."""
        return np.array([self._row(r, e) for r, e in zip(reqs, ends, strict=True)],
                        dtype=np.int64)

    def _row(self, req: Request, end: int) -> int:
        """``req``'s row, synced, after checking it holds the pages of tokens ``[0, end)``."""
        row = req.batch_row
        held = len(req.page_ids)
        if not (0 <= row < len(self._synced) and self._holder[row] is req
                and self._synced[row] == held):
            self._sync(req)
        if held * self.page_size < end:
            raise ValueError(f"request {req.request_id!r} holds {held} pages, too few for "
                             f"{end} tokens")
        return row

    def _sync(self, req: Request) -> None:
        """Claim ``req``'s row if another request held it, and write its new pages."""
        row = req.batch_row
        if row < 0:
            raise ValueError(f"request {req.request_id!r} holds no batch row (it is not running)")
        if row >= len(self._synced):
            self._grow_rows(row + 1)
        self._dirty.add(row)
        if self._holder[row] is not req:
            self._holder[row] = req
            self._synced[row] = 0
            self._deltas[row] = _delta(req)
        pages = req.page_ids
        held, synced = len(pages), self._synced[row]
        if held > self._table.shape[1]:
            self._grow_cols(held)
        self._table[row, synced:held] = pages[synced:]
        self._slot_base[row, synced:held] = self._table[row, synced:held] * self.page_size
        self._synced[row] = held

    def _grow_rows(self, need: int) -> None:
        cap = max(need, 2 * len(self._synced), 8)
        shape = (cap, self._table.shape[1])
        self._table, self._slot_base = _grown(self._table, shape), _grown(self._slot_base, shape)
        grow = cap - len(self._synced)
        self._deltas += [0] * grow
        self._synced += [0] * grow
        self._holder += [None] * grow

    def _grow_cols(self, need: int) -> None:
        shape = (self._table.shape[0], max(need, 2 * self._table.shape[1], 16))
        self._table, self._slot_base = _grown(self._table, shape), _grown(self._slot_base, shape)

    # ---- gathers over synced rows (host arrays, fresh copies) ----------------------------------

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV slot ``page_table[row, pos // page_size] * page_size + pos % page_size`` of each
        token ``[T]`` (int64), for tokens of synced rows ``rows`` ``[T]`` at ``positions``
        ``[T]`` (each inside its row's synced pages)."""
        page, offset = np.divmod(positions, self.page_size)
        return self._slot_base[rows, page] + offset

    def table(self, rows: np.ndarray | list[int], max_kv: int) -> np.ndarray:
        """The page tables of synced ``rows`` ``[B, ceil(max_kv / page_size)]`` (int32)."""
        width = max(1, -(-max_kv // self.page_size))
        if width > self._table.shape[1]:
            raise ValueError(f"no row holds pages for {max_kv} tokens")
        return self._table[rows, :width]

    def deltas(self, rows: np.ndarray) -> np.ndarray:
        """The mrope delta of each synced row ``[B]`` (int64)."""
        return np.array([self._deltas[r] for r in rows.tolist()], dtype=np.int64)

    # ---- one forward of the model runner -------------------------------------------------------

    def prepare(self, items: Sequence[ScheduledItem]) -> StepInputs:
        """Sync the items' rows and gather the forward's inputs (tokens in item order), all in
        one copy to the device.

        Item-level values are Python ints gathered in one pass. A step of single-token items
        (decode) also takes its ids and slots there (``page_ids[s // ps] * ps + s % ps``: the
        row's mirror holds the same pages); a step with longer items expands per-token values
        with array operations over the synced rows. Either way the host data is three arrays
        (int64 per-token values, int32 lengths, the int32 page tables) and a few C calls, which
        is what a step's cold caches make expensive.
        """
        ps = self.page_size
        holder, synced, deltas_of = self._holder, self._synced, self._deltas
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        deltas: list[int] = []
        slots: list[int] = []
        sample: list[int] = []
        for it in items:
            req, s, n = it.request, it.start, it.num_tokens
            row, pages = req.batch_row, req.page_ids
            if (0 <= row < len(synced) and holder[row] is req and synced[row] == len(pages)
                    and (s + n) <= len(pages) * ps):
                pass  # synced, and its pages cover the item (the common case, inlined)
            else:
                self._row(req, s + n)
            rows.append(row)
            starts.append(s)
            q_lens.append(n)
            kv_lens.append(s + n)
            deltas.append(deltas_of[row])
            if n == 1:
                prompt = req.prompt_token_ids
                ids.append(prompt[s] if s < len(prompt) else req.output_token_ids[s - len(prompt)])
                slots.append(pages[s // ps] * ps + s % ps)
            else:
                ids += _token_slice(req, s, s + n)
            if it.needs_sample:
                sample.append(len(ids) - 1)
        total, num = len(ids), len(items)
        max_kv = max(kv_lens)
        width = max(1, -(-max_kv // ps))
        if total == num and self.device.type == "cpu":  # decode: refill the staged arrays
            stage = self._stage_decode(rows, ids, starts, deltas, slots, sample, width)
            stage.host32[num : 2 * num] = kv_lens
            ids_t, pos_t, deltas_t, slots_t, sample_t, q_t, kv_t, q_starts_t, table_t = (
                stage.tensors)
            attention = AttentionBatch(q_t, kv_t, q_starts_t, table_t, slots_t, 1, max_kv)
            rows_sampled = slice(None) if len(sample) == total else sample_t
            return StepInputs(ids_t, pos_t, deltas_t, rows_sampled, attention)
        if total == num:
            host64 = np.array(ids + starts + deltas + slots + sample, dtype=np.int64)
        else:
            item, pos = token_positions(starts, q_lens)
            host64 = np.concatenate([np.array(ids, dtype=np.int64), pos,
                                     np.array(deltas, dtype=np.int64)[item],
                                     self.slots(np.array(rows, dtype=np.int64)[item], pos),
                                     np.array(sample, dtype=np.int64)])
        host32 = np.array(q_lens + kv_lens + list(accumulate(q_lens, initial=0)),
                          dtype=np.int32)
        t64, t32, table_t = to_device([host64, host32, self.table(rows, max_kv)], self.device)
        ids_t, pos_t, deltas_t, slots_t, sample_t = t64.split([total] * 4 + [len(sample)])
        q_t, kv_t, q_starts_t = t32.split([num, num, num + 1])
        attention = AttentionBatch(q_t, kv_t, q_starts_t, table_t, slots_t, max(q_lens), max_kv)
        return StepInputs(ids_t, pos_t, deltas_t, sample_t, attention)

    def _stage_decode(self, rows: list[int], ids: list[int], starts: list[int],
                      deltas: list[int], slots: list[int], sample: list[int],
                      width: int) -> _Staging:
        """Fill the staged arrays of a one-token-per-item step (all but its kv_lens): those of
        the previous such step when the shape is the same, else new ones."""
        total = len(ids)
        stage = self._stage
        if stage is None or stage.shape != (total, len(sample), width):
            stage = self._stage = _Staging.allocate(total, len(sample), width)
        h64 = stage.host64
        if stage.rows == rows:  # same rows, same order: rewrite what changed
            h64[: 2 * total] = ids + starts
            h64[3 * total : 4 * total] = slots
            if len(sample) != total:
                h64[4 * total :] = sample
            for row in self._dirty:
                i = stage.index.get(row)
                if i is not None:
                    h64[2 * total + i] = self._deltas[row]
                    stage.table[i] = self._table[row, :width]
        else:
            h64[:] = ids + starts + deltas + slots + sample
            np.take(self._table[:, :width], rows, axis=0, out=stage.table)
            stage.rows, stage.index = rows, {row: i for i, row in enumerate(rows)}
        self._dirty.clear()
        return stage

    # ---- checks --------------------------------------------------------------------------------

    def check(self, running: Sequence[Request]) -> None:
        """Assert that every synced row held by a running request mirrors its pages and delta,
        and that no row is synced for a request that is no longer running (for tests)."""
        live = {r.batch_row: r for r in running}
        assert len(live) == len(running), "running requests share a batch row"
        for row, holder in enumerate(self._holder):
            if holder is None or live.get(row) is not holder:
                assert holder is None or holder.is_finished or holder.batch_row != row, (
                    f"row {row} is synced for a request that runs elsewhere")
                continue
            synced = self._synced[row]
            assert self._table[row, :synced].tolist() == holder.page_ids[:synced]
            assert (self._slot_base[row, :synced] == self._table[row, :synced] * self.page_size
                    ).all()
            assert self._deltas[row] == _delta(holder)


def token_positions(starts: Sequence[int], nums: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """For items of ``nums[i]`` tokens from ``starts[i]`` on, laid end to end: each token's item
    index and absolute position, ``[T]`` each (int64)."""
    n = np.array(nums, dtype=np.int64)
    item = np.repeat(np.arange(n.shape[0]), n)
    offset = np.array(starts, dtype=np.int64) - (np.cumsum(n) - n)  # start - first token row
    return item, np.arange(item.shape[0], dtype=np.int64) + offset[item]


def _grown(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A zero array of ``shape`` (at least ``a``'s in every dimension) with ``a`` in its
    corner."""
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Tensors on ``device`` with the contents of ``arrays`` (int64, int32 or float32; fresh
    arrays nobody writes again: on CPU the tensors share their memory). Off the CPU all of them
    travel in one host-to-device copy."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    return packed_copy(arrays, device)


def packed_copy(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """:func:`to_device` through one packed byte buffer (each array 8-byte aligned in it)."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 8) * 8
    raw = np.empty(max(total, 8), dtype=np.uint8)
    for a, off in zip(arrays, offsets, strict=True):
        raw[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dev = torch.from_numpy(raw).to(device)
    return [dev[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, off in zip(arrays, offsets, strict=True)]


def _delta(req: Request) -> int:
    state = req.payload
    if not isinstance(state, RequestState):
        raise ValueError(f"request {req.request_id!r} carries no RequestState payload")
    return state.delta


def _token_at(req: Request, i: int) -> int:
    prompt = req.prompt_token_ids
    return prompt[i] if i < len(prompt) else req.output_token_ids[i - len(prompt)]


def _token_slice(req: Request, s: int, e: int) -> list[int]:
    """Token ids ``[s, e)`` of ``req``, without copying all of them."""
    prompt = req.prompt_token_ids
    if e <= len(prompt):
        return prompt[s:e]
    out = req.output_token_ids
    if s >= len(prompt):
        return out[s - len(prompt) : e - len(prompt)]
    return prompt[s:] + out[: e - len(prompt)]
