"""The decode node's engine thread: runs engine steps while other threads submit and abort.

All scheduler state is touched under one lock (:class:`serving.engine_thread.EngineThread`'s):
the engine thread holds it for a step, and :meth:`DecodeLoop.submit` / :meth:`DecodeLoop.abort`
take it briefly, so a bad request is refused synchronously (``InvalidRequestError``) and never
reaches the loop. After each step the thread hands the step's token events to ``emit`` in one
call (one event per request that got a token or finished), outside the lock. Remote rooms that
leave the transfer queues are emitted as they are polled, on every pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from decode_node.remote import RemoteQueues, RemoteRoom, RoomOutcome
from decode_node.spec.eagle_engine import EagleEngine
from engine.core.request import FinishReason, Request, SamplingParams, TopLogprobs
from engine.errors import DuplicateRequestError, TensorParallelError
from engine.llm_engine import LLMEngine
from engine.multimodal.inputs import ImageInput, VideoInput
from serving.compute_thread import ComputeThread
from serving.engine_thread import EngineThread
from transfer.bootstrap.decode import DecodeBootstrapClient


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
    prefill_side: bool = True  # ``error`` is the prefill's side of a transfer (else this node's)
    drafted: int = 0  # speculative decoding: draft tokens proposed / accepted so far
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a prefix cache held (Request.num_cached_tokens)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, when asked for
    # the prompt's (Request.prompt_logprobs / prompt_top_logprobs), on a request's first event
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)


Emit = Callable[[list[TokenEvent]], None]
IDLE_POLL_S = 0.002  # how often transfers are polled while nothing else runs


class DecodeLoop(EngineThread[list[TokenEvent]]):
    """Owns an :class:`LLMEngine` and steps it on a background thread."""

    def __init__(self, engine: LLMEngine, emit: Emit, spec: EagleEngine | None = None,
                 compute: ComputeThread | None = None) -> None:
        """``compute``: the thread ``engine`` was built on, which steps it (see
        :class:`~serving.engine_thread.EngineThread`)."""
        super().__init__("decode-loop", "decode node error", compute)
        self.engine = engine
        self.spec = spec
        self._stepper: LLMEngine | EagleEngine = spec or engine
        self.remote = RemoteQueues(engine, seed=spec.seed if spec else None)
        self._emit = emit

    def submit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        images: Sequence[ImageInput],
        sampling: SamplingParams,
        *,
        videos: Sequence[VideoInput] = (),
    ) -> Request:
        """Validate and queue a request; raises ``InvalidRequestError`` on bad input."""
        self.engine.structured.check(sampling)  # a grammar compiles here, not under the lock
        with self.lock:
            req = self.engine.add_request(token_ids, images, sampling, request_id=request_id,
                                          videos=videos)
            self.lock.notify()
            return req

    def submit_remote(
        self, room: int, token_ids: Sequence[int], sampling: SamplingParams,
        client: DecodeBootstrapClient | list[DecodeBootstrapClient],
        images: Sequence[ImageInput] = (), *, videos: Sequence[VideoInput] = (),
    ) -> None:
        """Queue a room whose prompt a prefill node computes; raises ``InvalidRequestError``
        (``DuplicateRequestError`` when the room is already here).

        ``client`` is the prefill's bootstrap client, or the clients of every pipeline stage
        and TP rank in stage order (:meth:`decode_node.service.DecodeService._connect`; the
        last holds the aux slot). ``images`` and ``videos`` are the prompt's:
        the prefix cache keys its blocks by their content too."""
        clients = client if isinstance(client, list) else [client]
        req = self.engine.new_request(token_ids, images, sampling, request_id=str(room),
                                      videos=videos)
        req.payload = None  # the aux row's mrope delta makes it at adoption
        with self.lock:
            if room in self.remote or self.engine.scheduler.get(req.request_id):
                raise DuplicateRequestError(f"room {room} is already running here")
            self.remote.add(RemoteRoom(room, req, clients))
            self.lock.notify()

    def abort(self, request_id: str) -> bool:
        """Cancel a request; True if it was still running. It gets a final ABORT event."""
        with self.lock:
            remote = self.remote.abort(int(request_id), "aborted") if request_id.isdigit() else None
            req = remote.request if remote else self.engine.abort(request_id)
        if req is None:
            return False
        req.finish_reason = FinishReason.ABORT
        self._emit([_event(req, 0)])
        return True

    def figures(self) -> dict[str, float]:
        """Requests, rooms, pages and EAGLE's counters (lock held)."""
        sched = self.engine.scheduler
        out: dict[str, float] = {
            "waiting_requests": sched.num_waiting + self.remote.num_rooms,
            "running_requests": sched.num_running,
            **self.engine.stats(),
            "kv_pages_not_sent": self.remote.cached_pages_hit,
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
        with self.lock:
            return self.engine.scheduler.num_waiting + len(self.remote.prealloc)

    # ---- the thread's hooks (lock held, but publish) -------------------------------------

    def poll(self) -> None:
        """Poll the transfer queues; emit the rooms that left them (adopted, done, failed)."""
        if self.remote.active:
            self._emit_outcomes(self.remote.tick())

    def has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished()

    def idle_wait_s(self) -> float | None:
        """Transfers in flight are polled every ``IDLE_POLL_S``; with none, sleep until woken."""
        return IDLE_POLL_S if self.remote.active else None

    def step(self) -> list[TokenEvent]:
        result = self._stepper.step()
        events = [self._event(r, n) for r, n in result.new_tokens]
        done = {id(r) for r, _ in result.new_tokens}
        return events + [self._event(r, 0) for r in result.finished if id(r) not in done]

    def fail_all(self, reason: str) -> list[TokenEvent]:
        """Abort every scheduled request: each ends with ``finish_reason`` abort (the reason
        is only logged), or, when the engine is :attr:`dead`, with this node's error (the
        router recovers the request elsewhere)."""
        sched = self.engine.scheduler
        reqs = [r for r in (sched.abort(rid) for rid in sched.request_ids()) if r is not None]
        if self.dead is None:
            return [_event(r, 0) for r in reqs]
        error = f"{reason}: {self.dead}"
        return [replace(_event(r, 0), error=error, prefill_side=False) for r in reqs]

    def fatal(self, exc: Exception) -> bool:
        """A tensor-parallel rank died: the engine cannot step again."""
        return isinstance(exc, TensorParallelError)

    def publish(self, out: list[TokenEvent]) -> None:
        if out:
            self._emit(out)

    def _event(self, req: Request, new: int) -> TokenEvent:
        """:func:`_event`, with the request's speculative counts so far on every event (the
        router keeps the last it saw when this node fails mid-stream)."""
        if self.spec is None:
            return _event(req, new)
        stats_of = self.spec.request_stats
        stats = stats_of.get(req.request_id) if req.finish_reason is None \
            else stats_of.pop(req.request_id, None)
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


def _event(req: Request, new: int, drafted: int = 0, accepted: int = 0) -> TokenEvent:
    """The event for ``req``'s last ``new`` output tokens."""
    ids = req.output_token_ids[len(req.output_token_ids) - new :] if new else []
    lps = req.output_logprobs[len(req.output_logprobs) - new :] if new else []
    tops = req.output_top_logprobs[len(req.output_top_logprobs) - new :] if new else []
    first = new and req.num_output_tokens == new  # the request's first event with tokens
    return TokenEvent(req.request_id, ids, lps, req.finish_reason, req.num_prompt_tokens,
                      req.num_output_tokens, drafted=drafted, accepted=accepted,
                      cached_tokens=req.num_cached_tokens, top_logprobs=tops,
                      prompt_logprobs=req.prompt_logprobs if first else [],
                      prompt_top_logprobs=req.prompt_top_logprobs if first else [])
