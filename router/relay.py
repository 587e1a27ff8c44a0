"""Relaying a room's decode stream to the client: batching, detokenizing, ending cleanly.

Everything the workers produced since the last write goes out as one client message, so a slow
client or a busy loop costs fewer, larger writes rather than a growing backlog. Detokenizing is
incremental (O(new tokens) per message), cheap enough for the event loop. Stop strings are
matched here, on the detokenized text (workers never see text), for every door.

A request whose workers fail may run again on other workers (:mod:`router.recovery`): one
:class:`Outgoing` lives across those attempts, so the detokenizer, the held-back text, the tokens
streamed so far and the usage carry over and the client sees one stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from engine.text.tokenizer import IncrementalDetokenizer
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import worker_pb2 as wpb
from router.errors import WorkerFailure
from router.room import END, RoomRun


async def relay(run: RoomRun, out: Outgoing) -> AsyncIterator[gpb.GenerateResponse]:
    """Client messages for ``run`` (one attempt of ``out``'s request) until its last one
    (``finished=True``).

    With ``stops`` (needs ``detok``) the text ends right before the first occurrence of any stop
    string: that message is the last, with ``finish_reason="stop"``, the tokens received so far
    and their usage, and the room is closed at once (its calls cancelled, ``AbortRoom`` sent to
    its workers), so nothing stays held for tokens nobody will read. Text that could be the start
    of a stop string is held back until it is known not to be.

    When the prompt's log-probabilities come from the prefill (``run.scores_due``), nothing goes
    out before its response has arrived: the first message carries them.

    Raises :class:`WorkerFailure` when a worker call fails or the decode stream closes early
    (unless the room was aborted: then a final ``finish_reason="abort"`` message is made here).
    """
    out.begin(run)
    waiting = run.scores_due
    pending: list[gpb.GenerateResponse] = []
    while True:
        items = [await run.queue.get()]
        while not run.queue.empty():
            items.append(run.queue.get_nowait())
        for item in items:
            if isinstance(item, wpb.PrefillResponse) and waiting:
                out.score_prompt(item)
                waiting = False
        for item in items:
            if isinstance(item, wpb.PrefillResponse):
                continue
            if isinstance(item, gpb.GenerateResponse):
                pending.append(item)
                if item.finished:
                    break
                continue
            if pending and not waiting:
                msg = out.message(pending)
                yield msg
                if msg.finished:
                    return
                pending = []
            if item is END and run.aborted:
                yield out.message([_abort_message()])
                return
            if item is END and pending and pending[-1].finished:
                break  # the stream is whole: its messages wait for the prefill's response
            if item is END:
                raise WorkerFailure(grpc.StatusCode.UNAVAILABLE,
                                    f"decode worker {run.decode.address} closed the stream early",
                                    blame="decode")
            assert isinstance(item, WorkerFailure)
            raise item
        if pending and not waiting:
            msg = out.message(pending)
            yield msg
            if msg.finished:
                return
            pending = []


class Outgoing:
    """One request's client stream across its attempts: merges batches of worker messages
    into client messages, cuts stop strings, keeps the tokens streamed so far and the usage
    (prompt tokens of the request, completion tokens of every attempt together, cached tokens
    of the first attempt that reported any, at most the prompt's, and the drafted and accepted
    tokens of every attempt together: a decode reports its running counts on each message, so
    an attempt that fails keeps what it last reported)."""

    def __init__(self, request_id: str, prompt: Sequence[int],
                 detok: IncrementalDetokenizer | None, logprobs: bool,
                 stops: Sequence[str], *, prompt_logprobs: bool = False) -> None:
        self.request_id, self.detok, self.logprobs = request_id, detok, logprobs
        self.prompt = list(prompt)
        self.prompt_tokens = len(self.prompt)
        # the prompt's ids go out once, on the first message, when its logprobs were asked for
        self._prompt_ids_due = prompt_logprobs
        self._prompt_scores: wpb.PrefillResponse | None = None  # a prefill's, until sent
        self.stops = StopMatcher(list(stops)) if stops and detok is not None else None
        self.token_ids: list[int] = []  # every token the client was sent
        self.cached_tokens = 0
        self.run: RoomRun | None = None  # the attempt running now (set by relay)
        self._spec_before = (0, 0)  # drafted, accepted tokens of the attempts before this one
        self._spec_now = (0, 0)  # the running attempt's counts, as it last reported them

    def begin(self, run: RoomRun) -> None:
        """Start attempt ``run``: the last attempt's speculative counts are kept."""
        before, now = self._spec_before, self._spec_now
        self._spec_before, self._spec_now = (before[0] + now[0], before[1] + now[1]), (0, 0)
        self.run = run

    def usage(self) -> gpb.Usage:
        """The request's usage so far (every attempt's)."""
        before, now = self._spec_before, self._spec_now
        return gpb.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=len(self.token_ids),
                         cached_tokens=self.cached_tokens, drafted_tokens=before[0] + now[0],
                         accepted_tokens=before[1] + now[1])

    def score_prompt(self, prefill: wpb.PrefillResponse) -> None:
        """The prompt's log-probabilities as the prefill computed them: they go out on the next
        message (the first of the request)."""
        self._prompt_scores = prefill

    def message(self, msgs: list[gpb.GenerateResponse]) -> gpb.GenerateResponse:
        if not self.cached_tokens:
            self.cached_tokens = min(max(m.usage.cached_tokens for m in msgs), self.prompt_tokens)
        for m in msgs:
            if m.usage.drafted_tokens:
                self._spec_now = (m.usage.drafted_tokens, m.usage.accepted_tokens)
        msg = merge(msgs, self.request_id, self.detok, self.logprobs)
        if self._prompt_ids_due:
            msg.prompt_token_ids.extend(self.prompt)
            self._prompt_ids_due = False
        if self._prompt_scores is not None:
            msg.prompt_logprobs.extend(self._prompt_scores.prompt_logprobs)
            msg.prompt_top_logprobs.extend(self._prompt_scores.prompt_top_logprobs)
            self._prompt_scores = None
        self.token_ids.extend(msg.token_ids)
        if msg.finished:
            msg.usage.CopyFrom(self.usage())
        if self.stops is None:
            return msg
        text = self.stops.feed(msg.text)
        if self.stops.hit:
            if not msg.finished:
                assert self.run is not None
                self.run.close()  # the workers stop now: nothing stays held
                msg.usage.CopyFrom(self.usage())
            msg.text, msg.finished, msg.finish_reason = text, True, "stop"
            return msg
        msg.text = text + self.stops.flush() if msg.finished else text
        return msg


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets ``hit`` (and drops the rest) at a stop."""
        self.buf += text
        found = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.buf, self.hit = self.buf[:min(found)], "", True
            return out
        keep = min(self.hold, len(self.buf))
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        """What was held back, at the end of the generation."""
        out, self.buf = self.buf, ""
        return out


def merge(msgs: list[gpb.GenerateResponse], request_id: str,
          detok: IncrementalDetokenizer | None, logprobs: bool) -> gpb.GenerateResponse:
    """One client message for consecutive worker messages (the last may be the final one);
    with ``logprobs`` their log-probabilities carry over, and so do the alternatives and the
    prompt's log-probabilities (the first message's) of a request that asked for them."""
    out = gpb.GenerateResponse(request_id=request_id)
    for m in msgs:
        out.token_ids.extend(m.token_ids)
        if logprobs:
            out.logprobs.extend(m.logprobs)
        # present only when the request asked for them
        out.top_logprobs.extend(m.top_logprobs)
        out.prompt_logprobs.extend(m.prompt_logprobs)
        out.prompt_top_logprobs.extend(m.prompt_top_logprobs)
    last = msgs[-1]
    if detok is not None:
        text = detok.add(out.token_ids)
        out.text = text + detok.finish() if last.finished else text
    if last.finished:  # the usage is the whole request's: Outgoing sets it
        out.finished = True
        out.finish_reason = last.finish_reason
    return out


def _abort_message() -> gpb.GenerateResponse:
    return gpb.GenerateResponse(finished=True, finish_reason="abort")
