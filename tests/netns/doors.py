"""Doors into a host: the test process reaches a TCP port inside a host's namespace through a
Unix socket on the machine's filesystem.

The machine's own namespace has no route to the hosts (on purpose: see
:mod:`bench.netns_hosts`), and a gRPC channel cannot be moved into a namespace (its sockets are
made by gRPC's own threads). A path-bound Unix socket belongs to no network namespace, so a door
is a small relay in a process inside the host: it accepts on ``PATH`` and relays each
connection, byte for byte both ways, to ``ADDRESS:PORT`` over the host's own TCP stack (the
host's address from inside the host: the traffic never crosses its link, so the test still
reaches a node whose link is cut). gRPC targets it as ``unix:PATH``.

A door's process imports this module first: it imports nothing beyond the standard library and
:mod:`bench.netns_hosts` (no torch, no gRPC), so a door opens in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
from multiprocessing.connection import Connection

from bench.netns_hosts import Host, HostError

CHUNK = 1 << 16


def open_door(host: Host, path: str, port: int, timeout_s: float = 30.0) -> str:
    """Start a door on ``host`` from the Unix socket ``path`` to its address's ``port``; returns
    the gRPC target (``unix:PATH``) once it accepts. It ends with the host
    (:meth:`bench.netns_hosts.Hosts.close`)."""
    conn, child = mp.get_context("spawn").Pipe()
    proc = host.spawn(_serve, child, path, host.address, port)
    child.close()
    try:
        if not conn.poll(timeout_s):
            raise EOFError
        conn.recv()
    except EOFError:
        proc.kill()
        raise HostError(f"the door {path} on {host.netns} did not open (its error is on "
                        "stderr)") from None
    finally:
        conn.close()
    return f"unix:{path}"


def _serve(ready: Connection, path: str, address: str, port: int) -> None:
    """The door's process (inside the host): accept on ``path`` forever, relaying each
    connection to ``(address, port)``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    ready.send("open")
    ready.close()
    while True:
        outer, _ = listener.accept()
        threading.Thread(target=_connect, args=(outer, address, port), daemon=True).start()


def _connect(outer: socket.socket, address: str, port: int) -> None:
    """Relay ``outer`` to a new TCP connection to ``(address, port)`` (closed at once when
    that cannot be made: the client sees the node as down)."""
    try:
        inner = socket.create_connection((address, port), timeout=5.0)
    except OSError:
        outer.close()
        return
    inner.settimeout(None)
    inner.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=_pump, args=(inner, outer), daemon=True).start()
    _pump(outer, inner)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either ends; then end both directions of both."""
    with contextlib.suppress(OSError):
        while data := src.recv(CHUNK):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    src.close()
