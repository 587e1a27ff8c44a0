"""Relaying a room's decode stream to the client: batching, detokenizing, ending cleanly.

Everything the workers produced since the last write goes out as one client message, so a slow
client or a busy loop costs fewer, larger writes rather than a growing backlog. Detokenizing is
incremental (O(new tokens) per message), cheap enough for the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from engine.tokenizer import IncrementalDetokenizer
from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import WorkerFailure
from router.room import END, RoomRun


async def relay(
    run: RoomRun, request_id: str, detok: IncrementalDetokenizer | None, logprobs: bool
) -> AsyncIterator[gpb.GenerateResponse]:
    """Client messages for ``run`` until its last one (``finished=True``).

    Raises :class:`WorkerFailure` when a worker call fails or the decode stream closes early
    (unless the room was aborted: then a final ``finish_reason="abort"`` message is made here).
    """
    while True:
        items = [await run.queue.get()]
        while not run.queue.empty():
            items.append(run.queue.get_nowait())
        pending: list[gpb.GenerateResponse] = []
        for item in items:
            if isinstance(item, gpb.GenerateResponse):
                pending.append(item)
                if item.finished:
                    break
                continue
            if pending:
                yield merge(pending, request_id, detok, logprobs)
                pending = []
            if item is END and run.aborted:
                yield merge([_abort_message()], request_id, detok, logprobs)
                return
            if item is END:
                raise WorkerFailure(grpc.StatusCode.UNAVAILABLE,
                                    f"decode worker {run.decode.address} closed the stream early")
            assert isinstance(item, WorkerFailure)
            raise item
        if pending:
            msg = merge(pending, request_id, detok, logprobs)
            yield msg
            if msg.finished:
                return


def merge(msgs: list[gpb.GenerateResponse], request_id: str,
          detok: IncrementalDetokenizer | None, logprobs: bool) -> gpb.GenerateResponse:
    """One client message for consecutive worker messages (the last may be the final one)."""
    out = gpb.GenerateResponse(request_id=request_id)
    for m in msgs:
        out.token_ids.extend(m.token_ids)
        if logprobs:
            out.logprobs.extend(m.logprobs)
    last = msgs[-1]
    if detok is not None:
        text = detok.add(out.token_ids)
        out.text = text + detok.finish() if last.finished else text
    if last.finished:
        out.finished = True
        out.finish_reason = last.finish_reason
        out.usage.CopyFrom(last.usage)
    return out


def _abort_message() -> gpb.GenerateResponse:
    return gpb.GenerateResponse(finished=True, finish_reason="abort")
