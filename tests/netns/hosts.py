"""Test hosts in network namespaces, and transfer peers that run on them.

The hosts, their links and the delay line are :mod:`bench.netns_hosts`'s (the benchmark uses
them too, and no room may import ``tests``); this module adds what the tests need on top:

- :func:`netns_skip_reason`: why hosts cannot be made here (checked once per session, which
  also deletes the namespaces a crashed earlier run left behind);
- :class:`HostPeer`: one side of ``tests/transfer/xfer_peer.py`` (a node, a prefill bootstrap
  server or a decode bootstrap client, built by its ``serve``) in a process inside a host's
  namespace, its Mooncake engine and bootstrap endpoint on the host's address; calls go over a
  pipe, keyword arguments too, and a call may be started and its answer awaited later (a
  transfer in flight while the test cuts the link);
- :class:`HostPair`: a prefill peer on one host and a decode peer on another, with a room's
  whole transfer (:meth:`HostPair.transfer`) and the transfer layer's leak check
  (:meth:`HostPair.assert_clean`, the one of ``tests/transfer/bootstrap``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.netns_hosts import Host, cleanup_leftovers, unavailable
from tests.transfer import xfer_peer
from tests.transfer.bootstrap.test_xfer_handshake import ROW, wait_for
from tests.transfer.xfer_peer import Spec
from transfer.bootstrap.handshake import BootstrapConfig
from transfer.status import KVPoll


def netns_skip_reason() -> str:
    """Why the tests cannot build hosts here ("" when they can); where they can, deletes the
    namespaces of earlier runs that no longer run (a session's start calls it once)."""
    reason = unavailable()
    if not reason:
        cleanup_leftovers()
    return reason


def _serve(conn: Any, address: str, role: str, spec: Spec, arg: Any) -> None:
    """The peer process (inside the host's namespace): build ``role`` on ``address``, then
    answer ``(name, args, kwargs)`` calls until ``stop``."""
    xfer_peer.HOST = address  # every engine and endpoint xfer_peer builds binds the host's
    xfer_peer.serve(conn, role, spec, arg)


class HostPeer:
    """One xfer_peer role in a process inside ``host``'s namespace; ``ready`` is what the role
    publishes (a node's registration, a prefill's bootstrap address)."""

    def __init__(self, host: Host, role: str, spec: Spec, arg: Any = None) -> None:
        self.host = host
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = host.spawn(_serve, child, host.address, role, spec, arg)
        child.close()
        if not self.conn.poll(60):
            raise TimeoutError(f"{role} peer on {host.netns} did not start")
        self.ready = self.conn.recv()

    def start(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Send a call; :meth:`result` waits for its answer."""
        self.conn.send((name, args, kwargs))

    def answered(self, timeout: float) -> bool:
        """Whether the answer to the call :meth:`start` sent arrives within ``timeout``."""
        return bool(self.conn.poll(timeout))

    def result(self, timeout: float = 60.0) -> Any:
        """The answer of the call :meth:`start` sent (its error raised as RuntimeError)."""
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer from the peer on {self.host.netns} in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer call failed: {value}")
        return value

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``name`` (a dotted attribute path of the role's object) and return the answer;
        an attribute that is not callable is returned as it is."""
        self.start(name, *args, **kwargs)
        return self.result()

    def stop(self) -> None:
        """End the process (killed if it does not end at once)."""
        if self.proc.is_alive():
            self.conn.send(("stop", (), {}))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class HostPair:
    """A prefill (bootstrap server, its pool filled with random bytes) on ``p_host`` and a
    decode (bootstrap client registered with it) on ``d_host``."""

    def __init__(self, p_host: Host, d_host: Host, spec: Spec, config: BootstrapConfig) -> None:
        spec = dataclasses.replace(spec, extra={**spec.extra, "config": config})
        self.spec = spec
        self.prefill = HostPeer(p_host, "prefill", spec)
        try:
            self.decode = HostPeer(d_host, "decode", spec, self.prefill.ready)
        except BaseException:
            self.prefill.stop()
            raise

    def begin(self, room: int, n_pages: int) -> list[int]:
        """Open ``room`` on both sides with ``n_pages`` destination pages; returns them once
        the prefill's gate is open."""
        self.decode.call("add_room", room)
        dst: list[int] = self.decode.call("pages.take", n_pages)
        self.decode.call("send_destination", room, dst)
        self.prefill.call("add_room", room)
        wait_for(lambda: self.prefill.call("poll", room) is KVPoll.WaitingForInput, 10)
        return dst

    def finish(self, room: int, dst: Sequence[int], src: Sequence[int]) -> None:
        """The decode sees Success within 10 s and commits ``room``: the aux row and every
        destination page equal what the prefill sent; then both sides let the room go."""
        wait_for(lambda: self.decode.call("poll", room) is KVPoll.Success, 10)
        row = self.decode.call("commit", room)
        assert (row.first_token, row.room) == (ROW.first_token, room)
        self.assert_landed(src, dst)
        self.prefill.call("release", room)
        self.decode.call("pages.give", list(dst))

    def transfer(self, room: int, src: Sequence[int], chunks: int = 4) -> list[float]:
        """A room's whole transfer of the prefill's pages ``src`` in ``chunks`` chunks (the
        last with the aux row), checked byte for byte; returns each chunk's seconds."""
        dst = self.begin(room, len(src))
        size = -(-len(src) // chunks)
        seconds = []
        for k in range(0, len(src), size):
            last = ROW if k + size >= len(src) else None
            t0 = time.monotonic()
            status = self.prefill.call("send_chunk", room, list(src[k : k + size]), last=last)
            seconds.append(time.monotonic() - t0)
            assert status is (KVPoll.Success if last else KVPoll.Transferring), status
        self.finish(room, dst, src)
        return seconds

    def assert_landed(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """The decode's pages ``dst`` hold, byte for byte, the prefill's pages ``src``."""
        shape = (self.spec.num_pages, self.spec.page_size, self.spec.heads, self.spec.head_dim)
        sent = self.prefill.call("node.dump")
        got = self.decode.call("node.dump")
        for j, (s, g) in enumerate(zip(sent, got, strict=True)):
            s_t = torch.frombuffer(bytearray(s), dtype=torch.float32).view(shape)
            g_t = torch.frombuffer(bytearray(g), dtype=torch.float32).view(shape)
            assert torch.equal(g_t[list(dst)], s_t[list(src)]), f"entry {j} differs"

    def assert_clean(self, within_s: float = 10.0) -> None:
        """The leak check: no page, room or aux slot held on either side (pages may take up
        to ``within_s`` to come back: a failed room's quarantine)."""
        wait_for(lambda: self.decode.call("pages.held") == 0, within_s)
        assert self.decode.call("num_rooms") == 0 and self.prefill.call("num_rooms") == 0
        for peer in (self.prefill, self.decode):
            assert peer.call("node.aux.num_free") == peer.call("node.aux.num_rows")

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()
