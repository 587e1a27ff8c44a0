"""Shared fixtures of the transfer tests: a decode node in a second process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.transfer.xfer_peer import Peer, Spec


@pytest.fixture(scope="module")
def decode_peer() -> Iterator[Peer]:
    """A decode node (layers 0..3 plus draft band 4) in its own process, over loopback TCP."""
    peer = Peer("node", Spec(layer_ids=(0, 1, 2, 3), draft_ids=(4,)))
    yield peer
    peer.stop()
