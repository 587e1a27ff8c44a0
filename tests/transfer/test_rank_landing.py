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
from test_xfer_handshake import CFG, ROOM, ROW, wait_for
from test_xfer_heads_handshake import KV, NUM_PAGES, _layout, _spec
from xfer_peer import FreeList, Node

from decode_node.clients import BootstrapClients
from decode_node.landing import Landings
from decode_node.rank_landing import LandingAgent, RankLandingAgent
from transfer.bootstrap_prefill import PrefillBootstrapServer
from transfer.errors import TransferError
from transfer.rank_agent import RankAgent, RemoteRank
from transfer.status import KVPoll

pytestmark = pytest.mark.slow
KEY = b"k" * 32


def test_a_tp4_prefill_lands_in_both_ranks_of_a_tp2_decode() -> None:
    prefill = [Node(_spec(1, (KV, 4, r)), fill_seed=20 + r) for r in range(4)]
    remote = [RemoteRank(r, RankAgent(prefill[r].manager, KEY).buffers(), KEY)
              for r in range(1, 4)]
    server = PrefillBootstrapServer(prefill[0].manager, prefill[0].spec.identity, config=CFG,
                                    ranks=remote)
    decode = [Node(_spec(2, (KV, 2, r))) for r in range(2)]
    agent = LandingAgent(decode[1].pools, decode[1].manager, KEY)
    rank1 = RankLandingAgent(1, agent.port, KEY, decode[1].layer_ids())
    landings = Landings(decode[0].pools, decode[0].manager, _layout(2), NUM_PAGES, [rank1])
    pages = FreeList(NUM_PAGES)
    ident = decode[0].spec.identity
    clients = BootstrapClients(decode[0].manager, ident, pages.give, CFG,
                               [decode[1].registration()], landings)
    group = clients.get(f"{server.address[0]}:{server.address[1]}")
    assert [c.tp_rank for c in group] == [1, 0]
    try:
        server.add_room(ROOM)
        dst, src = pages.take(3), [2, 5, 8]
        for c in group:
            c.add_room(ROOM)
            c.send_destination(ROOM, dst, aux=c.tp_rank == 0)
        wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 3)
        blocks = record_blocks([prefill[0].manager, *remote])
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
        clients.close()
        server.close()


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
