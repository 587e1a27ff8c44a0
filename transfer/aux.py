"""Aux rows: the small per-room record the prefill writes next to the KV.

A row holds the first generated token, its logprob and (when the request asked for them) up to
:data:`MAX_TOP_LOGPROBS` alternatives (``(token ids, logprobs)``, most likely first), the last
hidden state for the draft model (``hidden_size`` float32 values), the request's mrope delta,
how many prompt tokens the prefill found in its prefix cache (the request's
``usage.cached_tokens``) and the room id echoed back so the decode can detect a row that belongs
to another room. Rows have a fixed size (a multiple of 64
bytes) and live in one host buffer that is registered with the engine once; slots are owned by
one room at a time through :meth:`AuxBuffer.alloc` / :meth:`AuxBuffer.free`.

The buffer stays in host memory whatever device holds the KV pool, by design: a row is a small
per-room record that the host writes (prefill) and reads (decode) directly, so the KV moves
device to device while the aux row moves host to host, both through the same engine.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # engine.core.request's limit (transfer imports no engine types)
TopPairs = tuple[tuple[int, ...], tuple[float, ...]]  # token ids, their logprobs
_HEADER = struct.Struct("<qfIqQ")  # first_token, logprob, cached_tokens, mrope_delta, room
# the first token's alternatives: their count, then MAX_TOP_LOGPROBS token ids and logprobs
_TOPS = struct.Struct(f"<I{MAX_TOP_LOGPROBS}I{MAX_TOP_LOGPROBS}f")
_ROW_ALIGN = 64
_NO_TOP = 0xFFFFFFFF  # the count of a row without alternatives (0 alternatives is not that)


@dataclass(frozen=True)
class AuxLayout:
    """The byte layout of one aux row for a given hidden size."""

    hidden_size: int

    @property
    def row_bytes(self) -> int:
        raw = _HEADER.size + _TOPS.size + 4 * self.hidden_size
        return -(-raw // _ROW_ALIGN) * _ROW_ALIGN


@dataclass(frozen=True)
class AuxRow:
    """One room's aux record; ``hidden`` is ``hidden_size`` float32 values."""

    room: int
    first_token: int
    logprob: float
    mrope_delta: int
    hidden: tuple[float, ...]
    cached_tokens: int = 0  # prompt tokens the prefill took from its prefix cache
    top: TopPairs | None = None  # the first token's alternatives, when the request asked


class AuxBuffer:
    """``num_rows`` fixed-size rows in one host allocation, with a slot allocator."""

    def __init__(self, num_rows: int, hidden_size: int) -> None:
        if num_rows <= 0 or hidden_size < 0:
            raise ValueError(f"bad aux buffer shape: {num_rows} rows, hidden size {hidden_size}")
        self.layout = AuxLayout(hidden_size)
        self.num_rows = num_rows
        self._mem = (ctypes.c_char * (num_rows * self.layout.row_bytes))()
        self._free = list(range(num_rows - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self._mem)

    @property
    def nbytes(self) -> int:
        return ctypes.sizeof(self._mem)

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def row_ptr(self, slot: int) -> int:
        self._check(slot)
        return self.ptr + slot * self.row_bytes

    def alloc(self) -> int | None:
        """A free slot, or ``None`` when every slot is owned."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Return ``slot``: its row is zeroed (room 0 means "no row") and it becomes free."""
        self._check(slot)
        ctypes.memset(self.row_ptr(slot), 0, self.row_bytes)
        with self._lock:
            if slot in self._free:
                raise ValueError(f"aux slot {slot} freed twice")
            self._free.append(slot)

    def write(self, slot: int, row: AuxRow) -> None:
        hidden = _floats(row.hidden, self.layout.hidden_size)
        data = _HEADER.pack(row.first_token, row.logprob, row.cached_tokens, row.mrope_delta,
                            row.room) + _pack_top(row.top) + hidden
        ctypes.memmove(self.row_ptr(slot), data, len(data))

    def read(self, slot: int) -> AuxRow:
        data = ctypes.string_at(self.row_ptr(slot), self.row_bytes)
        first_token, logprob, cached, mrope_delta, room = _HEADER.unpack_from(data)
        top = _unpack_top(data)
        at = _HEADER.size + _TOPS.size
        hidden = array("f")
        hidden.frombytes(data[at : at + 4 * self.layout.hidden_size])
        return AuxRow(room, first_token, logprob, mrope_delta, tuple(hidden), cached, top)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_rows:
            raise ValueError(f"aux slot {slot} is outside 0..{self.num_rows - 1}")


def _pack_top(top: TopPairs | None) -> bytes:
    ids, lps = top if top is not None else ((), ())
    if len(ids) > MAX_TOP_LOGPROBS:
        raise ValueError(f"{len(ids)} alternatives, the aux row holds {MAX_TOP_LOGPROBS}")
    pad = MAX_TOP_LOGPROBS - len(ids)
    return _TOPS.pack(len(ids) if top is not None else _NO_TOP, *ids, *[0] * pad, *lps,
                      *[0.0] * pad)


def _unpack_top(data: bytes) -> TopPairs | None:
    n, *rest = _TOPS.unpack_from(data, _HEADER.size)
    if n == _NO_TOP:
        return None
    return tuple(rest[:n]), tuple(rest[MAX_TOP_LOGPROBS : MAX_TOP_LOGPROBS + n])


def _floats(values: Sequence[float], n: int) -> bytes:
    if len(values) != n:
        raise ValueError(f"hidden state has {len(values)} values, the aux row holds {n}")
    return array("f", values).tobytes()


def aux_figures(aux: AuxBuffer | None) -> dict[str, int]:
    """``aux_slots_used`` / ``aux_slots_total`` of a transfer manager's aux buffer (none without
    one): the figures every node reports in ``Admin.GetStats``."""
    if aux is None:
        return {}
    return {"aux_slots_total": aux.num_rows, "aux_slots_used": aux.num_rows - aux.num_free}
