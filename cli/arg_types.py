"""argparse ``type=`` functions that refuse an out-of-range value with the range in the message
(``error: pdserve CMD: argument --FLAG: must be ...``, exit status 2), instead of letting it wrap
(a port of 70000 bound 4464), divide by zero or reach protobuf's bare "Value out of range"; and
a malformed host, before a server starts anything."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from serving.hosts import check_host

MAX_PORT = 65535
UINT32_MAX, UINT64_MAX = (1 << 32) - 1, (1 << 64) - 1  # wire fields' ranges


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (no upper bound when ``high`` is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            where = f"at least {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {where}, got {value}")
        return value
    return parse


port = int_in(0, MAX_PORT)  # 0 picks a free port
positive = int_in(1)
non_negative = int_in(0)


def positive_float(text: str) -> float:
    """A number above 0 (``inf`` included, ``nan`` not)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0 (``nan`` not)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A number in ``[low, high]`` (``nan`` and ``inf`` not)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value
    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def host(text: str) -> str:
    """A host name or an IP address (:func:`serving.hosts.check_host`)."""
    try:
        return check_host(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
