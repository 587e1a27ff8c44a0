"""Built-in fault injection on a real handshake (a prefill server and a decode client over
loopback, real Mooncake TCP engines): an injected transfer failure ends the room Failed on both
sides like an engine error, dropped handshake messages and a status that never comes end by the
timeouts, a delayed status and a slow peer still deliver the right bytes; nothing is left held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from tests.transfer.bootstrap.test_xfer_handshake import ROOM, ROW, Pair, wait_for
from transfer.bootstrap.handshake import BootstrapConfig
from transfer.faults import INJECTED_ERROR_CODE, FaultConfig, FaultInjector, make_injector
from transfer.status import KVPoll

# short room timeouts; the peer timeout (10 s) is far above them, so a heartbeat starved on a
# busy 2-core machine cannot end a room first ("lost the prefill connection" in place of the
# timeout under test)
CFG = BootstrapConfig(bootstrap_timeout_s=2.0, waiting_timeout_s=2.5, heartbeat_interval_s=0.5,
                      heartbeat_misses=20, quarantine_s=1.0, tick_s=0.02)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(CFG)
    yield p
    p.close()


def _inject(pair: Pair, side: str, **faults: float) -> FaultInjector:
    node = pair.p_node if side == "prefill" else pair.d_node
    injector = FaultInjector(FaultConfig(seed=0, **faults))
    node.manager.faults = injector
    return injector


def _start(pair: Pair, n_pages: int = 4) -> list[int]:
    pair.server.add_room(ROOM)
    pair.client.add_room(ROOM)
    dst = pair.pages.take(n_pages)
    pair.client.send_destination(ROOM, dst)
    return dst


def _end_failed(pair: Pair, within_s: float) -> None:
    """Both sides see Failed within ``within_s``; release both; nothing stays held."""
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.Failed, within_s)
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, within_s)
    pair.server.release(ROOM)
    pair.client.release(ROOM)
    pair.assert_clean()


def test_config_from_env_and_off_by_default() -> None:
    assert not FaultConfig().enabled and make_injector(FaultConfig()) is None
    cfg = FaultConfig.from_env({"PDSERVE_FAULT_TRANSFER_FAIL_P": "0.25",
                                "PDSERVE_FAULT_STATUS_DELAY_S": "1.5", "PDSERVE_FAULT_SEED": "7"})
    assert cfg == FaultConfig(transfer_fail_p=0.25, status_delay_s=1.5, seed=7) and cfg.enabled
    with pytest.raises(ValueError, match="within 0..1"):
        FaultConfig(drop_handshake_p=2.0)
    with pytest.raises(ValueError, match="PDSERVE_FAULT_SLOW_PEER_S"):
        FaultConfig.from_env({"PDSERVE_FAULT_SLOW_PEER_S": "slow"})


def test_injected_transfer_failure_fails_the_room_on_both_sides(pair: Pair) -> None:
    injector = _inject(pair, "prefill", transfer_fail_p=1.0)
    _start(pair)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert pair.server.send_chunk(ROOM, [0, 1, 2, 3], last=ROW) is KVPoll.Failed
    assert f"code {INJECTED_ERROR_CODE}" in pair.server.failure_reason(ROOM)
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, 2)
    assert f"code {INJECTED_ERROR_CODE}" in pair.client.failure_reason(ROOM)
    assert injector.injected == 2  # the pages' write and the aux row's, written beside them
    # an engine error is not quiesced: the decode holds the pages for the quarantine
    t0 = time.monotonic()
    _end_failed(pair, 2)
    assert time.monotonic() - t0 >= CFG.quarantine_s * 0.9


def test_destination_dropped_ends_by_timeouts(pair: Pair) -> None:
    injector = _inject(pair, "decode", drop_handshake_p=1.0)
    t0 = time.monotonic()  # before the room exists: its bootstrap timeout runs from later
    _start(pair)
    time.sleep(0.2)
    state = pair.server.poll(ROOM)
    if time.monotonic() - t0 < CFG.bootstrap_timeout_s:  # a loaded machine may poll later
        assert state is KVPoll.Bootstrapping  # the gate never opens
    # prefill: bootstrap timeout; decode: waiting timeout, its Abort dropped too: quarantine
    _end_failed(pair, CFG.waiting_timeout_s + 1)
    # the destination and the abort, which the sweep thread sends just after it marks the room
    # Failed (outside its lock): wait for it rather than race it
    wait_for(lambda: injector.injected >= 2, 2)


def test_status_that_never_comes_ends_by_timeout(pair: Pair) -> None:
    injector = _inject(pair, "prefill", drop_handshake_p=1.0)
    _start(pair)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    assert pair.server.send_chunk(ROOM, [0, 1, 2, 3], last=ROW) is KVPoll.Success
    # the waiting timeout runs from the destination (before t0); the slack is for a busy
    # 2-core machine, where a polling thread can be starved for over a second
    t0 = time.monotonic()
    wait_for(lambda: pair.client.poll(ROOM) is KVPoll.Failed, CFG.waiting_timeout_s + 2)
    assert time.monotonic() - t0 < CFG.waiting_timeout_s + 2
    assert "waiting timeout" in pair.client.failure_reason(ROOM)
    pair.server.release(ROOM)
    pair.client.release(ROOM)  # its AbortAck is dropped as well: freed after the quarantine
    pair.assert_clean()
    assert injector.injected >= 2


@pytest.fixture
def patient_pair() -> Iterator[Pair]:
    """A pair whose timeouts cannot fire during a slowed transfer (whose first engine write
    also opens the engine session: a second or more on a busy machine)."""
    p = Pair(replace(CFG, bootstrap_timeout_s=30.0, waiting_timeout_s=30.0))
    yield p
    p.close()


def test_delayed_status_and_slow_peer_still_deliver(patient_pair: Pair) -> None:
    pair = patient_pair
    delay = 1.0  # long enough that a loaded machine still polls while the status is held
    injector = _inject(pair, "prefill", status_delay_s=delay, slow_peer_s=0.1)
    dst = _start(pair)
    wait_for(lambda: pair.server.poll(ROOM) is KVPoll.WaitingForInput, 2)
    t0 = time.monotonic()
    assert pair.server.send_chunk(ROOM, [5, 6, 7, 8], last=ROW) is KVPoll.Success
    sent = time.monotonic()  # the Status was queued before send_chunk returned
    assert sent - t0 >= 0.1  # slowed writes: the pages and, beside them, the aux row
    time.sleep(0.1)
    held = pair.client.poll(ROOM)
    if time.monotonic() - sent < delay:  # only a poll inside the delay can see it held
        assert held is KVPoll.WaitingForInput  # the status is still held
    wait_for(lambda: pair.client.poll(ROOM) is not KVPoll.WaitingForInput, 10)
    assert pair.client.poll(ROOM) is KVPoll.Success, pair.client.failure_reason(ROOM)
    assert pair.client.commit(ROOM) == replace(ROW, room=ROOM)
    for src_e, dst_e in zip(pair.p_node.entries(), pair.d_node.entries(), strict=True):
        assert torch.equal(dst_e[dst], src_e[[5, 6, 7, 8]])
    assert injector.injected == 1  # one delayed status; slowness is not a failure
    pair.server.release(ROOM)
    pair.pages.give(dst)
    pair.assert_clean()
