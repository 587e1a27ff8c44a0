"""One prefill rank into every rank of a TP decode (decode TP > prefill TP), as the nodes run it:
the decode's rank 0 registers every rank with the prefill (one connection each; another rank's
client sends that rank's registration), each room's destination goes over every connection, and
the prefill room keeps one target per decode rank (:mod:`transfer.bootstrap.prefill`).

Over loopback Mooncake TCP, in this process: a prefill holding 4 KV heads and a decode of TP 2
or 4 (one :class:`Node` per rank, each with its own engine). Destination bytes are checked head
by head; a room whose ranks disagree moves nothing and says why; an abort from one rank reaches
every rank; every test ends holding no room, page or aux row.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from tests.transfer.bootstrap.test_xfer_handshake import CFG, ROOM, ROW, wait_for
from tests.transfer.bootstrap.test_xfer_heads_handshake import KV, NUM_PAGES, _spec
from tests.transfer.xfer_peer import FreeList, Node
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import TransferError
from transfer.plan.heads import tp_head_ranges
from transfer.status import KVPoll

pytestmark = pytest.mark.slow


class Decode:
    """The ranks of a TP decode and, per rank, its client of one prefill (rank 0's with its own
    manager, the others' with their rank's registration) and the pages handed back to it."""

    def __init__(self, tp: int, server: PrefillBootstrapServer) -> None:
        self.specs = [_spec(count, (KV, tp, r)) for r, (_, count) in
                      enumerate(tp_head_ranges(KV, tp))]
        self.ranks = [Node(spec) for spec in self.specs]
        self.freed: list[list[int]] = [[] for _ in self.ranks]
        ident = self.specs[0].identity
        self.clients = [DecodeBootstrapClient(
            self.ranks[0].manager, ident, server.address, self.freed[r].extend, config=CFG,
            rank=self.ranks[r].registration() if r else None) for r in range(tp)]

    def send(self, pages: list[int], *, pages_of: dict[int, list[int]] | None = None) -> None:
        """Add the room on every rank and send each rank's destination (rank 0's with the aux
        slot, the others' ``pages_of`` theirs, default ``pages``)."""
        for c in self.clients:
            c.add_room(ROOM)
        for r, c in reversed(list(enumerate(self.clients))):
            c.send_destination(ROOM, (pages_of or {}).get(r, pages), aux=r == 0)

    def wait(self, status: KVPoll) -> None:
        for c in self.clients:
            wait_for(lambda c=c: c.poll(ROOM) is status, 3)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def _prefill() -> tuple[Node, PrefillBootstrapServer]:
    node = Node(_spec(KV, (KV, 1, 0)), fill_seed=5)
    return node, PrefillBootstrapServer(node.manager, node.spec.identity, config=CFG)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_decode_rank_gets_exactly_its_heads(tp: int) -> None:
    prefill, server = _prefill()
    decode, pages = Decode(tp, server), FreeList(NUM_PAGES)
    server.add_room(ROOM)
    dst, src = pages.take(4), [1, 2, 7, 9]
    for r in range(tp - 1, 0, -1):  # the room waits until every rank's destination came
        decode.clients[r].add_room(ROOM)
        decode.clients[r].send_destination(ROOM, dst, aux=False)
    wait_for(lambda: server.num_rooms == 1, 2)
    assert server.poll(ROOM) is KVPoll.Bootstrapping
    decode.clients[0].add_room(ROOM)
    decode.clients[0].send_destination(ROOM, dst)
    wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert server.send_chunk(ROOM, src[:3]) is KVPoll.Transferring
    assert server.send_chunk(ROOM, src[3:], last=ROW) is KVPoll.Success
    decode.wait(KVPoll.Success)
    assert decode.clients[0].commit(ROOM) == replace(ROW, room=ROOM)
    for c in decode.clients[1:]:
        c.commit_without_aux(ROOM)
    for node, (start, count) in zip(decode.ranks, tp_head_ranges(KV, tp), strict=True):
        for e, (got, full) in enumerate(zip(node.entries(), prefill.entries(), strict=True)):
            for h in range(count):
                assert torch.equal(got[dst, :, h], full[src, :, start + h]), (e, start + h)
    server.release(ROOM)
    assert server.num_rooms == 0 and all(c.num_rooms == 0 for c in decode.clients)
    assert decode.ranks[0].aux.num_free == decode.ranks[0].aux.num_rows
    decode.close()
    server.close()


def test_ranks_that_disagree_fail_the_room_and_nothing_moves() -> None:
    """Rank 1 names other pages than rank 0: the room fails with the reason on both ranks,
    before a byte is written; each rank's client hands its pages back once told."""
    _, server = _prefill()
    decode = Decode(2, server)
    server.add_room(ROOM)
    decode.send([0, 1], pages_of={1: [2, 3]})
    decode.wait(KVPoll.Failed)
    reason = decode.clients[0].failure_reason(ROOM)  # whichever destination came second says
    assert re.search(r"decode ranks [01] and [01] sent different pages", reason), reason
    assert server.poll(ROOM) is KVPoll.Failed
    assert server.send_chunk(ROOM, [5, 6], last=ROW) is KVPoll.Failed
    for c in decode.clients:
        c.release(ROOM)
    wait_for(lambda: decode.freed == [[0, 1], [2, 3]], 3)
    assert not any(e.any() for node in decode.ranks for e in node.entries())
    server.release(ROOM)
    assert server.num_rooms == 0 and all(c.num_rooms == 0 for c in decode.clients)
    decode.close()
    server.close()


def test_an_abort_from_one_rank_reaches_every_rank() -> None:
    """Rank 0 aborts mid-transfer: the prefill fails the room, answers rank 0 AbortAck and
    tells rank 1 the room failed (quiesced), so both hand their pages back without waiting
    out the quarantine."""
    _, server = _prefill()
    decode = Decode(2, server)
    server.add_room(ROOM)
    decode.send([0, 1, 2])
    wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert server.send_chunk(ROOM, [4]) is KVPoll.Transferring
    decode.clients[0].abort(ROOM, "client went away")
    wait_for(lambda: server.poll(ROOM) is KVPoll.Failed, 2)
    assert "client went away" in server.failure_reason(ROOM)
    decode.wait(KVPoll.Failed)
    for c in decode.clients:
        c.release(ROOM)
    wait_for(lambda: decode.freed == [[0, 1, 2], [0, 1, 2]], CFG.quarantine_s / 2)
    server.release(ROOM)
    assert server.num_rooms == 0 and all(c.num_rooms == 0 for c in decode.clients)
    decode.close()
    server.close()


def test_another_ranks_client_takes_no_aux_slot() -> None:
    _, server = _prefill()
    decode = Decode(2, server)
    decode.clients[1].add_room(ROOM)
    with pytest.raises(TransferError, match="rank 1's client sends no aux slot"):
        decode.clients[1].send_destination(ROOM, [0])
    decode.clients[1].abort(ROOM)
    decode.clients[1].release(ROOM)
    assert decode.clients[1].num_rooms == 0
    decode.close()
    server.close()
