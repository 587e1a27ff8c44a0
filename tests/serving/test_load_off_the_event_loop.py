"""A worker's ``GetLoad`` reads its figures off the event loop: they wait for the engine's
lock, which a step holds throughout (50-200 ms on a CPU), and meanwhile the event loop must go on
delivering every stream's tokens. Both worker services, with a loop whose figures take 0.3 s."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from decode_node.service import DecodeService
from prefill_node.service import PrefillService

SLOW_S = 0.3


class _SlowLoop:
    """Figures that take as long as a step holding the lock."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(config=SimpleNamespace(page_size=16))
        self.scores_prompts = True

    def stats(self) -> dict[str, int]:
        time.sleep(SLOW_S)
        return {"running_requests": 1}


@pytest.mark.parametrize("service", [DecodeService, PrefillService])
def test_get_load_leaves_the_event_loop_free(service: Any) -> None:
    svc = service()
    svc._loop = _SlowLoop()  # what bind() sets; the rest of the service is not used here
    svc.bootstrap_address = "127.0.0.1:1"

    async def run() -> tuple[int, Any]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        report = await svc.GetLoad(None, None)
        ticker.cancel()
        return ticks, report

    ticks, report = asyncio.run(run())
    assert report.running_requests == 1
    assert ticks >= 10  # the loop ran on while the figures were read (0 when it blocked)
