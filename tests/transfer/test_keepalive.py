"""Kernel keepalive on a transfer engine's listening sockets (:mod:`transfer.backends.keepalive`):
the timings, finding the sockets, the options reaching every accepted connection, and a
decode's Mooncake manager setting them on its own engine's sockets only. What it buys (a write
stalled by a partition never lands in released pages) is shown across real hosts in
``tests/netns/test_mooncake_hosts.py``."""

from __future__ import annotations

import socket

import pytest

from transfer.backends.keepalive import TcpKeepalive, drop_silent_peers, listening_tcp_fds
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
