"""send_kvcache between two processes with real Mooncake engines over loopback TCP.

Every test runs with MooncakeKVManager and with AscendKVManager (its own registration and
code path over an injected TCP engine with host buffers).

The decode node (layers 0..3 and draft band 4) lives in a second process; prefill nodes live in
the test process. After each send the decode's pages are compared byte for byte.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transfer.xfer_peer import Node, Peer, Spec
from transfer.errors import LayerPairingError, PageListError
from transfer.plan.layers import draft_layer_ids

NUM_PAGES = 64
pytestmark = pytest.mark.slow


def _dst_entries(peer: Peer, like: Node) -> list[torch.Tensor]:
    shape = like.entries()[0].shape
    return [torch.frombuffer(bytearray(b), dtype=torch.float32).view(shape)
            for b in peer.call("dump")]


def _send(node: Node, peer: Peer, src: Sequence[int], dst: Sequence[int], **kw: object):  # type: ignore[no-untyped-def]
    reg = peer.ready
    kw.setdefault("dst_layer_ids", reg.kv_layer_ids)
    kw.setdefault("dst_bytes_per_page", reg.kv_bytes_per_page)
    return node.manager.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst, **kw)


def _check_landed(node: Node, peer: Peer, src: Sequence[int], dst: Sequence[int]) -> None:
    """Every source entry's pages sit in the destination entry of the same layer and kind;
    every other destination page is still zero."""
    got = _dst_entries(peer, node)
    dst_ids = peer.ready.kv_layer_ids
    expect = [torch.zeros_like(e) for e in got]
    seen: dict[int, int] = {}
    for entry, lid in zip(node.entries(), node.layer_ids(), strict=True):
        j = [k for k, d in enumerate(dst_ids) if d == lid][seen.get(lid, 0)]
        seen[lid] = seen.get(lid, 0) + 1
        expect[j][list(dst)] = entry[list(src)]
    for j, (g, e) in enumerate(zip(got, expect, strict=True)):
        assert torch.equal(g, e), f"destination entry {j} (layer {dst_ids[j]}) differs"


@pytest.fixture(scope="module", params=["mooncake", "ascend"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every test runs with the Mooncake manager and with the Ascend manager over TCP."""
    return str(request.param)


@pytest.fixture(scope="module")
def prefill(backend: str) -> Node:
    """A prefill node with the decode's layers and draft band, filled with random bytes."""
    return Node(Spec(layer_ids=(0, 1, 2, 3), draft_ids=(4,), backend=backend), fill_seed=7)


@pytest.mark.parametrize(
    ("src", "dst", "blocks_per_entry"),
    [
        (list(range(0, 16)), list(range(20, 36)), 1),  # contiguous on both sides
        ([0, 1, 2, 9, 10, 30], [5, 6, 40, 41, 42, 63], 4),  # fragmented
        ([3], [3], 1),
        ([], [], 0),
    ],
)
def test_pages_arrive_byte_for_byte(prefill, decode_peer, src, dst, blocks_per_entry) -> None:  # type: ignore[no-untyped-def]
    decode_peer.call("zero")
    result = _send(prefill, decode_peer, src, dst)
    assert result.blocks == blocks_per_entry * len(prefill.entries())
    _check_landed(prefill, decode_peer, src, dst)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_page_lists(prefill, decode_peer, data) -> None:  # type: ignore[no-untyped-def]
    n = data.draw(st.integers(0, 24))
    src = data.draw(st.permutations(range(NUM_PAGES)))[:n]
    dst = data.draw(st.permutations(range(NUM_PAGES)))[:n]
    decode_peer.call("zero")
    _send(prefill, decode_peer, src, dst)
    _check_landed(prefill, decode_peer, src, dst)


def test_batches_split_at_limit(decode_peer, backend) -> None:  # type: ignore[no-untyped-def]
    node = Node(Spec(layer_ids=(0, 1, 2, 3), draft_ids=(4,), backend=backend,
                     extra={"batch_limit": 7}), fill_seed=3)
    src = list(range(0, 40, 2))  # 20 single-page runs per entry, 10 entries
    dst = list(range(1, 41, 2))
    decode_peer.call("zero")
    result = _send(node, decode_peer, src, dst)
    assert (result.blocks, result.batches) == (200, 29)
    _check_landed(node, decode_peer, src, dst)


def test_two_pipeline_stages_land_in_the_right_layers(decode_peer, backend) -> None:  # type: ignore[no-untyped-def]
    """Each stage owns half the layers and numbers its buffers from 0; ids route them."""
    stage0 = Node(Spec(layer_ids=(0, 1), backend=backend), fill_seed=11)
    stage1 = Node(Spec(layer_ids=(2, 3), backend=backend), fill_seed=12)
    src, dst = [4, 5, 6, 20], [10, 11, 12, 50]
    decode_peer.call("zero")
    _send(stage0, decode_peer, src, dst)
    _send(stage1, decode_peer, src, dst)
    got = _dst_entries(decode_peer, stage0)
    # decode entries: K0 K1 K2 K3 V0 V1 V2 V3 Kd Vd
    for stage, base in ((stage0, 0), (stage1, 2)):
        k0, k1, v0, v1 = stage.entries()
        for local, entry, j in ((0, k0, base), (1, k1, base + 1), (0, v0, 4 + base),
                                (1, v1, 5 + base)):
            assert torch.equal(got[j][dst], entry[src]), (local, j)
    assert not got[8].any() and not got[9].any()


def test_draft_band(decode_peer, backend) -> None:  # type: ignore[no-untyped-def]
    """A draft pool numbered from 0 locally travels in the band num_hidden_layers + i."""
    draft = Node(Spec(layer_ids=tuple(draft_layer_ids(4, 1)), backend=backend), fill_seed=13)
    src, dst = [0, 1, 2], [7, 8, 30]
    decode_peer.call("zero")
    _send(draft, decode_peer, src, dst)
    got = _dst_entries(decode_peer, draft)
    assert torch.equal(got[8][dst], draft.entries()[0][src])
    assert torch.equal(got[9][dst], draft.entries()[1][src])
    assert not any(got[j].any() for j in range(8))


def test_last_pipeline_stage_with_the_draft(decode_peer, backend) -> None:  # type: ignore[no-untyped-def]
    """The last stage of a pipeline (layers 2 and 3) with the draft beside them: its K2 K3 V2 V3
    and the draft's K and V (a second pool, numbered from 0 locally) land in the decode's
    entries of those layers and of the draft band; the first stage's layers stay untouched."""
    last = Node(Spec(layer_ids=(2, 3), draft_ids=tuple(draft_layer_ids(4, 1)), backend=backend),
                fill_seed=14)
    src, dst = [3, 4, 9], [20, 21, 40]
    decode_peer.call("zero")
    _send(last, decode_peer, src, dst)
    _check_landed(last, decode_peer, src, dst)
    got = _dst_entries(decode_peer, last)
    assert torch.equal(got[8][dst], last.entries()[4][src])  # the draft band's K
    assert not any(got[j].any() for j in (0, 1, 4, 5))


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"dst_layer_ids": None}, LayerPairingError, "source only"),
        ({"dst_layer_ids": [0, 1, 2, 3]}, LayerPairingError, "ragged"),
        ({"dst_layer_ids": [0, 1, 2, 9, 0, 1, 2, 9, 4, 4]}, LayerPairingError, "layer 3"),
        ({"dst_bytes_per_page": [256] * 9 + [512]}, LayerPairingError, "bytes per page"),
        ({"dst_bytes_per_page": [256] * 9}, LayerPairingError, "bytes-per-page"),
        ({"src": [0, 1], "dst": [0]}, PageListError, "destination pages"),
        ({"src": [-1], "dst": [0]}, PageListError, "negative"),
        ({"src": [NUM_PAGES], "dst": [0]}, PageListError, "outside"),
    ],
)
def test_mismatch_moves_nothing(prefill, decode_peer, kw, error, match) -> None:  # type: ignore[no-untyped-def]
    decode_peer.call("zero")
    kw = dict(kw)  # the parameter dict is shared by both backends' runs
    src, dst = kw.pop("src", [0, 1]), kw.pop("dst", [2, 3])
    with pytest.raises(error, match=match):
        _send(prefill, decode_peer, src, dst, **kw)
    assert not any(any(b) for b in decode_peer.call("dump"))


def test_positional_pairing_without_ids(decode_peer, backend) -> None:  # type: ignore[no-untyped-def]
    """Without ids on either side, entries pair by position only when the counts match."""
    same = Node(Spec(layer_ids=(0, 1, 2, 3), draft_ids=(4,), backend=backend,
                     extra={"ids": False}), fill_seed=5)
    decode_peer.call("zero")
    _send(same, decode_peer, [1, 2], [3, 9], dst_layer_ids=None)
    _check_landed(same, decode_peer, [1, 2], [3, 9])
    fewer = Node(Spec(layer_ids=(0, 1), backend=backend, extra={"ids": False}), fill_seed=5)
    decode_peer.call("zero")
    with pytest.raises(LayerPairingError, match="counts must match"):
        _send(fewer, decode_peer, [1], [3], dst_layer_ids=None)
    assert not any(any(b) for b in decode_peer.call("dump"))


def test_sglang_keywords_are_accepted(prefill, decode_peer) -> None:  # type: ignore[no-untyped-def]
    decode_peer.call("zero")
    _send(prefill, decode_peer, [5], [6], dst_device_kv_indices=[1], executor=None)
    _check_landed(prefill, decode_peer, [5], [6])


def test_aux_row_travels(prefill, decode_peer) -> None:  # type: ignore[no-untyped-def]
    from transfer.aux import AuxRow

    reg = decode_peer.ready
    row = AuxRow(room=random.getrandbits(63), first_token=17, logprob=-1.25, mrope_delta=-3,
                 hidden=tuple(float(i) for i in range(8)))
    slot = prefill.aux.alloc()
    assert slot is not None
    prefill.aux.write(slot, row)
    prefill.manager.send_aux(reg.session_id, slot, reg.aux_ptr, reg.aux_row_bytes, 2)
    prefill.aux.free(slot)
    assert decode_peer.call("aux.read", 2) == row
