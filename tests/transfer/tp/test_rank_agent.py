"""A tensor-parallel prefill's other ranks write on rank 0's word (:mod:`transfer.tp.rank_agent`):
the agent runs the ordered ``send_kvcache`` with its rank's manager and the bytes land as from a
direct call; refusals come back as the manager's errors (nothing moved) and an agent that is
gone as an engine error; a peer without the key is refused; and the plan over several prefill
ranks (:func:`transfer.bootstrap.handshake.plan_sends`) gives each decode rank its writers.

Over loopback Mooncake TCP, both ranks in this process (the agent serves on its own thread).
"""

from __future__ import annotations

from dataclasses import replace
from multiprocessing import AuthenticationError

import pytest
import torch

from tests.transfer.bootstrap.test_xfer_handshake import CFG, ROOM, ROW, wait_for
from tests.transfer.bootstrap.test_xfer_heads_handshake import KV, NUM_PAGES, _layout, _spec
from tests.transfer.xfer_peer import FreeList, Node
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import plan_sends
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import EngineCallError, IncompatiblePeerError, PageListError
from transfer.plan.heads import landing_slices, plan_head_copies
from transfer.status import KVPoll
from transfer.tp.rank_agent import RankAgent, RemoteRank

pytestmark = pytest.mark.slow
KEY = b"k" * 32


def _pair(src_tp: int, dst_tp: int) -> tuple[Node, Node, RankAgent, RemoteRank]:
    """Prefill rank 1 of TP ``src_tp`` behind an agent, and decode rank 1 of TP ``dst_tp``."""
    count = KV // src_tp
    src = Node(_spec(count, (KV, src_tp, 1)), fill_seed=7)
    dst = Node(_spec(KV // dst_tp, (KV, dst_tp, 1)))
    agent = RankAgent(src.manager, KEY)
    return src, dst, agent, RemoteRank(1, agent.buffers(), KEY)


def _send(remote: RemoteRank, dst: Node, src_pages: list[int], dst_pages: list[int],
          **kw: object) -> object:
    reg = dst.registration()
    return remote.send_kvcache(reg.session_id, src_pages, reg.kv_ptrs, dst_pages,
                               dst_layer_ids=reg.kv_layer_ids,
                               dst_bytes_per_page=reg.kv_bytes_per_page, **kw)


def test_an_ordered_send_lands_the_rank_heads_as_a_direct_one() -> None:
    src, dst, agent, remote = _pair(2, 4)  # rank 1 holds heads 2, 3; decode rank 1 holds 1
    sends: list[tuple[int, bool]] = []
    remote.on_send = lambda nbytes, seconds, ok: sends.append((nbytes, ok))  # rank 0's metrics
    (copy,) = [c for c in plan_head_copies(_layout(2), _layout(4), 1) if c.dst_rank == 2]
    result = _send(remote, dst, [3, 5, 6], [0, 1, 2], dst_heads=copy)
    assert result.nbytes == 3 * sum(dst.manager.kv_bytes_per_page)  # type: ignore[attr-defined]
    assert sends == [(result.nbytes, True)]
    for got, want in zip(dst.entries(), src.entries(), strict=True):
        assert torch.equal(got[[0, 1, 2], :, 0], want[[3, 5, 6], :, 0])
    assert remote.has_staging and remote.kv_ptrs == src.manager.kv_ptrs
    remote.close()


def test_a_refused_order_moves_nothing_and_a_gone_agent_is_an_engine_error() -> None:
    _, dst, _, remote = _pair(2, 2)
    sends: list[tuple[int, bool]] = []
    remote.on_send = lambda nbytes, seconds, ok: sends.append((nbytes, ok))
    with pytest.raises(PageListError, match="prefill rank 1: source page 99 is outside"):
        _send(remote, dst, [99], [0])
    assert not any(e.any() for e in dst.entries())
    assert sends == []  # a refusal is no engine failure
    remote.close()
    with pytest.raises(EngineCallError, match="prefill rank 1 did not answer"):
        _send(remote, dst, [0], [0])
    assert sends == [(0, False)]


def test_a_peer_without_the_key_is_refused_and_rank_0_still_connects() -> None:
    src, dst = Node(_spec(KV // 2, (KV, 2, 1)), fill_seed=7), Node(_spec(KV // 2, (KV, 2, 1)))
    agent = RankAgent(src.manager, KEY)
    with pytest.raises(AuthenticationError):
        RemoteRank(1, agent.buffers(), b"x" * 32)
    remote = RemoteRank(1, agent.buffers(), KEY)
    _send(remote, dst, [2], [4])
    assert torch.equal(dst.entries()[0][4], src.entries()[0][2])
    remote.close()


def test_every_decode_rank_gets_its_writers_and_landing_takes_a_slot_per_writer() -> None:
    ranks = [Node(_spec(KV // 2, (KV, 2, r))) for r in range(2)]
    managers = [n.manager for n in ranks]
    ident = ranks[0].spec.identity
    for dst_tp, want in ((1, [[0, 1]]), (2, [[0], [1]]), (4, [[0], [0], [1], [1]])):
        for j in range(dst_tp):
            reg = Node(_spec(KV // dst_tp, (KV, dst_tp, j))).registration()
            assert [r for r, _ in plan_sends(ident, managers, reg)] == want[j], (dst_tp, j)
    decode = Node(_spec(KV, (KV, 1, 0), landing=[(0, 2), (2, 2)]))
    assert decode.landing is not None
    one_slot = decode.manager.registration(
        page_size=ident.page_size, dtype=ident.dtype, model_fingerprint=ident.model_fingerprint,
        heads=_layout(1), landing=decode.landing.buffer_infos(0))
    with pytest.raises(IncompatiblePeerError, match=r"prefill ranks \[0, 1\] each write part"):
        plan_sends(ident, managers, one_slot)
    both = replace(one_slot, landing_ptrs=[b.ptr for b in decode.landing.buffer_infos()],
                   landing_bytes_per_page=[b.bytes_per_page
                                           for b in decode.landing.buffer_infos()])
    assert [r for r, _ in plan_sends(ident, managers, both)] == [0, 1]


def test_a_tp_prefill_lands_every_rank_slice_in_its_slot() -> None:
    """P TP 2 (rank 1 behind its agent) into a TP 1 decode with a landing slot per prefill rank:
    each rank writes whole pages of its heads into its slot, the client scatters them on
    Success, and the pool holds every head; the landing pages come back."""
    ranks = [Node(_spec(KV // 2, (KV, 2, r)), fill_seed=11 + r) for r in range(2)]
    agent = RankAgent(ranks[1].manager, KEY)
    remote = RemoteRank(1, agent.buffers(), KEY)
    server = PrefillBootstrapServer(ranks[0].manager, ranks[0].spec.identity, config=CFG,
                                    ranks=[remote])
    spec = _spec(KV, (KV, 1, 0), landing=landing_slices(_layout(2), _layout(1), 0))
    decode, pages = Node(spec), FreeList(NUM_PAGES)
    assert decode.landing is not None
    client = DecodeBootstrapClient(decode.manager, spec.identity, server.address, pages.give,
                                   config=CFG, landing=(decode.landing, None))
    assert client.prefill_ranges == ((0, 2), (2, 2))
    server.add_room(ROOM)
    client.add_room(ROOM)
    dst, src = pages.take(3), [2, 5, 8]
    client.send_destination(ROOM, dst)
    wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert server.send_chunk(ROOM, src, last=ROW) is KVPoll.Success
    wait_for(lambda: client.poll(ROOM) is KVPoll.Success, 2)
    client.commit(ROOM)
    for e, entry in enumerate(decode.entries()):
        for r, node in enumerate(ranks):
            got = entry[dst][:, :, 2 * r : 2 * r + 2]
            assert torch.equal(got, node.entries()[e][src]), (e, r)
    assert client.free_landing_pages == list(range(NUM_PAGES))
    server.release(ROOM)
    assert server.num_rooms == 0 and client.num_rooms == 0
    client.close()
    server.close()
    remote.close()
