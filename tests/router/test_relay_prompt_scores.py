"""The relay holds a request's first message until the prefill's response brings the prompt's
log-probabilities (``RoomRun.scores_due``), whatever order the decode's messages, the end of its
stream and that response arrive in; the client's first message carries them with the prompt's
ids, once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from router.errors import WorkerFailure
from router.relay import Outgoing, relay
from router.room import END

SCORES = wpb.PrefillResponse(room=1, prompt_tokens=3, prompt_logprobs=[-1.5, -0.25],
                             prompt_top_logprobs=[gpb.TopLogprobs(token_ids=[7], logprobs=[-1.0]),
                                                  gpb.TopLogprobs(token_ids=[8], logprobs=[-.2])])


class _Run:
    """What the relay uses of a RoomRun whose prompt a remote prefill scores."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.aborted = False
        self.scores_due = True
        self.decode = SimpleNamespace(address="d")


def _token(t: int, finished: bool = False) -> gpb.GenerateResponse:
    return gpb.GenerateResponse(token_ids=[t], finished=finished,
                                finish_reason="length" if finished else "")


async def _relay(arrivals: list[list[object]]) -> list[gpb.GenerateResponse]:
    """The client's messages when ``arrivals`` reach the queue batch by batch, the relay
    running in between."""
    run = _Run()
    out = Outgoing("r", [5, 6, 7], None, True, (), prompt_logprobs=True)
    got: list[gpb.GenerateResponse] = []

    async def read() -> None:
        async for msg in relay(cast(Any, run), out):
            got.append(msg)

    task = asyncio.create_task(read())
    scored = False
    for batch in arrivals:
        for item in batch:
            run.queue.put_nowait(item)
        scored = scored or any(item is SCORES for item in batch)
        await asyncio.sleep(0.01)
        assert scored or not got, "a message went out before the prompt's log-probabilities"
    await asyncio.wait_for(task, 5)
    return got


@pytest.mark.parametrize("arrivals", [
    [[_token(1)], [_token(2, True), END], [SCORES]],  # the whole stream first
    [[SCORES], [_token(1)], [_token(2, True), END]],  # the response first
    [[_token(1)], [SCORES, _token(2, True)], [END]],
    [[_token(1), _token(2, True), SCORES]],  # all in one batch, the response last
], ids=["stream first", "response first", "between", "one batch"])
def test_the_first_message_waits_for_the_prefills_scores(arrivals: list[list[object]]) -> None:
    msgs = asyncio.run(_relay(arrivals))
    assert [t for m in msgs for t in m.token_ids] == [1, 2] and msgs[-1].finished
    assert list(msgs[0].prompt_token_ids) == [5, 6, 7]
    assert list(msgs[0].prompt_logprobs) == [-1.5, -0.25]
    assert [list(t.token_ids) for t in msgs[0].prompt_top_logprobs] == [[7], [8]]
    assert not any(m.prompt_logprobs or m.prompt_token_ids for m in msgs[1:])


def test_a_stream_closed_early_still_fails_while_waiting() -> None:
    async def go() -> None:
        await _relay([[_token(1)], [END]])

    with pytest.raises(WorkerFailure) as caught:
        asyncio.run(go())
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.blame == "decode"
