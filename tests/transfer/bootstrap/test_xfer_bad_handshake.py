"""Handshakes that must fail cleanly: registrations without the internal shared secret, of the
wrong dtype, and prefill endpoints that answer a registration with garbage, a truncated or
oversized frame, the wrong version or the wrong message.

Each case ends with a clear error, nothing held on either side (rooms, pages, aux slots), and the
endpoint still serving a well-behaved decode (the decoder fuzz and bad first frames on a prefill
endpoint are in ``test_xfer_fuzz.py``).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest

from tests.transfer.xfer_peer import FreeList, Node, Spec
from transfer.aux import AuxRow
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import BootstrapConfig
from transfer.bootstrap.messages import MAX_MESSAGE_BYTES, VERSION, Status, encode
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.bootstrap.wire import recv_message
from transfer.errors import IncompatiblePeerError, TransferError
from transfer.status import KVPoll

SECRET = "s3cret-bootstrap-token"
CFG = BootstrapConfig(bootstrap_timeout_s=1.5, waiting_timeout_s=1.0, heartbeat_interval_s=0.2,
                      heartbeat_misses=5, quarantine_s=1.0, connect_timeout_s=3.0, tick_s=0.02)
# (connect_timeout_s: a refusal's reply must arrive in time on a loaded 2-core machine; and a good
# room's destination must arrive within bootstrap_timeout_s: 0.5 s failed one fresh-clone CI run)
SECURED = dataclasses.replace(CFG, secret=SECRET)
HEADER = struct.Struct(">I")
ROW = AuxRow(room=0, first_token=3, logprob=-0.25, mrope_delta=0,
             hidden=tuple(float(i) for i in range(8)))
ROOM = 0x7A11_0000_0000_0001


def wait_for(pred: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.01)


@dataclasses.dataclass
class Side:
    """A decode node's buffers and page list, to connect clients from."""

    node: Node
    pages: FreeList

    def connect(self, address: tuple[str, int], cfg: BootstrapConfig) -> DecodeBootstrapClient:
        return DecodeBootstrapClient(self.node.manager, self.node.spec.identity, address,
                                     self.pages.give, config=cfg)

    def assert_clean(self) -> None:
        assert self.pages.held == 0
        assert self.node.aux.num_free == self.node.aux.num_rows


@pytest.fixture(scope="module")
def prefill() -> Iterator[PrefillBootstrapServer]:
    """A prefill endpoint that requires the secret."""
    node = Node(Spec(), fill_seed=2)
    server = PrefillBootstrapServer(node.manager, Spec().identity, config=SECURED)
    server.node = node  # type: ignore[attr-defined]  # keep the registered buffers alive
    yield server
    server.close()


@pytest.fixture(scope="module")
def decode() -> Side:
    return Side(Node(Spec()), FreeList(Spec().num_pages))


def good_room(server: PrefillBootstrapServer, side: Side) -> None:
    """One room over a client that has the secret: delivered, committed, nothing left."""
    client = side.connect(server.address, SECURED)
    try:
        server.add_room(ROOM)
        client.add_room(ROOM)
        dst = side.pages.take(2)
        client.send_destination(ROOM, dst)
        wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 3)
        assert server.send_chunk(ROOM, [4, 5], last=ROW) is KVPoll.Success
        wait_for(lambda: client.poll(ROOM) is KVPoll.Success, 3)
        assert client.commit(ROOM).room == ROOM
        server.release(ROOM)
        side.pages.give(dst)
    finally:
        client.close()
    side.assert_clean()
    assert server.num_rooms == 0


@pytest.mark.parametrize("token", [None, "", "not-the-secret", SECRET + "x", SECRET[:-1]])
def test_registration_without_the_secret_is_refused(
    prefill: PrefillBootstrapServer, decode: Side, token: str | None
) -> None:
    """The room the router opened on the prefill fails on its bootstrap timeout; the decode
    never took pages or an aux slot; a decode with the secret is served right after."""
    prefill.add_room(ROOM)
    try:
        with pytest.raises(IncompatiblePeerError, match="missing or wrong internal token") as err:
            decode.connect(prefill.address, dataclasses.replace(CFG, secret=token))
        assert SECRET not in str(err.value) and (not token or token not in str(err.value))
        decode.assert_clean()
        wait_for(lambda: prefill.poll(ROOM) is KVPoll.Failed, 3)
        assert "bootstrap timeout" in prefill.failure_reason(ROOM)
    finally:
        prefill.release(ROOM)  # a failure here must not leave the module's room claimed
    good_room(prefill, decode)


def test_the_secret_never_reaches_a_repr(decode: Side) -> None:
    reg = decode.node.manager.registration(page_size=4, dtype="torch.float32",
                                           model_fingerprint="m", auth_token=SECRET)
    assert SECRET not in repr(reg) and SECRET not in repr(SECURED)


def test_a_prefill_without_a_secret_accepts_any_token(decode: Side) -> None:
    node = Node(Spec(), fill_seed=3)
    server = PrefillBootstrapServer(node.manager, Spec().identity, config=CFG)
    try:
        good_room(server, decode)  # the client sends SECRET; nobody checks it
    finally:
        server.close()


def test_wrong_dtype_is_refused(prefill: PrefillBootstrapServer, decode: Side) -> None:
    reg = dataclasses.replace(decode.node.manager.registration(
        page_size=4, dtype="torch.bfloat16", model_fingerprint="model-a"), auth_token=SECRET)
    body = encode(reg)
    with socket.create_connection(prefill.address, timeout=5) as sock:
        sock.sendall(HEADER.pack(len(body)) + body)
        reply = recv_message(sock)
    assert type(reply).__name__ == "RegisterReply" and not reply.ok  # type: ignore[union-attr]
    assert "dtype differs" in reply.reason  # type: ignore[union-attr]
    good_room(prefill, decode)


# ---- a prefill endpoint that answers the registration badly --------------------------------


def _frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


REPLIES: dict[str, bytes] = {
    "garbage": _frame(b"\xc1\xc1 not msgpack"),
    "truncated": HEADER.pack(64) + b"\x93\x01",  # then silence: the body never comes
    "oversized": HEADER.pack(MAX_MESSAGE_BYTES + 1),
    "wrong version": _frame(msgpack.packb([VERSION + 1, "RegisterReply",
                                           {"ok": True, "reason": ""}])),
    "wrong message": _frame(encode(Status(1, int(KVPoll.Success), "", True))),
    "closed": b"",
}


class BadPrefill:
    """Accepts one connection, reads the registration, sends ``reply``, then stays silent
    (holding the connection open) until closed."""

    def __init__(self, reply: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.done = threading.Event()
        self.registration: object = None
        self._thread = threading.Thread(target=self._run, args=(reply,), daemon=True)
        self._thread.start()

    def _run(self, reply: bytes) -> None:
        conn, _ = self.listener.accept()
        with conn:
            self.registration = recv_message(conn)
            if reply:
                conn.sendall(reply)
                self.done.wait(10)

    def close(self) -> None:
        self.done.set()
        self._thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_bad_registration_reply_is_a_clear_error(decode: Side, kind: str) -> None:
    bad = BadPrefill(REPLIES[kind])
    try:
        start = time.monotonic()
        with pytest.raises(TransferError) as err:
            decode.connect(bad.address, SECURED)
        assert time.monotonic() - start < CFG.connect_timeout_s + 2.0  # never hangs
        assert str(err.value)
        assert getattr(bad.registration, "auth_token", None) == SECRET
    finally:
        bad.close()
    decode.assert_clean()
