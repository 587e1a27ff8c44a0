"""Pure logic of the transfer layer: status order, messages, pairing, grouping, aux rows."""

from __future__ import annotations

from itertools import pairwise

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import MAX_TOP_LOGPROBS as ENGINE_MAX_TOP_LOGPROBS
from transfer.aux import MAX_TOP_LOGPROBS, AuxBuffer, AuxRow
from transfer.bootstrap.messages import (
    MAX_MESSAGE_BYTES,
    VERSION,
    Destination,
    Registration,
    Status,
    decode,
    encode,
)
from transfer.errors import LayerPairingError, MessageError, PageListError
from transfer.plan.blocks import batches, build_blocks, contiguous_runs
from transfer.plan.layers import check_bytes_per_page, draft_layer_ids, pair_entries
from transfer.status import KVPoll, advance


def test_status_order_and_forward_only() -> None:
    order = [KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
             KVPoll.Success]
    assert sorted(order) == order
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) is KVPoll.Transferring
    assert advance(KVPoll.Bootstrapping, KVPoll.Transferring) is KVPoll.Transferring
    for s in order:
        assert advance(s, KVPoll.Failed) is KVPoll.Failed
        assert advance(KVPoll.Failed, s) is KVPoll.Failed
    assert advance(KVPoll.Success, KVPoll.Transferring) is KVPoll.Success


def _reg(**over: object) -> Registration:
    fields: dict[str, object] = {
        "session_id": "127.0.0.1:1", "kv_ptrs": [1 << 40, 2], "kv_bytes_per_page": [256, 256],
        "kv_layer_ids": [0, 0], "num_pages": 4, "aux_ptr": 7, "aux_row_bytes": 64,
        "aux_num_rows": 2, "page_size": 4, "dtype": "torch.float32", "model_fingerprint": "m",
    }
    fields.update(over)
    return Registration(**fields)  # type: ignore[arg-type]


def test_messages_round_trip() -> None:
    for msg in (_reg(), Destination(2**63 - 1, [3, 4], 1), Status(5, 4, "", True)):
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "raw",
    [
        [VERSION + 1, "Destination", {"room": 1, "pages": [], "aux_slot": 0}],
        [VERSION, "Nope", {}],
        [VERSION, "Destination", {"room": 1, "pages": []}],
        [VERSION, "Destination", {"room": 1, "pages": [], "aux_slot": 0, "x": 1}],
        [VERSION, "Destination", {"room": "1", "pages": [], "aux_slot": 0}],
        [VERSION, "Destination", {"room": 1, "pages": [1.5], "aux_slot": 0}],
        [VERSION, "Destination", {"room": True, "pages": [], "aux_slot": 0}],
        [VERSION, "Status", {"room": 1, "status": 9, "reason": "", "quiesced": False}],
        {"not": "a list"},
    ],
)
def test_messages_strict_schema(raw: object) -> None:
    with pytest.raises(MessageError):
        decode(msgpack.packb(raw))


def test_messages_size_limit() -> None:
    with pytest.raises(MessageError):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(MessageError):
        encode(Destination(1, list(range(MAX_MESSAGE_BYTES // 4)), 0))
    with pytest.raises(MessageError):
        decode(b"\xc1garbage")


def test_pairing_by_id_in_occurrence_order() -> None:
    assert pair_entries([3, 7, 3, 7], [3, 7, 11, 3, 7, 11], 4, 6) == [(0, 0), (1, 1), (2, 3),
                                                                     (3, 4)]
    # a second pipeline stage numbering its buffers from 0 but carrying global ids 2, 3
    assert pair_entries([2, 3, 2, 3], [0, 1, 2, 3, 0, 1, 2, 3], 4, 8) == [(0, 2), (1, 3),
                                                                         (2, 6), (3, 7)]
    assert pair_entries(None, None, 3, 3) == [(0, 0), (1, 1), (2, 2)]
    assert pair_entries([], [], 0, 0) == []
    assert draft_layer_ids(28, 2) == [28, 29]


@pytest.mark.parametrize(
    ("src", "dst", "n_src", "n_dst", "match"),
    [
        ([0, 0], None, 2, 2, "source only"),
        (None, [0, 0], 2, 2, "destination only"),
        ([0, 1], [0, 1], 3, 2, "ragged"),
        ([0, 1], [0, 1, 2], 2, 2, "ragged"),
        ([0, 5], [0, 1], 2, 2, "lacks an entry for layer 5"),
        ([0, 0, 0], [0, 0], 3, 2, "lacks an entry for layer 0"),
        (None, None, 2, 3, "counts must match"),
    ],
)
def test_pairing_errors(src, dst, n_src, n_dst, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LayerPairingError, match=match):
        pair_entries(src, dst, n_src, n_dst)


def test_bytes_per_page_check() -> None:
    check_bytes_per_page([(0, 1)], [256], [0, 256])
    with pytest.raises(LayerPairingError, match="bytes per page differ"):
        check_bytes_per_page([(0, 0)], [256], [512])


def test_contiguous_runs() -> None:
    assert contiguous_runs([], []) == []
    assert contiguous_runs([0, 1, 2, 3], [5, 6, 7, 8]) == [(0, 5, 4)]
    # split where either side stops being consecutive
    assert contiguous_runs([0, 1, 2, 5, 6], [5, 6, 9, 10, 11]) == [(0, 5, 2), (2, 9, 1),
                                                                  (5, 10, 2)]
    with pytest.raises(PageListError):
        contiguous_runs([0, 1], [0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_cover_pages_exactly(pairs: list[tuple[int, int]]) -> None:
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    runs = contiguous_runs(src, dst)
    assert [s + k for s, _, n in runs for k in range(n)] == src
    assert [d + k for _, d, n in runs for k in range(n)] == dst
    for (s0, d0, n0), (s1, d1, _) in pairwise(runs):
        assert s1 != s0 + n0 or d1 != d0 + n0  # maximal: neighbours could not merge


def test_blocks_and_batches() -> None:
    srcs, dsts, lens = build_blocks([(0, 1), (1, 0)], [1000, 2000], [50000, 60000], [10, 10],
                                    [(0, 3, 2), (4, 9, 1)])
    assert srcs == [1000, 1040, 2000, 2040]
    assert dsts == [60030, 60090, 50030, 50090]
    assert lens == [20, 10, 20, 10]
    assert list(batches(2500, 1024)) == [slice(0, 1024), slice(1024, 2048), slice(2048, 2500)]
    assert list(batches(0, 1024)) == []


def test_aux_rows_and_slots() -> None:
    aux = AuxBuffer(2, hidden_size=5)
    assert aux.row_bytes % 64 == 0
    a, b = aux.alloc(), aux.alloc()
    assert a is not None and b is not None and aux.alloc() is None
    row = AuxRow(room=2**63 - 1, first_token=42, logprob=-0.5, mrope_delta=-7,
                 hidden=(1.0, 2.0, 3.0, 4.0, 5.5))
    aux.write(a, row)
    assert aux.read(a) == row
    aux.free(a)
    assert aux.read(a).room == 0 and aux.num_free == 1
    with pytest.raises(ValueError, match="twice"):
        aux.free(a)
    with pytest.raises(ValueError, match="hidden state"):
        aux.write(b, AuxRow(1, 1, 0.0, 0, (1.0,)))


def test_aux_rows_carry_the_first_tokens_alternatives() -> None:
    aux = AuxBuffer(1, hidden_size=3)
    slot = aux.alloc()
    assert slot is not None
    for top in (None, ((), ()), ((7, 3), (-0.25, -1.5)),
                (tuple(range(MAX_TOP_LOGPROBS)), tuple(-0.5 * i for i in range(20)))):
        row = AuxRow(9, 7, -0.25, 0, (1.0, 2.0, 3.0), cached_tokens=4, top=top)
        aux.write(slot, row)
        assert aux.read(slot) == row
    too_many = (tuple(range(MAX_TOP_LOGPROBS + 1)), (0.0,) * (MAX_TOP_LOGPROBS + 1))
    with pytest.raises(ValueError, match="alternatives"):
        aux.write(slot, AuxRow(9, 7, 0.0, 0, (1.0, 2.0, 3.0), top=too_many))
    assert MAX_TOP_LOGPROBS == ENGINE_MAX_TOP_LOGPROBS  # the engine's limit fits the row
