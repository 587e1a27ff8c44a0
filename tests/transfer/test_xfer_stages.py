"""Pipeline-parallel prefill over the handshake: two prefill stages, each owning half of the
layers, push into one decode node. Only the last stage writes the aux row; the first finishes
its room without one (``send_chunk(finish=True)`` / ``send_destination(aux=False)``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from tests.transfer.bootstrap.test_xfer_handshake import CFG, ROOM, ROW, wait_for
from tests.transfer.xfer_peer import FreeList, Node, Spec
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import TransferError
from transfer.status import KVPoll

STAGE_LAYERS = ((0, 1), (2, 3))
# heartbeats and the decode's waiting deadline far above a loaded machine's stalls (with CFG,
# three 0.2 s heartbeats missed while other processes hold both cores fail a room); the
# bootstrap deadline stays CFG's 1 s: test_success_without_aux_needs_a_destination waits for it
LENIENT = replace(CFG, waiting_timeout_s=10.0, heartbeat_misses=25)


class Stages:
    """Two prefill stage servers and one decode node with a client per stage, in-process."""

    def __init__(self) -> None:
        full = Spec()
        self.p_nodes = [Node(replace(full, layer_ids=ids), fill_seed=40 + i)
                        for i, ids in enumerate(STAGE_LAYERS)]
        self.servers = [PrefillBootstrapServer(n.manager, full.identity, config=LENIENT)
                        for n in self.p_nodes]
        self.d_node = Node(full)
        self.pages = FreeList(full.num_pages)
        self.freed: list[list[int]] = []  # each client frees a failed room's pages once
        self.clients = [DecodeBootstrapClient(self.d_node.manager, full.identity, s.address,
                                              self.freed.append, config=LENIENT)
                        for s in self.servers]

    def start_room(self, n_pages: int) -> list[int]:
        dst = self.pages.take(n_pages)
        for i, (server, client) in enumerate(zip(self.servers, self.clients, strict=True)):
            server.add_room(ROOM)
            client.add_room(ROOM)
            client.send_destination(ROOM, dst, aux=i == len(self.servers) - 1)
        for server in self.servers:
            wait_for(lambda s=server: s.poll(ROOM) is KVPoll.WaitingForInput, 10)
        return dst

    def assert_clean(self) -> None:
        assert self.pages.held == 0
        assert all(c.num_rooms == 0 for c in self.clients)
        assert all(s.num_rooms == 0 for s in self.servers)
        assert self.d_node.aux.num_free == self.d_node.aux.num_rows

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.servers:
            s.close()


@pytest.fixture
def stages() -> Iterator[Stages]:
    s = Stages()
    yield s
    s.close()


def test_each_stage_fills_its_layers(stages: Stages) -> None:
    dst = stages.start_room(4)
    first, last = stages.servers
    assert first.send_chunk(ROOM, [0, 1]) is KVPoll.Transferring
    assert first.send_chunk(ROOM, [2, 3], finish=True) is KVPoll.Success
    assert last.send_chunk(ROOM, [4, 5, 6, 7], last=ROW) is KVPoll.Success
    c0, c1 = stages.clients
    wait_for(lambda: c0.poll(ROOM) is KVPoll.Success, 10)
    wait_for(lambda: c1.poll(ROOM) is KVPoll.Success, 10)
    with pytest.raises(TransferError):
        c0.commit(ROOM)  # no aux row from the first stage
    c0.commit_without_aux(ROOM)
    assert c1.commit(ROOM) == replace(ROW, room=ROOM)
    # decode entries: [K0..K3, V0..V3]; stage entries: [K_a, K_b, V_a, V_b]
    d = stages.d_node.entries()
    for stage, (node, src) in enumerate(zip(stages.p_nodes, ([0, 1, 2, 3], [4, 5, 6, 7]),
                                            strict=True)):
        k_a, k_b, v_a, v_b = node.entries()
        lo = 2 * stage
        for s_e, d_e in ((k_a, d[lo]), (k_b, d[lo + 1]), (v_a, d[4 + lo]), (v_b, d[5 + lo])):
            assert torch.equal(d_e[dst], s_e[src])
    for s in stages.servers:
        s.release(ROOM)
    stages.pages.give(dst)
    stages.assert_clean()


def test_aux_row_to_a_stage_without_aux_fails(stages: Stages) -> None:
    dst = stages.start_room(2)
    first, last = stages.servers
    assert first.send_chunk(ROOM, [0, 1], last=ROW) is KVPoll.Failed
    c0, c1 = stages.clients
    wait_for(lambda: c0.poll(ROOM) is KVPoll.Failed, 10)
    c1.abort(ROOM, "another stage failed")
    wait_for(lambda: last.poll(ROOM) is KVPoll.Failed, 10)
    for c in stages.clients:
        c.release(ROOM)
    for s in stages.servers:
        s.release(ROOM)
    wait_for(lambda: len(stages.freed) == 2, 10)  # every stage said it writes no more
    assert stages.freed == [dst, dst]
    stages.pages.give(dst)
    stages.assert_clean()


def test_success_without_aux_needs_a_destination(stages: Stages) -> None:
    first = stages.servers[0]
    first.add_room(ROOM)
    stages.clients[0].add_room(ROOM)
    with pytest.raises(TransferError):
        first.send_chunk(ROOM, [0], finish=True)  # gated: no destination yet
    first.abort(ROOM, "test over")
    first.release(ROOM)
    # no destination, so the prefill knows no decode to tell: the decode's room fails at its
    # bootstrap deadline
    wait_for(lambda: stages.clients[0].poll(ROOM) is KVPoll.Failed, 10)
    stages.clients[0].release(ROOM)
    stages.assert_clean()
