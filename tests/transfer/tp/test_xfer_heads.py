"""Head-sliced send_kvcache between a prefill and a decode of different TP size, over real
Mooncake engines on loopback TCP.

The decode's TP ranks live in a second process (one KV manager per rank), the prefill's ranks
in the test process. Every rank's pool is cut from one "global" KV per entry the way TP cuts it
(:func:`transfer.plan.heads.tp_head_ranges`); after the prefill ranks send what the plan says, each
decode rank's pages are compared with the global KV head by head, and every other page must
still be zero.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from tests.transfer.xfer_peer import Node, Peer, Spec
from transfer.errors import HeadLayoutError, LayerPairingError, TransferError
from transfer.plan.heads import HeadCopy, HeadLayout, landing_slices, plan_head_copies

pytestmark = pytest.mark.slow

NUM_PAGES, PAGE, HEAD_DIM = 32, 4, 8
LAYERS, DRAFT = (0, 1, 2, 3), (4,)
SRC = [0, 1, 2, 9, 10, 30]
DST = [5, 6, 20, 21, 22, 31]
STAGING = 8192  # small: a round holds one or a few pages of every entry, so sends take rounds


def _layout(kv: int, tp: int) -> HeadLayout:
    return HeadLayout.tensor_parallel(kv, tp, head_dim=HEAD_DIM, dtype="torch.float32",
                                      page_size=PAGE)


def _global_kv(kv: int) -> dict[tuple[int, int], torch.Tensor]:
    """(layer id, 0 for K / 1 for V) -> [pages, page, kv heads, head_dim] of known values."""
    gen = torch.Generator().manual_seed(kv)
    return {(lid, kind): torch.randn(NUM_PAGES, PAGE, kv, HEAD_DIM, generator=gen)
            for lid in (*LAYERS, *DRAFT) for kind in (0, 1)}


def _keys(layer_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(layer id, kind) of each entry: the first occurrence of an id is K, the second V."""
    seen: dict[int, int] = {}
    out = []
    for lid in layer_ids:
        out.append((lid, seen.get(lid, 0)))
        seen[lid] = seen.get(lid, 0) + 1
    return out


def _prefill(kv: int, p: int, layer_ids: Sequence[int] = LAYERS,
             draft_ids: Sequence[int] = DRAFT, backend: str = "mooncake") -> list[Node]:
    """``p`` prefill ranks whose pools hold their TP heads of the global KV."""
    full = _global_kv(kv)
    nodes = []
    for start, count in _layout(kv, p).ranges:
        node = Node(Spec(layer_ids=tuple(layer_ids), draft_ids=tuple(draft_ids), heads=count,
                         num_pages=NUM_PAGES, page_size=PAGE, head_dim=HEAD_DIM,
                         backend=backend, extra={"staging_bytes": STAGING}))
        for entry, key in zip(node.entries(), _keys(node.layer_ids()), strict=True):
            entry.copy_(full[key][:, :, start : start + count])
        nodes.append(node)
    return nodes


_decodes: dict[tuple[int, int, int], Peer] = {}


@pytest.fixture(scope="module")
def decode() -> Iterator:  # type: ignore[type-arg]
    """``decode(kv, d, p=0)``: a decode of ``d`` TP ranks (layers 0..3, draft 4), one per
    shape; with ``p``, each rank has a landing buffer for the slices a TP-p prefill lands."""

    def get(kv: int, d: int, p: int = 0) -> Peer:
        if (kv, d, p) not in _decodes:
            specs = [Spec(layer_ids=LAYERS, draft_ids=DRAFT, heads=count, num_pages=NUM_PAGES,
                          page_size=PAGE, head_dim=HEAD_DIM,
                          extra={"landing": landing_slices(_layout(kv, p), _layout(kv, d), j)
                                 if p else ()})
                     for j, (_, count) in enumerate(_layout(kv, d).ranges)]
            _decodes[kv, d, p] = Peer("ranks", Spec(), specs)
        _decodes[kv, d, p].call("zero")
        return _decodes[kv, d, p]

    yield get
    for peer in _decodes.values():
        peer.stop()
    _decodes.clear()


def _send(nodes: list[Node], src: HeadLayout, dst: HeadLayout, peer: Peer,
          pages: tuple[Sequence[int], Sequence[int]] = (SRC, DST)) -> int:
    """Every prefill rank sends what the plan gives it; returns the engine blocks."""
    return sum(_send_copy(node, copy, peer, pages) for rank, node in enumerate(nodes)
               for copy in plan_head_copies(src, dst, rank))


def _send_copy(node: Node, copy: HeadCopy, peer: Peer,
               pages: tuple[Sequence[int], Sequence[int]] = (SRC, DST)) -> int:
    """One planned slice into its decode rank's pool; returns the engine blocks."""
    reg = peer.ready[copy.dst_rank]
    return node.manager.send_kvcache(
        reg.session_id, pages[0], reg.kv_ptrs, pages[1], dst_layer_ids=reg.kv_layer_ids,
        dst_bytes_per_page=reg.kv_bytes_per_page, dst_heads=copy).blocks


LAND = list(range(len(DST)))  # landing pages of the room: consecutive, so page runs follow SRC


def _send_landing(nodes: list[Node], src: HeadLayout, dst: HeadLayout, peer: Peer) -> int:
    """Slices that land go as whole pages into their landing entries, the rest as planned;
    then every decode rank scatters its landing pages into DST. Returns the engine blocks."""
    blocks = 0
    for rank, node in enumerate(nodes):
        for copy in plan_head_copies(src, dst, rank):
            if not copy.lands:
                blocks += _send_copy(node, copy, peer)
                continue
            slot = landing_slices(src, dst, copy.dst_rank).index((copy.dst_head, copy.count))
            ptrs, ids, bpp = peer.call("landing", copy.dst_rank, slot)
            blocks += node.manager.send_kvcache(
                peer.ready[copy.dst_rank].session_id, SRC, ptrs, LAND, dst_layer_ids=ids,
                dst_bytes_per_page=bpp).blocks
    for j in range(dst.tp_size):
        if landing_slices(src, dst, j):
            peer.call("scatter", j, LAND, DST)
    return blocks


def _check_heads(kv: int, dst: HeadLayout, peer: Peer, sent: Sequence[int]) -> None:
    """Decode rank by rank, entry by entry, head by head: the layers in ``sent`` hold the global
    KV of the source pages at the destination pages; every other byte is zero."""
    full = _global_kv(kv)
    for j, (start, count) in enumerate(dst.ranges):
        reg = peer.ready[j]
        for e, (raw, key) in enumerate(zip(peer.call("dump", j), _keys(reg.kv_layer_ids),
                                           strict=True)):
            got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(
                NUM_PAGES, PAGE, count, HEAD_DIM)
            if key[0] not in sent:
                assert not got.any(), f"decode rank {j} entry {e} (layer {key[0]}) was written"
                continue
            for h in range(count):
                want = full[key][SRC, :, start + h]
                assert torch.equal(got[DST, :, h], want), (
                    f"decode rank {j} entry {e} (layer {key[0]}) head {start + h} differs")
            rest = [q for q in range(NUM_PAGES) if q not in DST]
            assert not got[rest].any(), f"decode rank {j} entry {e} has bytes outside its pages"


COMBOS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (4, 1, 4), (4, 2, 2),
          (2, 1, 4), (2, 4, 1), (2, 4, 2)]  # (KV heads, prefill TP, decode TP); last: replicas


@pytest.mark.parametrize(("kv", "p", "d"), COMBOS)
def test_each_decode_rank_receives_exactly_its_heads(decode, kv: int, p: int, d: int) -> None:  # type: ignore[no-untyped-def]
    peer = decode(kv, d)
    blocks = _send(_prefill(kv, p), _layout(kv, p), _layout(kv, d), peer)
    _check_heads(kv, _layout(kv, d), peer, sent=(*LAYERS, *DRAFT))
    if p <= d:  # gathered slices go as page runs: DST has 3 runs, 10 entries per copy
        copies = sum(len(plan_head_copies(_layout(kv, p), _layout(kv, d), r)) for r in range(p))
        assert blocks >= 3 * 10 * copies and blocks <= 6 * 10 * copies


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
def test_ascend_manager_sends_head_slices(decode, p: int, d: int) -> None:  # type: ignore[no-untyped-def]
    """The Ascend manager (over an injected TCP engine, host buffers) registers the staging
    buffer in its one batch and sends head slices like the Mooncake manager."""
    peer = decode(4, d)
    _send(_prefill(4, p, backend="ascend"), _layout(4, p), _layout(4, d), peer)
    _check_heads(4, _layout(4, d), peer, sent=(*LAYERS, *DRAFT))


@pytest.mark.parametrize(("kv", "p", "d"), [(4, 2, 1), (4, 4, 2), (4, 4, 1), (2, 4, 1)])
def test_landing_buffer_takes_whole_pages(decode, kv: int, p: int, d: int) -> None:  # type: ignore[no-untyped-def]
    """A smaller decode TP: each prefill rank writes whole pages into its slice's landing
    entries (as many blocks as equal TP), the decode scatters them into its pool's heads."""
    peer = decode(kv, d, p)
    blocks = _send_landing(_prefill(kv, p), _layout(kv, p), _layout(kv, d), peer)
    _check_heads(kv, _layout(kv, d), peer, sent=(*LAYERS, *DRAFT))
    writers = sum(bool(plan_head_copies(_layout(kv, p), _layout(kv, d), r)) for r in range(p))
    assert blocks == writers * 3 * 10  # 3 page runs, 10 entries, per writing prefill rank


@pytest.mark.parametrize(("p", "d", "landing"), [(2, 4, False), (4, 2, False), (4, 2, True)])
def test_pipeline_stages_and_draft_band_with_head_slices(decode, p: int, d: int,  # type: ignore[no-untyped-def]
                                                         landing: bool) -> None:
    """Layer remapping and head slicing together: the last pipeline stage (layers 2, 3,
    numbered from 0 in its own pool) and the draft (its own pool, band 4) of a TP-p prefill
    land in their layers on a TP-d decode (through its landing buffer, too); layers 0 and 1
    stay untouched."""
    peer = decode(4, d, p if landing else 0)
    send = _send_landing if landing else _send
    for layer_ids in ((2, 3), DRAFT):
        send(_prefill(4, p, layer_ids=layer_ids, draft_ids=()), _layout(4, p), _layout(4, d),
             peer)
    _check_heads(4, _layout(4, d), peer, sent=(2, 3, 4))


def _counted(nodes: list[Node]) -> list[tuple[int, float, bool]]:
    calls: list[tuple[int, float, bool]] = []
    for node in nodes:
        node.manager.on_send = lambda n, s, ok: calls.append((n, s, ok))
    return calls


def test_impossible_layouts_move_nothing(decode) -> None:  # type: ignore[no-untyped-def]
    peer = decode(4, 2)
    nodes = _prefill(4, 1)
    calls = _counted(nodes)
    wide = HeadLayout.tensor_parallel(4, 2, head_dim=2 * HEAD_DIM, dtype="torch.float32",
                                      page_size=PAGE)
    with pytest.raises(HeadLayoutError, match="head_dim differs: prefill has 8, decode has 16"):
        _send(nodes, _layout(4, 1), wide, peer)
    odd = HeadLayout(3, HEAD_DIM, "torch.float32", PAGE, ((0, 2), (2, 1)))
    with pytest.raises(HeadLayoutError, match="TP 2 neither divides the 3 KV heads"):
        _send(nodes, HeadLayout.tensor_parallel(3, 1, head_dim=HEAD_DIM, dtype="torch.float32",
                                                page_size=PAGE), odd, peer)
    assert calls == []
    assert not any(any(b) for j in range(2) for b in peer.call("dump", j))


@pytest.mark.parametrize(
    ("copy", "error", "match"),
    [
        # the plan claims decode pages of 4 heads, the decode's pages hold 2
        (HeadCopy(0, 0, 0, 2, 2, 4, PAGE), LayerPairingError,
         "destination entry 0 with 4 heads needs 512, but has 256"),
        (HeadCopy(0, 3, 0, 2, 4, 2, PAGE), HeadLayoutError, "outside the ranks' heads"),
        (HeadCopy(0, 0, 0, 2, 3, 2, PAGE), HeadLayoutError, "do not split into 3 heads"),
    ],
)
def test_bad_slices_move_nothing(decode, copy: HeadCopy, error: type, match: str) -> None:  # type: ignore[no-untyped-def]
    peer = decode(4, 2)
    nodes = _prefill(4, 1) if copy.src_heads != 2 else _prefill(4, 2)
    calls = _counted(nodes)
    reg = peer.ready[0]
    with pytest.raises(error, match=match):
        nodes[0].manager.send_kvcache(reg.session_id, SRC, reg.kv_ptrs, DST,
                                      dst_layer_ids=reg.kv_layer_ids,
                                      dst_bytes_per_page=reg.kv_bytes_per_page, dst_heads=copy)
    assert calls == []
    assert not any(any(b) for j in range(2) for b in peer.call("dump", j))


def test_gathered_slice_needs_a_staging_buffer(decode) -> None:  # type: ignore[no-untyped-def]
    peer = decode(4, 2)
    node = Node(Spec(layer_ids=LAYERS, draft_ids=DRAFT, heads=4, num_pages=NUM_PAGES,
                     page_size=PAGE, head_dim=HEAD_DIM))
    (copy, _) = plan_head_copies(_layout(4, 1), _layout(4, 2), 0)
    reg = peer.ready[0]
    with pytest.raises(TransferError, match="needs a staging buffer"):
        node.manager.send_kvcache(reg.session_id, SRC, reg.kv_ptrs, DST,
                                  dst_layer_ids=reg.kv_layer_ids, dst_heads=copy)
    assert not any(any(b) for b in peer.call("dump", 0))


def test_staging_and_landing_are_registered_once_and_released() -> None:
    """Staging and landing buffers go in the one registration with the KV entries and aux
    buffer, and close() leaves no range registered."""
    node = Node(Spec(layer_ids=LAYERS, draft_ids=DRAFT, heads=4, num_pages=NUM_PAGES,
                     page_size=PAGE, head_dim=HEAD_DIM,
                     extra={"staging_bytes": STAGING, "landing": [(0, 2), (2, 2)]}))
    ranges = node.manager._ranges  # type: ignore[attr-defined]
    assert node.staging is not None and node.landing is not None
    assert len(ranges) == 10 + 1 + 1 + 2 * 10  # KV entries, aux, staging, two landing slices
    assert {r.ptr for r in ranges} >= {node.staging.ptr, *(b.ptr for b in
                                                            node.landing.buffer_infos())}
    node.manager.close()  # type: ignore[attr-defined]
    assert ranges == []


def test_a_staged_send_of_several_rounds_reports_once(decode) -> None:  # type: ignore[no-untyped-def]
    """The node's transfer metrics see one send per send_kvcache, however many rounds."""
    peer = decode(4, 2)
    (node,) = _prefill(4, 1)
    calls = _counted([node])
    results = [node.manager.send_kvcache(
        peer.ready[c.dst_rank].session_id, SRC, peer.ready[c.dst_rank].kv_ptrs, DST,
        dst_layer_ids=peer.ready[c.dst_rank].kv_layer_ids, dst_heads=c)
        for c in plan_head_copies(_layout(4, 1), _layout(4, 2), 0)]
    assert all(r.batches > 1 for r in results)  # the small staging buffer took several rounds
    assert [(n, ok) for n, _, ok in calls] == [(r.nbytes, True) for r in results]
    _check_heads(4, _layout(4, 2), peer, sent=(*LAYERS, *DRAFT))
