"""The ordered transfer status of a room, shared by the prefill and decode sides.

The order is the point: a room's status only moves forward (``max``), except that ``Failed``
always wins and is final. So several reporters (ranks, threads) can merge their views with
:func:`advance` in any order and agree on the result.
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    """Transfer status of a room, ordered ``Failed < Bootstrapping < ... < Success``."""

    Failed = 0
    Bootstrapping = 1  # the room exists but its destination has not arrived
    WaitingForInput = 2  # destination known; waiting for KV to send or receive
    Transferring = 3  # some chunks have been written
    Success = 4  # every page and the aux row are written, status delivered

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Failed, KVPoll.Success)


def advance(current: KVPoll, update: KVPoll) -> KVPoll:
    """``current`` after ``update``: forward only; Failed wins and sticks."""
    if current is KVPoll.Failed or update is KVPoll.Failed:
        return KVPoll.Failed
    if current is KVPoll.Success:
        return current
    return KVPoll(max(current, update))
