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

The sending side (the prefill) gets the same keepalive on the connections its engine opens
(:class:`ConnectionKeepalive`, swept after each write): an idle transfer connection whose peer
went away is dropped too, instead of lingering half-open for good.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Iterator
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


def _socket_links() -> Iterator[tuple[int, str]]:
    """This process's sockets: (fd, its ``socket:[inode]`` link)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            yield int(name), link


def _tcp_socket(fd: int) -> socket.socket | None:
    """Socket ``fd`` wrapped without a dup when it is a TCP one (the caller must ``detach()``
    it: the socket is its owner's), else None."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile, or not a socket Python can wrap
        return None
    if sock.family in _TCP_FAMILIES and sock.type == socket.SOCK_STREAM:
        return sock
    sock.detach()
    return None


def _tcp_sockets() -> Iterator[tuple[int, str, socket.socket]]:
    """This process's TCP sockets: (fd, link, the socket wrapped as :func:`_tcp_socket`)."""
    for fd, link in _socket_links():
        sock = _tcp_socket(fd)
        if sock is not None:
            yield fd, link, sock


def listening_tcp_fds() -> set[int]:
    """The file descriptors of this process's listening TCP sockets."""
    found = set()
    for fd, _, sock in _tcp_sockets():
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.add(fd)
        except OSError:
            pass
        finally:
            sock.detach()
    return found


def set_keepalive(sock: socket.socket, keepalive: TcpKeepalive) -> None:
    """Set ``keepalive`` on one socket (a listening one passes it to what it accepts)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, keepalive.idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, keepalive.interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, keepalive.bound_s * 1000)


def drop_silent_peers(fds: set[int], keepalive: TcpKeepalive) -> None:
    """Set ``keepalive`` on the listening sockets ``fds``: every connection they accept from
    now on is dropped by the kernel once its peer was silent for ``keepalive.bound_s``."""
    for fd in sorted(fds):
        sock = socket.socket(fileno=fd)
        try:
            set_keepalive(sock, keepalive)
        finally:
            sock.detach()


class ConnectionKeepalive:
    """Keepalive for the connections a transfer engine opens from this process (Mooncake's
    outgoing ones: it sets none and offers no hook), found by :meth:`sweep` among the process's
    connected TCP sockets: each one seen for the first time that has neither ``SO_KEEPALIVE``
    nor ``TCP_USER_TIMEOUT`` set gets ``keepalive``. Sockets whose owner set either (gRPC sets
    the user timeout of its own keepalive; accepted sockets inherit a listener's) are left as
    they are. So after a partition no idle half-open transfer connection lingers: the kernel
    drops it once its peer was silent for ``keepalive.bound_s``."""

    def __init__(self, keepalive: TcpKeepalive) -> None:
        self.keepalive = keepalive
        self._seen: set[str] = set()  # socket links already looked at
        self._lock = threading.Lock()

    def sweep(self) -> int:
        """Look at every TCP socket not seen before; returns how many got ``keepalive``."""
        set_now = 0
        with self._lock:
            live = set()
            for fd, link in _socket_links():
                live.add(link)
                if link in self._seen:  # only a new socket is wrapped and asked
                    continue
                sock = _tcp_socket(fd)
                if sock is None:
                    self._seen.add(link)
                    continue
                try:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        self._seen.add(link)
                        continue
                    sock.getpeername()  # connected (raises otherwise: look again next time)
                    self._seen.add(link)
                    if not (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                            or sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)):
                        set_keepalive(sock, self.keepalive)
                        set_now += 1
                except OSError:
                    pass
                finally:
                    sock.detach()
            self._seen &= live  # a closed socket's link may come back for a new one
        return set_now
