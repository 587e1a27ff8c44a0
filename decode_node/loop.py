"""The decode node's engine thread: runs engine steps while other threads submit and abort.

All scheduler state is touched under one lock: the engine thread holds it for a step, and
:meth:`EngineLoop.submit` / :meth:`EngineLoop.abort` take it briefly, so a bad request is
refused synchronously (``InvalidRequestError``) and never reaches the loop. After each step the
thread hands the step's token events to ``emit`` in one call (one event per request that got a
token or finished), outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decode_node.remote import RemoteQueues, RemoteRoom, RoomOutcome
from decode_node.spec.eagle_engine import EagleEngine
from engine.errors import InvalidRequestError
from engine.inputs import ImageInput
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request, SamplingParams
from transfer.bootstrap_decode import DecodeBootstrapClient


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request; ``finish_reason`` (or ``error``) is set on its last event."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    drafted: int = 0  # speculative decoding: draft tokens proposed / accepted, on the last event
    accepted: int = 0


Emit = Callable[[list[TokenEvent]], None]
log = logging.getLogger(__name__)
IDLE_POLL_S = 0.002  # how often transfers are polled while nothing else runs


class EngineLoop:
    """Owns an :class:`LLMEngine` and steps it on a background thread."""

    def __init__(self, engine: LLMEngine, emit: Emit, spec: EagleEngine | None = None) -> None:
        self.engine = engine
        self.spec = spec
        self._stepper: LLMEngine | EagleEngine = spec or engine
        self.remote = RemoteQueues(engine, seed=spec.seed if spec else None)
        self._emit = emit
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        images: Sequence[ImageInput],
        sampling: SamplingParams,
    ) -> Request:
        """Validate and queue a request; raises ``InvalidRequestError`` on bad input."""
        with self._wake:
            req = self.engine.add_request(token_ids, images, sampling, request_id=request_id)
            self._wake.notify()
            return req

    def submit_remote(
        self, room: int, token_ids: Sequence[int], sampling: SamplingParams,
        client: DecodeBootstrapClient | list[DecodeBootstrapClient],
    ) -> None:
        """Queue a room whose prompt a prefill node computes; raises ``InvalidRequestError``.

        ``client`` is the prefill's bootstrap client, or one client per pipeline stage in stage
        order (the last stage sends the aux row)."""
        clients = client if isinstance(client, list) else [client]
        req = Request(str(room), list(token_ids), sampling)
        with self._wake:
            if room in self.remote or self.engine.scheduler.get(req.request_id):
                raise InvalidRequestError(f"room {room} is already running here")
            self.remote.add(RemoteRoom(room, req, clients))
            self._wake.notify()

    def abort(self, request_id: str) -> bool:
        """Cancel a request; True if it was still running. It gets a final ABORT event."""
        with self._wake:
            remote = self.remote.abort(int(request_id), "aborted") if request_id.isdigit() else None
            req = remote.request if remote else self.engine.abort(request_id)
        if req is None:
            return False
        req.finish_reason = FinishReason.ABORT
        self._emit([_event(req, 0)])
        return True

    def _event(self, req: Request, new: int) -> TokenEvent:
        """:func:`_event`, with the speculative counts on a request's last event."""
        if self.spec is None or req.finish_reason is None:
            return _event(req, new)
        stats = self.spec.request_stats.pop(req.request_id, None)
        if stats is None:
            return _event(req, new)
        return _event(req, new, stats.drafted, stats.accepted)

    def _emit_outcomes(self, outcomes: list[RoomOutcome]) -> None:
        events = []
        for o in outcomes:
            req = o.room.request
            if o.error is not None:
                events.append(TokenEvent(req.request_id, [], [], FinishReason.ABORT,
                                         req.num_prompt_tokens, 0, error=o.error))
            else:  # adopted or finished: the first token, from the prefill
                events.append(_event(req, 1))
        if events:
            self._emit(events)

    def _abort_all(self) -> list[TokenEvent]:
        sched = self.engine.scheduler
        reqs = [sched.abort(rid) for rid in sched.request_ids()]
        return [_event(r, 0) for r in reqs if r is not None]

    def stats(self) -> dict[str, float]:
        with self._lock:
            sched = self.engine.scheduler
            out: dict[str, float] = {
                "waiting_requests": sched.num_waiting + self.remote.num_rooms,
                "running_requests": sched.num_running,
                "kv_pages_used": sched.allocator.num_used,
                "kv_pages_total": sched.allocator.num_pages,
                "rooms_active": self.remote.num_rooms,
            }
            if self.spec is not None:
                spec = self.spec.stats
                out.update(drafted_tokens=spec.drafted, accepted_tokens=spec.accepted,
                           spec_rounds=spec.rounds, acceptance_length=spec.acceptance_length)
            return out

    def num_queued(self) -> int:
        """Requests waiting for admission: remote rooms waiting for pages (prealloc) and local
        requests waiting to be scheduled (the bound of ``--max-waiting``)."""
        with self._lock:
            return self.engine.scheduler.num_waiting + len(self.remote.prealloc)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.engine.scheduler.has_unfinished():
                    if self.remote.active:
                        self._emit_outcomes(self.remote.tick())
                        if self.engine.scheduler.has_unfinished():
                            break
                    self._wake.wait(IDLE_POLL_S if self.remote.active else None)
                if self._stopping:
                    return
                if self.remote.active:
                    self._emit_outcomes(self.remote.tick())
                try:
                    result = self._stepper.step()
                except Exception:  # a bug must fail the step's requests, not hang them
                    log.exception("engine step failed; aborting every running request")
                    self._emit(self._abort_all())
                    continue
            events = [self._event(r, n) for r, n in result.new_tokens]
            done = {id(r) for r, _ in result.new_tokens}
            events += [self._event(r, 0) for r in result.finished if id(r) not in done]
            if events:
                self._emit(events)
            time.sleep(0)  # let submit/abort/stats threads take the lock between steps


def _event(req: Request, new: int, drafted: int = 0, accepted: int = 0) -> TokenEvent:
    """The event for ``req``'s last ``new`` output tokens."""
    ids = req.output_token_ids[len(req.output_token_ids) - new :] if new else []
    lps = req.output_logprobs[len(req.output_logprobs) - new :] if new else []
    return TokenEvent(req.request_id, ids, lps, req.finish_reason, req.num_prompt_tokens,
                      req.num_output_tokens, drafted=drafted, accepted=accepted)
