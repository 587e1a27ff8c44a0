"""Length-prefixed framing of :mod:`transfer.bootstrap.messages` on a stream socket.

A frame is a 4-byte big-endian length and that many bytes of one encoded message. A length over
the message size limit is refused before its body is read.

Both ends of a handshake connection are tuned by :func:`tune`: no Nagle delay, and kernel
keepalive with a user timeout at the handshake's peer timeout, so unacknowledged heartbeats to a
partitioned peer are not retransmitted for TCP's ~15 minutes. A peer found dead is dropped with
:meth:`FramedSocket.abort` (a reset: nothing lingers half-open or in ``FIN_WAIT``).
"""

from __future__ import annotations

import socket
import struct
import threading

from transfer.backends.keepalive import TcpKeepalive, set_keepalive
from transfer.bootstrap.messages import MAX_MESSAGE_BYTES, Message, decode, encode
from transfer.errors import MessageError

_HEADER = struct.Struct(">I")


def tune(sock: socket.socket, peer_timeout_s: float) -> None:
    """A handshake connection's options: ``TCP_NODELAY``, and keepalive and a user timeout
    that drop it once the peer was silent for ``peer_timeout_s`` (rounded up to whole
    seconds, at least 2: :class:`~transfer.backends.keepalive.TcpKeepalive`)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_keepalive(sock, TcpKeepalive.within(peer_timeout_s))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> Message:
    """Read one frame; raises ``ConnectionError`` on EOF and :class:`MessageError` on bad data."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > MAX_MESSAGE_BYTES:
        raise MessageError(f"frame of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    return decode(_recv_exact(sock, length))


class FramedSocket:
    """A connected socket whose sends are serialized by a lock (many threads may send)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self) -> Message:
        return recv_message(self.sock)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def abort(self) -> None:
        """Close with a reset (``SO_LINGER`` 0): for a peer found dead, to which a graceful
        close would only be retransmitted."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close()
