"""Kernel keepalive on a transfer engine's listening sockets: how a receiving node bounds how
late a stalled write can still land in its memory.

A push-model transfer engine (Mooncake over TCP) writes into the receiver's registered memory
as bytes arrive on a connection it accepted. When the network partitions mid-write, the
sender's kernel keeps the unacknowledged bytes and retransmits them for as long as its
connection lives (Linux gives up after ``tcp_retries2``, about 15 minutes), and the receiver's
idle socket never times out: after the heal the bytes land, however late. Mooncake's TCP
transport sets no keepalive, so this module sets it on the sockets the engine listens on
(accepted connections inherit the options on Linux): a connection into this node that stays
silent for :attr:`TcpKeepalive.bound_s` is dropped by the kernel, and what the sender retransmits
after that is answered with a reset, never written. The decode's bootstrap holds a failed
room's pages at least that long (:mod:`transfer.bootstrap.decode`).
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


@dataclass(frozen=True)
class TcpKeepalive:
    """Keepalive timings (whole seconds, as the kernel takes them) that drop a silent peer:
    first probe after ``idle_s``, then every ``interval_s``; at the first probe time after the
    peer was silent for ``bound_s`` (``TCP_USER_TIMEOUT``) the connection is aborted, so by
    :attr:`latest_s` at the latest."""

    idle_s: int
    interval_s: int
    bound_s: int

    @property
    def latest_s(self) -> int:
        """The longest a silent connection lives: the bound and one more probe interval."""
        return self.bound_s + self.interval_s

    @classmethod
    def within(cls, seconds: float) -> TcpKeepalive:
        """The timings that drop a peer silent for ``seconds`` (rounded up to whole seconds,
        at least 2: the kernel's keepalive counts whole seconds)."""
        if not seconds > 0:
            raise ValueError(f"a keepalive bound must be above 0 s, got {seconds}")
        bound = max(2, math.ceil(seconds))
        idle = bound // 2
        return cls(idle, max(1, (bound - idle) // 2), bound)


def listening_tcp_fds() -> set[int]:
    """The file descriptors of this process's listening TCP sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile, or not a socket Python can wrap
            continue
        try:
            if (sock.family in _TCP_FAMILIES and sock.type == socket.SOCK_STREAM
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                found.add(fd)
        except OSError:
            pass
        finally:
            sock.detach()  # the socket is its owner's: never closed here
    return found


def drop_silent_peers(fds: set[int], keepalive: TcpKeepalive) -> None:
    """Set ``keepalive`` on the listening sockets ``fds``: every connection they accept from
    now on is dropped by the kernel once its peer was silent for ``keepalive.bound_s``."""
    for fd in sorted(fds):
        sock = socket.socket(fileno=fd)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, keepalive.idle_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, keepalive.interval_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                            keepalive.bound_s * 1000)
        finally:
            sock.detach()
