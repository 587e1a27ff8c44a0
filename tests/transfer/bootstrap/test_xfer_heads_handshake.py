"""The P/D handshake between sides of different TP size: every registration carries the
decode's head ranges, the prefill rank plans its slice from them or refuses with the numbers.

A decode of TP 1 (4 KV heads) registers with both ranks of a TP-2 prefill, as a decode does with
the stages of a pipeline: one room, one destination per prefill rank (only rank 0's with the aux
row). Prefill servers and decode clients run in this process, over loopback Mooncake TCP.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.transfer.bootstrap.test_xfer_handshake import CFG, ROOM, ROW, wait_for
from tests.transfer.xfer_peer import FreeList, Node, Spec
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import check_compatible
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import IncompatiblePeerError
from transfer.plan.heads import HeadLayout, landing_slices, tp_head_ranges
from transfer.status import KVPoll

pytestmark = pytest.mark.slow

KV, HEAD_DIM, PAGE, NUM_PAGES = 4, 8, 4, 16


def _layout(tp: int) -> HeadLayout:
    return HeadLayout.tensor_parallel(KV, tp, head_dim=HEAD_DIM, dtype="torch.float32",
                                      page_size=PAGE)


def _spec(heads: int, tp: tuple[int, int, int] | None, landing: list | None = None,
          **over: object) -> Spec:
    extra: dict = {"staging_bytes": 1 << 16, "landing": landing or ()}
    if tp is not None:
        extra["tp"] = tp
    geo: dict = {"heads": heads, "head_dim": HEAD_DIM, "page_size": PAGE,
                 "num_pages": NUM_PAGES, **over}
    return Spec(extra=extra, **geo)


def _prefill(tp: int) -> tuple[list[Node], list[PrefillBootstrapServer], torch.Tensor]:
    """``tp`` prefill ranks cut from one global KV ``[entries, pages, page, KV, head_dim]``."""
    full = torch.randn(8, NUM_PAGES, PAGE, KV, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    nodes, servers = [], []
    for rank, (start, count) in enumerate(tp_head_ranges(KV, tp)):
        spec = _spec(count, (KV, tp, rank))
        node = Node(spec)
        for e, entry in enumerate(node.entries()):
            entry.copy_(full[e, :, :, start : start + count])
        nodes.append(node)
        servers.append(PrefillBootstrapServer(node.manager, spec.identity, config=CFG))
    return nodes, servers, full


@pytest.mark.parametrize("landing", [False, True])
def test_fan_in_room_lands_every_head_and_leaves_nothing(landing: bool) -> None:
    """Without a landing buffer each prefill rank writes its heads into the strided pool pages;
    with one, whole pages into its slot, which the client scatters on Success."""
    nodes, servers, full = _prefill(2)
    slices = landing_slices(_layout(2), _layout(1), 0) if landing else []
    spec = _spec(KV, (KV, 1, 0), landing=slices)
    decode, pages = Node(spec), FreeList(NUM_PAGES)
    clients = [DecodeBootstrapClient(
        decode.manager, spec.identity, s.address, pages.give, config=CFG,
        landing=(decode.landing, r) if decode.landing is not None else None)
        for r, s in enumerate(servers)]
    dst, src = pages.take(4), [1, 2, 7, 9]
    for server, client in zip(servers, clients, strict=True):
        server.add_room(ROOM)
        client.add_room(ROOM)
    clients[0].send_destination(ROOM, dst)
    clients[1].send_destination(ROOM, dst, aux=False)
    for server in servers:
        wait_for(lambda s=server: s.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert servers[1].send_chunk(ROOM, src, finish=True) is KVPoll.Success
    assert servers[0].send_chunk(ROOM, src, last=ROW) is KVPoll.Success
    for client in clients:
        wait_for(lambda c=client: c.poll(ROOM) is KVPoll.Success, 2)
    assert clients[0].commit(ROOM) == replace(ROW, room=ROOM)
    clients[1].commit_without_aux(ROOM)
    for e, entry in enumerate(decode.entries()):
        for h in range(KV):
            assert torch.equal(entry[dst, :, h], full[e, src, :, h]), f"entry {e} head {h}"
    if decode.landing is not None:  # the pages went through the landing slots, and came back
        for r, node in enumerate(nodes):
            assert torch.equal(decode.landing.land[r][0][: len(src)], node.entries()[0][src])
        assert all(c.free_landing_pages == list(range(NUM_PAGES)) for c in clients)
    for server in servers:
        server.release(ROOM)
    pages.give(dst)
    wait_for(lambda: pages.held == 0, 5)
    assert all(c.num_rooms == 0 for c in clients) and all(s.num_rooms == 0 for s in servers)
    assert decode.aux.num_free == decode.aux.num_rows
    for c in clients:
        c.close()
    for s in servers:
        s.close()


def test_a_failed_landing_room_frees_its_landing_pages() -> None:
    """An aborted room's landing pages go back with its pages, once the prefill is quiet."""
    nodes, servers, _ = _prefill(2)
    spec = _spec(KV, (KV, 1, 0), landing=landing_slices(_layout(2), _layout(1), 0))
    decode, pages = Node(spec), FreeList(NUM_PAGES)
    assert decode.landing is not None
    client = DecodeBootstrapClient(decode.manager, spec.identity, servers[1].address, pages.give,
                                   config=CFG, landing=(decode.landing, 1))
    servers[1].add_room(ROOM)
    client.add_room(ROOM)
    client.send_destination(ROOM, pages.take(3), aux=False)
    assert len(client.free_landing_pages) == NUM_PAGES - 3
    client.abort(ROOM)
    client.release(ROOM)
    wait_for(lambda: pages.held == 0, 5)
    assert client.free_landing_pages == list(range(NUM_PAGES))
    wait_for(lambda: servers[1].poll(ROOM) is KVPoll.Failed, 2)
    servers[1].release(ROOM)
    assert client.num_rooms == 0 and servers[1].num_rooms == 0
    client.close()
    for s in servers:
        s.close()


@pytest.mark.parametrize(
    ("decode_spec", "match"),
    [
        (_spec(2, (KV, 2, 0), head_dim=2 * HEAD_DIM),
         "KV heads cannot be paired: head_dim differs: prefill has 8, decode has 16"),
        (_spec(1, (KV, 4, 2)),
         r"prefill rank 0 of TP 2 writes none of decode rank 2's KV heads \[2, 3\)"),
        (_spec(4, None), "only the prefill describes its KV heads"),
        (_spec(1, (KV, 4, 0), landing=[(0, 1)]),
         "offers a landing buffer, but this prefill rank sends 1 of its 2 KV heads into a rank "
         "holding 1"),
    ],
)
def test_impossible_pairs_are_refused_with_the_numbers(decode_spec: Spec, match: str) -> None:
    nodes, servers, _ = _prefill(2)
    decode = Node(decode_spec)
    with pytest.raises(IncompatiblePeerError, match=match):
        DecodeBootstrapClient(decode.manager, decode_spec.identity, servers[0].address,
                              FreeList(NUM_PAGES).give, config=CFG,
                              landing=(decode.landing, 0) if decode.landing else None)
    assert servers[0].num_rooms == 0
    assert not any(e.any() for e in decode.entries())
    servers[0].close()
    servers[1].close()


@pytest.mark.parametrize(
    ("ranges", "kv", "match"),
    [
        ([0, 3, 3, 1], KV, r"decode rank 0 of TP 2 claims KV heads \[0, 3\) of 4, but TP 2 "
         r"gives it \[0, 2\)"),
        ([0, 2, 2, 1], 3, "KV heads differs: prefill has 4, decode has 3"),
        ([0, 2, 2], KV, "3 head-range numbers, not pairs"),
    ],
)
def test_odd_decode_layouts_are_refused(ranges: list[int], kv: int, match: str) -> None:
    """Registrations whose head ranges no TP split gives are refused before a room exists."""
    nodes, servers, _ = _prefill(1)
    spec = _spec(2, (KV, 2, 0))
    reg = Node(spec).registration()
    odd = replace(reg, kv_head_ranges=ranges, num_kv_heads=kv)
    with pytest.raises(IncompatiblePeerError, match=match):
        check_compatible(nodes[0].spec.identity, nodes[0].manager, odd)
    servers[0].close()
