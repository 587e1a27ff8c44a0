"""Blocking calls from gRPC handlers that a client cancel must not cut in half."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def to_thread_atomic(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``asyncio.to_thread(fn, ...)`` that, when the caller is cancelled meanwhile, first waits
    for ``fn`` to return and then re-raises the cancel.

    A plain ``to_thread`` leaves ``fn`` running when the awaiting handler is cancelled, so the
    handler's cleanup (an abort of the room ``fn`` is registering) can run before ``fn``
    registers it, and the room is left behind. With this, the cleanup always sees it.
    """
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise
