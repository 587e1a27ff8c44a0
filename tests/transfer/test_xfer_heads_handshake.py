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
from test_xfer_handshake import CFG, ROOM, ROW, wait_for
from xfer_peer import FreeList, Node, Spec

from transfer.bootstrap import check_compatible
from transfer.bootstrap_decode import DecodeBootstrapClient
from transfer.bootstrap_prefill import PrefillBootstrapServer
from transfer.errors import IncompatiblePeerError
from transfer.heads import tp_head_ranges
from transfer.status import KVPoll

pytestmark = pytest.mark.slow

KV, HEAD_DIM, PAGE, NUM_PAGES = 4, 8, 4, 16


def _spec(heads: int, tp: tuple[int, int, int] | None, **over: object) -> Spec:
    extra: dict = {"staging_bytes": 1 << 16}
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


def test_fan_in_room_lands_every_head_and_leaves_nothing() -> None:
    nodes, servers, full = _prefill(2)
    spec = _spec(KV, (KV, 1, 0))
    decode, pages = Node(spec), FreeList(NUM_PAGES)
    clients = [DecodeBootstrapClient(decode.manager, spec.identity, s.address, pages.give,
                                     config=CFG) for s in servers]
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


@pytest.mark.parametrize(
    ("decode_spec", "match"),
    [
        (_spec(2, (KV, 2, 0), head_dim=2 * HEAD_DIM),
         "KV heads cannot be paired: head_dim differs: prefill has 8, decode has 16"),
        (_spec(1, (KV, 4, 2)),
         r"prefill rank 0 of TP 2 writes none of decode rank 2's KV heads \[2, 3\)"),
        (_spec(4, None), "only the prefill describes its KV heads"),
    ],
)
def test_impossible_pairs_are_refused_with_the_numbers(decode_spec: Spec, match: str) -> None:
    nodes, servers, _ = _prefill(2)
    decode = Node(decode_spec)
    with pytest.raises(IncompatiblePeerError, match=match):
        DecodeBootstrapClient(decode.manager, decode_spec.identity, servers[0].address,
                              FreeList(NUM_PAGES).give, config=CFG)
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
