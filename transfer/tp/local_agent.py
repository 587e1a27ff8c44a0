"""Rank 0 of a tensor-parallel node and an agent in another rank's process, talking over the
node's loopback: a ``multiprocessing.connection`` with a shared key (a peer without it is
refused before a message is read) carrying :mod:`transfer.bootstrap.messages`, one request and its
answer at a time. The prefill's send agents (:mod:`transfer.tp.rank_agent`) and the decode's
landing agents (:mod:`decode_node.rank_landing`) are built on it.

The agent thread serves the first peer that has the key and ends when that connection closes;
rank 0 holds one :class:`AgentLink` per agent, its calls serialised by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import suppress
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from transfer.bootstrap.messages import Message, decode, encode
from transfer.errors import MessageError, TransferError

HOST = "127.0.0.1"  # the ranks of one node share its loopback


class AgentServer:
    """In a rank's process: a thread answering rank 0's requests with ``answer`` (given the
    request's bytes, undecoded). :attr:`port` is where it listens."""

    def __init__(self, authkey: bytes, answer: Callable[[bytes], Message], name: str) -> None:
        self._answer = answer
        self._listener = Listener((HOST, 0), authkey=authkey)
        self.port: int = self._listener.address[1]
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except AuthenticationError:
                continue  # a peer without the key; rank 0 is still to come
            except OSError:
                return
            with suppress(OSError, EOFError), conn:
                while True:
                    conn.send_bytes(encode(self._answer(conn.recv_bytes())))
            return


class AgentLink:
    """On rank 0: the connection to one agent at ``port``; ``who`` names it in errors."""

    def __init__(self, port: int, authkey: bytes, who: str) -> None:
        self.who = who
        self._conn: Connection = Client((HOST, port), authkey=authkey)
        self._lock = threading.Lock()

    def call(self, request: Message, gone: type[TransferError] = TransferError) -> Message:
        """Send ``request`` and wait for the answer; ``gone`` (an error class) when the agent
        cannot be reached or answers nothing readable."""
        with self._lock:
            try:
                self._conn.send_bytes(encode(request))
                return decode(self._conn.recv_bytes())
            except (OSError, EOFError, MessageError) as exc:
                raise gone(f"{self.who} did not answer: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._conn.close()
