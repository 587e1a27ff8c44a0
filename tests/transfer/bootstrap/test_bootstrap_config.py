"""``BootstrapConfig`` refuses timings that cannot work, naming the field (before, a worker
started with ``--heartbeat-interval-s 0``, ``--quarantine-s -5`` or ``--waiting-timeout-s nan``)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from transfer.bootstrap.handshake import BootstrapConfig


@pytest.mark.parametrize(("kw", "says"), [
    ({"bootstrap_timeout_s": 0.0}, "bootstrap_timeout_s must be above 0, got 0.0"),
    ({"waiting_timeout_s": math.nan}, "waiting_timeout_s must be above 0, got nan"),
    ({"heartbeat_interval_s": -1.0}, "heartbeat_interval_s must be above 0"),
    ({"connect_timeout_s": 0.0}, "connect_timeout_s must be above 0"),
    ({"tick_s": 0.0}, "tick_s must be above 0"),
    ({"quarantine_s": -5.0}, "quarantine_s must be at least 0, got -5.0"),
    ({"heartbeat_misses": 0}, "heartbeat_misses must be at least 1, got 0"),
])
def test_unworkable_timings_are_refused(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=f"^BootstrapConfig.{says}"):
        BootstrapConfig(**kw)


def test_no_quarantine_and_no_deadline_are_fine() -> None:
    config = BootstrapConfig(quarantine_s=0.0, bootstrap_timeout_s=math.inf)
    assert config.quarantine_s == 0.0 and config.bootstrap_timeout_s == math.inf
