"""Kernel keepalive on a transfer engine's sockets (:mod:`transfer.backends.keepalive`): the
timings, finding the sockets, the options reaching every accepted connection, a decode's
Mooncake manager setting them on its own engine's listening sockets only, a prefill's on the
connections its writes opened; and a write that fails at once made again. What they buy (a
write stalled by a partition never lands in released pages; no half-open connection lingers;
no retry after a heal) is shown across real hosts in ``tests/netns``."""

from __future__ import annotations

import os
import socket
import time

import pytest

from transfer.backends import mooncake
from transfer.backends.keepalive import (
    ConnectionKeepalive,
    TcpKeepalive,
    drop_silent_peers,
    listening_tcp_fds,
)
from transfer.backends.mooncake import MooncakeKVManager

OPTIONS = {"keepalive": (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
           "idle": (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
           "interval": (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
           "user_timeout_ms": (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def _options(fd: int) -> dict[str, int]:
    sock = socket.socket(fileno=fd)
    try:
        return {name: sock.getsockopt(*opt) for name, opt in OPTIONS.items()}
    finally:
        sock.detach()


@pytest.mark.parametrize(("seconds", "idle", "interval", "bound"), [
    (0.2, 1, 1, 2), (1.5, 1, 1, 2), (10, 5, 2, 10), (10.5, 5, 3, 11)])
def test_timings_drop_a_silent_peer_within_the_bound(seconds: float, idle: int, interval: int,
                                                     bound: int) -> None:
    k = TcpKeepalive.within(seconds)
    assert (k.idle_s, k.interval_s, k.bound_s) == (idle, interval, bound)
    assert k.latest_s == bound + interval >= seconds
    with pytest.raises(ValueError, match="above 0"):
        TcpKeepalive.within(0)


def test_accepted_connections_inherit_the_options() -> None:
    before = listening_tcp_fds()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        mine = listening_tcp_fds() - before
        assert mine == {listener.fileno()}
        drop_silent_peers(mine, TcpKeepalive.within(4))
        with socket.create_connection(listener.getsockname()) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert _options(accepted.fileno()) == {
                    "keepalive": 1, "idle": 2, "interval": 1, "user_timeout_ms": 4000}
                assert client.fileno() not in listening_tcp_fds()
        assert listener.fileno() in listening_tcp_fds()  # the socket stays its owner's, open


def test_a_decode_manager_sets_them_on_its_engine_only() -> None:
    before = listening_tcp_fds()
    decode = MooncakeKVManager(hostname="127.0.0.1", silent_peer_s=1.5)
    engine_fds = listening_tcp_fds() - before
    assert engine_fds, "the engine listens on TCP"
    for fd in engine_fds:
        assert _options(fd) == {"keepalive": 1, "idle": 1, "interval": 1,
                                "user_timeout_ms": 2000}
    assert decode.late_write_s == 3.0
    before = listening_tcp_fds()
    prefill = MooncakeKVManager(hostname="127.0.0.1")
    assert prefill.late_write_s is None
    for fd in listening_tcp_fds() - before:
        assert _options(fd)["keepalive"] == 0
    for fd in engine_fds:  # the first engine's are untouched by the second
        assert _options(fd)["user_timeout_ms"] == 2000


def test_a_sweep_sets_keepalive_on_new_bare_connections_only() -> None:
    sweeper = ConnectionKeepalive(TcpKeepalive.within(3))
    sweeper.sweep()  # what this process had already
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as bare, \
            socket.create_connection(listener.getsockname()) as owned:
        owned.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 7000)  # as gRPC does
        accepted = [listener.accept()[0] for _ in range(2)]
        assert sweeper.sweep() == 4 - 1  # bare and both accepted ones; not owned, nor listener
        assert _options(bare.fileno()) == {"keepalive": 1, "idle": 1, "interval": 1,
                                           "user_timeout_ms": 3000}
        assert _options(owned.fileno())["keepalive"] == 0
        assert _options(listener.fileno())["keepalive"] == 0
        bare.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 0)
        assert sweeper.sweep() == 0  # a socket is looked at once
        for sock in accepted:
            sock.close()


def test_a_prefill_manager_keeps_its_transfer_connections_alive() -> None:
    """The connections the prefill's engine opens for a write have keepalive afterwards (the
    engine sets none)."""
    from engine.kv.pool import KVPool

    pools = [KVPool(8, 4, 2, 16, [0]) for _ in range(2)]
    decode = MooncakeKVManager(hostname="127.0.0.1", silent_peer_s=1.5)
    decode.register(pools[0].buffer_infos())
    prefill = MooncakeKVManager(hostname="127.0.0.1", silent_peer_s=4)
    prefill.register(pools[1].buffer_infos())
    prefill.send_kvcache(decode.session_id, [0, 1], decode.kv_ptrs, [2, 3],
                         dst_layer_ids=decode.kv_layer_ids,
                         dst_bytes_per_page=decode.kv_bytes_per_page)
    timeouts = set()
    for fd in (int(n) for n in os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family == socket.AF_INET \
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.getpeername()
                timeouts.add(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
        except OSError:
            pass
        finally:
            sock.detach()
    assert 4000 in timeouts  # the prefill's outgoing connections
    assert 0 not in timeouts  # none is left bare


class _Engine:
    """A transfer engine whose writes return ``codes`` in turn, each after ``delay_s``."""

    def __init__(self, codes: list[int], delay_s: float = 0.0) -> None:
        self.codes, self.delay_s, self.calls = codes, delay_s, 0

    def batch_transfer_sync_write(self, *args: object) -> int:
        self.calls += 1
        time.sleep(self.delay_s)
        return self.codes.pop(0)


@pytest.mark.parametrize(("codes", "delay_s", "result", "calls"), [
    ([0], 0.0, 0, 1),
    ([-1, 0], 0.0, 0, 2),  # a dropped connection: the write goes again over a new one
    ([-1, -1, -1, 0], 0.0, 0, 4),  # three pooled connections were stale
    ([-1] * 6, 0.0, -1, 5),  # failed STALE_TRIES times: the caller fails the room
    ([-1, 0], 0.3, -1, 1),  # failed slowly (stalled): not made again
])
def test_a_write_failing_at_once_is_made_again(monkeypatch: pytest.MonkeyPatch,
                                               codes: list[int], delay_s: float,
                                               result: int, calls: int) -> None:
    monkeypatch.setattr(mooncake, "STALE_WRITE_S", 0.2)
    assert mooncake.STALE_TRIES == 5
    engine = _Engine(codes, delay_s)
    manager = MooncakeKVManager(engine=engine)
    assert manager._write("peer:1", [1], [2], [3]) == result
    assert engine.calls == calls
