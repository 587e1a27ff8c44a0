"""Landing on every rank of a TP decode: a prefill of TP 4 (one KV head per rank, ranks 1..3
behind their send agents) into a decode of TP 2 (two heads per rank), so two prefill ranks write
slices of each decode rank. Rank 1's landing buffer lives behind its landing agent
(:mod:`decode_node.rank_landing`), made, registered and scattered there; the decode's clients
register again with their landing slots (:class:`decode_node.clients.BootstrapClients`).

Over loopback Mooncake TCP, every rank in this process (each agent on its own thread): both
decode ranks hold exactly their heads of the prefill's pages, whole pages moved (no per-token
blocks), every landing page comes back, and a refused landing order or a gone agent is a
``TransferError`` naming the rank.
"""

from __future__ import annotations

import pytest
import torch

from decode_node.clients import BootstrapClients
from decode_node.landing import Landings
from decode_node.rank_landing import LandingAgent, RankLandingAgent
from tests.transfer.bootstrap.test_xfer_handshake import CFG, ROOM, ROW, wait_for
from tests.transfer.bootstrap.test_xfer_heads_handshake import KV, NUM_PAGES, _layout, _spec
from tests.transfer.xfer_peer import FreeList, Node
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import TransferError
from transfer.status import KVPoll
from transfer.tp.rank_agent import RankAgent, RemoteRank

pytestmark = pytest.mark.slow
KEY = b"k" * 32


class Tp4IntoTp2:
    """A TP 4 prefill (its bootstrap server and rank stand-ins) and both ranks of a TP 2
    decode, rank 1's landing behind its agent, with the decode's clients of the prefill."""

    def __init__(self) -> None:
        self.prefill = [Node(_spec(1, (KV, 4, r)), fill_seed=20 + r) for r in range(4)]
        self.remote = [RemoteRank(r, RankAgent(self.prefill[r].manager, KEY).buffers(), KEY)
                       for r in range(1, 4)]
        self.server = PrefillBootstrapServer(self.prefill[0].manager,
                                             self.prefill[0].spec.identity, config=CFG,
                                             ranks=self.remote)
        self.decode = [Node(_spec(2, (KV, 2, r))) for r in range(2)]
        # kept, as the rank's process keeps it: its landing buffers stay registered after
        # rank 0's link closes
        self.agent = LandingAgent(self.decode[1].pools, self.decode[1].manager, KEY)
        self.rank1 = RankLandingAgent(1, self.agent.port, KEY, self.decode[1].layer_ids())
        landings = Landings(self.decode[0].pools, self.decode[0].manager, _layout(2),
                            NUM_PAGES, [self.rank1])
        self.pages = FreeList(NUM_PAGES)
        self.clients = BootstrapClients(self.decode[0].manager, self.decode[0].spec.identity,
                                        self.pages.give, CFG, [self.decode[1].registration()],
                                        landings)
        address = self.server.address
        self.group = self.clients.get(f"{address[0]}:{address[1]}")
        assert [c.tp_rank for c in self.group] == [1, 0]

    def send(self, dst: list[int]) -> None:
        self.server.add_room(ROOM)
        for c in self.group:
            c.add_room(ROOM)
            c.send_destination(ROOM, dst, aux=c.tp_rank == 0)
        wait_for(lambda: self.server.poll(ROOM) is KVPoll.WaitingForInput, 3)

    def close(self) -> None:
        self.clients.close()
        self.server.close()


def test_a_tp4_prefill_lands_in_both_ranks_of_a_tp2_decode() -> None:
    nodes = Tp4IntoTp2()
    prefill, decode, server, group = nodes.prefill, nodes.decode, nodes.server, nodes.group
    try:
        dst, src = nodes.pages.take(3), [2, 5, 8]
        nodes.send(dst)
        blocks = record_blocks([prefill[0].manager, *nodes.remote])
        assert server.send_chunk(ROOM, src, last=ROW) is KVPoll.Success
        for c in group:
            wait_for(lambda c=c: c.poll(ROOM) is KVPoll.Success, 3)
        group[0].commit_without_aux(ROOM)
        assert group[1].commit(ROOM).room == ROOM
        # every prefill rank wrote its slot whole pages: a block per page and entry (one per
        # token and page without landing)
        assert blocks == [len(src) * len(decode[0].entries())] * 4
        for d, node in enumerate(decode):
            for e, entry in enumerate(node.entries()):
                for h in range(2):  # decode rank d's head h is prefill rank 2d + h's only head
                    want = prefill[2 * d + h].entries()[e][src][:, :, 0]
                    assert torch.equal(entry[dst][:, :, h], want), (d, e, h)
        assert all(c.free_landing_pages == list(range(NUM_PAGES)) for c in group)
        server.release(ROOM)
        assert server.num_rooms == 0 and all(c.num_rooms == 0 for c in group)
    finally:
        nodes.close()


def test_a_scatter_that_fails_on_a_rank_fails_its_room_and_the_client_lives_on() -> None:
    """Rank 1's landing agent is gone when the prefill's Success comes: that rank's room fails
    naming it (its pages wait only for the release), rank 0's succeeds, both clients stay."""
    nodes = Tp4IntoTp2()
    try:
        dst = nodes.pages.take(2)
        nodes.send(dst)
        nodes.rank1.close()
        assert nodes.server.send_chunk(ROOM, [1, 2], last=ROW) is KVPoll.Success
        rank1, rank0 = nodes.group
        wait_for(lambda: rank1.poll(ROOM) is KVPoll.Failed, 3)
        assert "landing the prefill's pages failed: decode rank 1's landing agent did not " \
               "answer" in rank1.failure_reason(ROOM)
        wait_for(lambda: rank0.poll(ROOM) is KVPoll.Success, 3)
        assert rank1.alive and rank0.alive
        rank1.release(ROOM)
        rank0.commit(ROOM)
        nodes.server.release(ROOM)
        wait_for(lambda: rank1.num_rooms == 0, 3)  # quiesced: freed at once
        assert rank1.free_landing_pages == list(range(NUM_PAGES))
        assert nodes.pages.held == 0  # the release handed the room's pages back
    finally:
        nodes.close()


def record_blocks(ranks: list) -> list[int]:  # noqa: ANN001 - managers and RemoteRanks
    """The blocks each of ``ranks`` writes from now on, by rank (updated in place)."""
    counts = [0] * len(ranks)
    for i, rank in enumerate(ranks):
        send = rank.send_kvcache

        def counted(*args, i=i, send=send, **kwargs):  # noqa: ANN002, ANN003, ANN202
            result = send(*args, **kwargs)
            counts[i] += result.blocks
            return result

        rank.send_kvcache = counted
    return counts


def test_a_refused_landing_order_and_a_gone_agent_name_the_rank() -> None:
    node = Node(_spec(2, (KV, 2, 1)))
    agent = LandingAgent(node.pools, node.manager, KEY)
    rank1 = RankLandingAgent(1, agent.port, KEY, node.layer_ids())
    with pytest.raises(TransferError, match="decode rank 1 made no landing buffer: ValueError"):
        rank1.landing([(1, 2)], NUM_PAGES)  # heads 1..2 of a rank that holds 2
    landing = rank1.landing([(0, 1), (1, 1)], NUM_PAGES)
    assert landing.num_pages == NUM_PAGES
    assert len(landing.buffer_infos()) == 2 * len(landing.buffer_infos(0))
    assert rank1.landing([(0, 1), (1, 1)], NUM_PAGES).buffer_infos() == landing.buffer_infos()
    with pytest.raises(TransferError, match="decode rank 1 did not scatter"):
        landing.scatter([0, 1], [3])  # two landing pages for one pool page
    rank1.close()
    with pytest.raises(TransferError, match="decode rank 1's landing agent did not answer"):
        landing.scatter([0], [3])
