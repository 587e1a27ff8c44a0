"""The P/D handshake: success path, refusals, timeouts, aborts and dead peers, with leak checks.

Every scenario ends with the room Failed (or committed) on both sides within the configured
timeouts and with zero pages, aux slots and rooms held afterwards.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from tests.transfer.xfer_peer import FreeList, Node, Peer, Spec
from transfer.aux import AuxRow
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import BootstrapConfig
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import IncompatiblePeerError, PageListError
from transfer.status import KVPoll

CFG = BootstrapConfig(bootstrap_timeout_s=1.0, waiting_timeout_s=1.5, heartbeat_interval_s=0.2,
                      heartbeat_misses=3, quarantine_s=1.0, tick_s=0.02)
ROOM = 0x5EED_0000_0000_0001
ROW = AuxRow(room=0, first_token=99, logprob=-0.75, mrope_delta=-4,
             hidden=tuple(float(i) / 2 for i in range(8)))


def wait_for(pred: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.01)


class Pair:
    """A prefill bootstrap server and a decode client in this process, over loopback."""

    def __init__(self, cfg: BootstrapConfig = CFG, decode_spec: Spec | None = None) -> None:
        spec = Spec()
        self.p_node = Node(spec, fill_seed=31)
        self.server = PrefillBootstrapServer(self.p_node.manager, spec.identity, config=cfg)
        self.d_node = Node(decode_spec or spec)
        self.pages = FreeList(spec.num_pages)
        self.client = DecodeBootstrapClient(
            self.d_node.manager, (decode_spec or spec).identity, self.server.address,
            self.pages.give, config=cfg,
        )

    def assert_clean(self) -> None:
        wait_for(lambda: self.pages.held == 0, 5)
        assert self.client.num_rooms == 0 and self.server.num_rooms == 0
        assert self.d_node.aux.num_free == self.d_node.aux.num_rows
        assert self.p_node.aux.num_free == self.p_node.aux.num_rows

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _start_room(pair: Pair, n_pages: int = 6) -> list[int]:
    pair.server.add_room(ROOM)
    pair.client.add_room(ROOM)
    assert pair.server.poll(ROOM) is KVPoll.Bootstrapping  # the gate is closed
    dst = pair.pages.take(n_pages)
    pair.client.send_destination(ROOM, dst)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    return dst


def test_room_succeeds_and_leaves_nothing(pair: Pair) -> None:
    dst = _start_room(pair)
    assert pair.server.send_chunk(ROOM, [0, 1, 2]) is KVPoll.Transferring
    assert pair.server.send_chunk(ROOM, [10, 11, 12], last=ROW) is KVPoll.Success
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Success, 2)
    row = pair.client.commit(ROOM)
    assert row == replace(ROW, room=ROOM)  # the room id is echoed back
    for src_e, dst_e in zip(pair.p_node.entries(), pair.d_node.entries(), strict=True):
        assert torch.equal(dst_e[dst], src_e[[0, 1, 2, 10, 11, 12]])
    pair.server.release(ROOM)
    pair.pages.give(dst)  # the committed request finished
    pair.assert_clean()


def test_delta_transfer_skips_the_pages_the_decode_holds(pair: Pair) -> None:
    """The decode holds the prompt's first 3 pages (its prefix cache): the prefill passes every
    page in prompt order and only the rest travel, into the 3 destination pages."""
    pair.server.add_room(ROOM)
    pair.client.add_room(ROOM)
    dst = pair.pages.take(3)
    pair.client.send_destination(ROOM, dst, cached_pages=3)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert pair.server.send_chunk(ROOM, [0, 1]) is KVPoll.WaitingForInput  # nothing to send
    assert pair.server.send_chunk(ROOM, [2, 10, 11]) is KVPoll.Transferring
    row = replace(ROW, cached_tokens=40)  # the prefill's own cache hit rides in the aux row
    assert pair.server.send_chunk(ROOM, [12], last=row) is KVPoll.Success
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Success, 2)
    assert pair.client.commit(ROOM) == replace(row, room=ROOM)
    for src_e, dst_e in zip(pair.p_node.entries(), pair.d_node.entries(), strict=True):
        assert torch.equal(dst_e[dst], src_e[[10, 11, 12]])
    assert pair.server.pages_not_sent == 3
    per_page = sum(e[0].numel() * e.element_size() for e in pair.p_node.entries())
    assert pair.server.bytes_not_sent == 3 * per_page
    pair.server.release(ROOM)
    pair.pages.give(dst)
    pair.assert_clean()


def test_negative_cached_pages_fail_the_room(pair: Pair) -> None:
    pair.server.add_room(ROOM)
    pair.client.add_room(ROOM)
    pair.client.send_destination(ROOM, pair.pages.take(2), cached_pages=-1)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.Failed, 2)
    assert "cached pages -1" in pair.server.failure_reason(ROOM)
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, 2)
    pair.client.release(ROOM)
    pair.server.release(ROOM)
    pair.assert_clean()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"fingerprint": "model-b"}, "model fingerprint"),
        ({"page_size": 8, "num_pages": 32}, "page size"),
        ({"layer_ids": (0, 1, 2)}, "layer 3"),
        ({"heads": 1}, "bytes per page"),
    ],
)
def test_mismatched_pair_is_refused(change: dict[str, object], match: str) -> None:
    with pytest.raises(IncompatiblePeerError, match=match):
        Pair(decode_spec=replace(Spec(), **change))  # type: ignore[arg-type]


def test_destination_never_arrives(pair: Pair) -> None:
    pair.server.add_room(ROOM)
    pair.client.add_room(ROOM)  # the decode never reserves pages for it
    t0 = time.monotonic()
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.Failed, 3)
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, 3)
    assert time.monotonic() - t0 < CFG.bootstrap_timeout_s + 1
    assert "bootstrap timeout" in pair.server.failure_reason(ROOM)
    pair.client.release(ROOM)
    pair.server.release(ROOM)
    pair.assert_clean()


def test_decode_abort_waits_for_ack(pair: Pair) -> None:
    slow = BootstrapConfig(**{**CFG.__dict__, "quarantine_s": 60.0})
    pair.client.config = slow  # only an AbortAck can free the pages now
    _start_room(pair)
    pair.server.send_chunk(ROOM, [0, 1, 2])
    pair.client.abort(ROOM)
    assert pair.client.poll(ROOM) is KVPoll.Failed
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.Failed, 2)
    assert pair.server.send_chunk(ROOM, [3, 4, 5], last=ROW) is KVPoll.Failed
    pair.client.release(ROOM)
    pair.server.release(ROOM)
    pair.assert_clean()


def test_prefill_abort(pair: Pair) -> None:
    _start_room(pair)
    pair.server.send_chunk(ROOM, [0, 1])
    pair.server.abort(ROOM)
    assert pair.server.poll(ROOM) is KVPoll.Failed
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, 2)
    assert "aborted by prefill" in pair.client.failure_reason(ROOM)
    pair.client.release(ROOM)
    pair.server.release(ROOM)
    pair.assert_clean()


def test_waiting_timeout(pair: Pair) -> None:
    _start_room(pair)  # the prefill never sends
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, CFG.waiting_timeout_s + 1)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.Failed, 2)
    pair.client.release(ROOM)
    pair.server.release(ROOM)
    pair.assert_clean()


def test_destination_out_of_range_is_refused(pair: Pair) -> None:
    pair.client.add_room(ROOM)
    with pytest.raises(PageListError):
        pair.client.send_destination(ROOM, [1, 2, 10_000])
    pair.client.abort(ROOM)
    pair.client.release(ROOM)
    pair.assert_clean()


@pytest.mark.slow
def test_decode_dies_mid_transfer() -> None:
    spec = replace(Spec(), extra={"config": CFG})
    p_node = Node(spec, fill_seed=41)
    server = PrefillBootstrapServer(p_node.manager, spec.identity, config=CFG)
    decode = Peer("decode", spec, server.address)
    try:
        server.add_room(ROOM)
        decode.call("add_room", ROOM)
        decode.call("send_destination", ROOM, decode.call("pages.take", 6))
        wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 5)
        assert server.send_chunk(ROOM, [0, 1, 2]) is KVPoll.Transferring
        decode.kill()
        t0 = time.monotonic()
        wait_for(lambda: server.poll(ROOM) is KVPoll.Failed, CFG.peer_timeout_s + 1)
        assert time.monotonic() - t0 < CFG.peer_timeout_s + 1
        assert server.send_chunk(ROOM, [3, 4, 5], last=ROW) is KVPoll.Failed
        server.release(ROOM)
        assert server.num_rooms == 0 and p_node.aux.num_free == p_node.aux.num_rows
    finally:
        decode.stop()
        server.close()


@pytest.mark.slow
def test_prefill_dies_mid_transfer() -> None:
    spec = replace(Spec(), extra={"config": CFG})
    prefill = Peer("prefill", spec)
    d_node = Node(spec)
    pages = FreeList(spec.num_pages)
    client = DecodeBootstrapClient(d_node.manager, spec.identity, tuple(prefill.ready),
                                   pages.give, config=CFG)
    try:
        prefill.call("add_room", ROOM)
        client.add_room(ROOM)
        client.send_destination(ROOM, pages.take(6))
        wait_for(lambda: prefill.call("poll", ROOM) == KVPoll.WaitingForInput, 5)
        assert prefill.call("send_chunk", ROOM, [0, 1, 2]) == KVPoll.Transferring
        prefill.kill()
        t0 = time.monotonic()
        wait_for(lambda: client.poll(ROOM) is KVPoll.Failed, CFG.peer_timeout_s + 1)
        assert time.monotonic() - t0 < CFG.peer_timeout_s + 1
        client.release(ROOM)
        assert pages.held == 6  # quarantined: a dead prefill never acknowledged
        wait_for(lambda: pages.held == 0, CFG.quarantine_s + 1)
        assert client.num_rooms == 0 and d_node.aux.num_free == d_node.aux.num_rows
    finally:
        client.close()
        prefill.stop()


@pytest.mark.slow
def test_silent_prefill_is_caught_by_the_heartbeat() -> None:
    """A frozen prefill keeps its socket open; only missed heartbeats reveal it."""
    spec = replace(Spec(), extra={"config": CFG})
    prefill = Peer("prefill", spec)
    d_node = Node(spec)
    pages = FreeList(spec.num_pages)
    client = DecodeBootstrapClient(d_node.manager, spec.identity, tuple(prefill.ready),
                                   pages.give, config=CFG)
    try:
        prefill.call("add_room", ROOM)
        client.add_room(ROOM)
        client.send_destination(ROOM, pages.take(4))
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: client.poll(ROOM) is KVPoll.Failed, CFG.peer_timeout_s + 1)
        assert time.monotonic() - t0 < CFG.peer_timeout_s + 1
        assert "heartbeat" in client.failure_reason(ROOM)
        client.release(ROOM)
        wait_for(lambda: pages.held == 0, CFG.quarantine_s + 1)
        assert client.num_rooms == 0 and d_node.aux.num_free == d_node.aux.num_rows
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
        client.close()
        prefill.stop()


@pytest.mark.slow
def test_silent_decode_is_caught_by_the_heartbeat_deadline() -> None:
    spec = replace(Spec(), extra={"config": CFG})
    p_node = Node(spec, fill_seed=43)
    server = PrefillBootstrapServer(p_node.manager, spec.identity, config=CFG)
    decode = Peer("decode", spec, server.address)
    try:
        server.add_room(ROOM)
        decode.call("add_room", ROOM)
        decode.call("send_destination", ROOM, decode.call("pages.take", 4))
        wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 5)
        os.kill(decode.proc.pid, signal.SIGSTOP)
        wait_for(lambda: server.poll(ROOM) is KVPoll.Failed, CFG.peer_timeout_s + 1)
        assert "heartbeat" in server.failure_reason(ROOM)
        server.release(ROOM)
        assert server.num_rooms == 0
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
        decode.stop()
        server.close()
