"""The ``pdserve.v1.Generation`` servicer: validate, pick workers, run the room, relay.

Invariants: a request id is live from admission until the stream ends (however it ends), and
each attempt's room id from that attempt's admission until it ends; every :class:`RoomRun` is
closed exactly once: when its attempt failed and the request runs again
(:mod:`router.recovery`), or in ``_generate``'s ``finally``, which also runs when the client
cancels, its deadline passes or the generator is closed. Every call of ``Generate`` writes one
log line (:mod:`serving.request_log`) when it ends, however it ends.

Room ids are random (:data:`ROOM_BITS` bits) and unique among this router's live rooms; other
routers in front of the same workers draw theirs independently. A worker that already runs a room
under the drawn id refuses it with ``ALREADY_EXISTS``: the attempt runs again under a new id (at
most :data:`ROOM_REDRAWS` times), spending no recovery budget and blaming no worker, and its
clean-up's ``AbortRoom`` names this request, so the other router's room is left alone.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Coroutine
from contextlib import aclosing
from typing import Any, cast

import grpc

from engine.errors import InvalidRequestError
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from proto.pdserve.v1 import worker_pb2 as wpb
from router.config import RouterConfig
from router.errors import DoorError, WorkerFailure
from router.policy import LeastLoaded, Policy, pick_answering
from router.preprocess import ModelAssets, PreparedRequest, Preprocessor
from router.recovery import RECOVERABLE, Recovery, Step
from router.relay import Outgoing, relay
from router.room import RoomRun
from router.workers import WorkerPool
from serving.metrics import RouterMetrics
from serving.overload import abort_overloaded
from serving.request_log import RequestLine, request_id_from, request_line
from serving.status import abort_with_status

log = logging.getLogger(__name__)
ROOM_BITS = 63
ROOM_REDRAWS = 3  # new room ids one request may draw after workers refused its id as running


class LocalContext:
    """What :meth:`GenerationService.Generate` uses of a ``grpc.aio.ServicerContext``, for the
    other doors (HTTP): ``abort`` raises :class:`DoorError` instead of ending an RPC."""

    def __init__(self, deadline_s: float | None = None) -> None:
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> None:
        trailing = tuple((str(k), str(v)) for k, v in (trailing_metadata or ()))
        raise DoorError(code, details, trailing)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # the HTTP door puts its X-Request-Id header into the request itself


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """Serves the public API over a :class:`WorkerPool`, picking workers with ``policy``
    (:mod:`router.policy`; default: least loaded)."""

    def __init__(self, config: RouterConfig, assets: ModelAssets, pool: WorkerPool,
                 policy: Policy | None = None) -> None:
        self.config = config
        self.assets = assets
        self.pool = pool
        self.policy = policy or LeastLoaded()
        self.prep = Preprocessor(assets, config.max_new_tokens_default, config.max_images,
                                 config.video_limits)
        self.ids: set[str] = set()  # request ids from admission to the end of their stream
        self.running: dict[str, RoomRun] = {}  # the ones whose workers are already called
        self.rooms: set[int] = set()
        self.metrics: Counter[str] = Counter()  # requests, local_prefill, remote_prefill, ...
        self.latency = RouterMetrics(self.metrics)  # TTFT / ITL histograms for /metrics
        self._background: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, keeping a reference until it finishes."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[gpb.GenerateResponse, None]:
        rid = (request.request_id or request_id_from(context.invocation_metadata())
               or uuid.uuid4().hex)
        with request_line("router", rid, context) as line:
            async with aclosing(self._generate(request, context, rid, line)) as stream:
                async for msg in stream:
                    yield msg

    async def _generate(self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext,
                        rid: str, line: RequestLine) -> AsyncGenerator[gpb.GenerateResponse, None]:
        timer = self.latency.stream(line.start)
        if len(self.ids) >= self.config.max_running:
            self.metrics["rejected"] += 1
            await abort_overloaded(
                context, f"the router runs {len(self.ids)} streams (--max-running "
                         f"{self.config.max_running})")
        if rid in self.ids:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is running")
        self.ids.add(rid)  # reserved synchronously: no await between the check and this line
        run: RoomRun | None = None
        try:
            try:
                prepared = await asyncio.to_thread(self.prep.prepare, request)
            except InvalidRequestError as exc:
                await abort_with_status(context, exc)
            detok = self.assets.tokenizer.detokenizer() if self.assets.tokenizer else None
            out = Outgoing(rid, prepared.token_ids, detok, prepared.sampling.logprobs,
                           prepared.sampling.stop,
                           prompt_logprobs=prepared.sampling.HasField("prompt_logprobs"))
            recovery = Recovery(self.config.recovery)
            step: Step | None = None
            steps: list[str] = []  # the recovery steps taken, for the request's log line
            redraws = 0  # attempts run again under a new room id (:meth:`_collided`)
            while True:
                run = await self._admit(rid, prepared, step, out.token_ids, context,
                                        first=not steps and not redraws)
                line.fields.update(room=run.room, prompt_tokens=len(prepared.token_ids),
                                   prefill=run.prefill.address if run.prefill else None,
                                   decode=run.decode.address)
                try:
                    async for msg in relay(run, out):
                        timer.tokens(len(msg.token_ids))
                        line.tokens(len(msg.token_ids))
                        if msg.finished:
                            run.finished = True
                            self.metrics[f"finish_{msg.finish_reason}"] += 1
                            line.fields["finish_reason"] = msg.finish_reason
                        yield msg
                except WorkerFailure as exc:
                    if self._collided(run, exc, redraws):
                        redraws += 1
                    else:
                        step = self._next_step(run, exc, recovery, len(out.token_ids), context)
                        steps.append(step.value)
                        line.fields["recovery"] = ",".join(steps)
                    self._end_attempt(run)
                    run = None
                    continue
                self._end_attempt(run, completed=True)
                run = None
                return
        except WorkerFailure as exc:
            self.metrics["failed"] += 1
            await context.abort(exc.code, exc.details, trailing_metadata=exc.trailing)
        finally:
            self.ids.discard(rid)
            self.running.pop(rid, None)
            if run is not None:
                self._end_attempt(run)

    def _collided(self, run: RoomRun, failure: WorkerFailure, redraws: int) -> bool:
        """Whether ``failure`` is a worker refusing ``run``'s room id as running already (another
        router's room: ids are drawn independently) and the attempt may run again as it was,
        under a new id: ``redraws`` (the request's so far) is below :data:`ROOM_REDRAWS`."""
        if failure.code != grpc.StatusCode.ALREADY_EXISTS or not failure.blame \
                or redraws >= ROOM_REDRAWS:
            return False
        self.metrics["room_collisions"] += 1
        log.warning("room %d is running on a worker already (%s); drawing another room id",
                    run.room, failure.details)
        return True

    def _next_step(self, run: RoomRun, failure: WorkerFailure, recovery: Recovery,
                   streamed: int, context: grpc.aio.ServicerContext) -> Step:
        """Blame the failed worker and pick the next attempt; re-raises ``failure`` when the
        request ends with it (see :mod:`router.recovery`)."""
        worker = run.prefill if failure.blame == "prefill" else run.decode
        if worker is not None and failure.blame and failure.code in RECOVERABLE:
            worker.note_failure(failure.details)  # a fault, not a refusal of the request
        if run.aborted:
            raise failure
        step = recovery.next_step(failure, streamed, run.prefill is None,
                                  context.time_remaining())
        if step is None:
            raise failure
        self.metrics[f"recovered_{step.value}"] += 1
        log.warning("room %d failed (%s); running the request again: %s", run.room,
                    failure.details, step.value)
        return step

    def _end_attempt(self, run: RoomRun, completed: bool = False) -> None:
        """Close ``run`` and free its room id; a completed one clears its workers'
        cool-downs."""
        run.close()
        self.rooms.discard(run.room)
        if self.running.get(run.request.request_id) is run:
            del self.running[run.request.request_id]
        if completed:
            run.decode.note_success()
            if run.prefill is not None:
                run.prefill.note_success()

    def generate(self, request: gpb.GenerateRequest,
                 deadline_s: float | None = None) -> AsyncGenerator[gpb.GenerateResponse, None]:
        """``Generate`` for the other doors: the same admission, validation and relay; every
        error is raised as :class:`DoorError` carrying the status the gRPC door would send.
        Close the returned generator (``aclose``) to cancel the request."""
        context = cast(grpc.aio.ServicerContext, LocalContext(deadline_s))
        return self.Generate(request, context)

    async def _admit(self, rid: str, prepared: PreparedRequest, step: Step | None,
                     resumed: list[int], context: grpc.aio.ServicerContext, *,
                     first: bool) -> RoomRun:
        """Pick the workers (:attr:`policy`, given the attempt's prompt), draw the room id,
        register and start one attempt's room.

        ``step`` is None until a recovery step was taken, else how this attempt runs
        (:mod:`router.recovery`); ``resumed`` are the tokens the client already has (they
        extend the prompt); ``first``: the request's first attempt (it counts the request).

        A picked worker that the background poll has not reached, that a request failed on since
        (or, for a prefill, whose bootstrap address is unknown) is asked right then
        (:meth:`WorkerPool.ensure`); one that does not answer is set aside and another one of its
        kind picked (:func:`router.policy.pick_answering`). When no decode answers the request
        fails with ``UNAVAILABLE`` naming the last one asked; when no prefill does too, unless
        the recovery policy lets the decode compute the prompt (then it does).
        """
        prompt = [*prepared.token_ids, *resumed]
        decode = await pick_answering(self.policy, self.pool, self.pool.decode, prompt,
                                      lambda w: w.healthy)
        if not decode.healthy:
            raise WorkerFailure(grpc.StatusCode.UNAVAILABLE,
                                f"decode worker {decode.address} is unreachable ({decode.error})")
        prefill = None
        bootstrap = ""
        short = len(prepared.token_ids) < self.config.local_prefill_threshold
        # a prompt's log-probabilities come from the prefill that computes it (in its Prefill
        # response); a pipelined prefill does not score prompts: such a request runs locally
        scored = prepared.sampling.HasField("prompt_logprobs") and not resumed
        local = self.config.mode == "colocated" or short or step is Step.LOCAL
        if not local:
            prefill = await pick_answering(self.policy, self.pool, self.pool.prefill, prompt,
                                           lambda w: w.healthy and bool(w.report.bootstrap))
            if scored and prefill.healthy and not prefill.report.scores_prompts:
                prefill, local = None, True
        if prefill is not None:
            bootstrap = prefill.report.bootstrap if prefill.healthy else ""
            if not bootstrap:
                cause = prefill.error or "it reports no bootstrap address"
                if not self.config.recovery.local_fallback:
                    raise WorkerFailure(grpc.StatusCode.UNAVAILABLE,
                                        f"prefill worker {prefill.address} is unusable ({cause})")
                log.warning("prefill worker %s is unusable (%s): decode %s computes the prompt",
                            prefill.address, cause, decode.address)
                self.metrics["recovered_no_prefill"] += 1
                prefill, local = None, True
        room = self._new_room()  # reserved only once the request will run
        if first:
            self.metrics["requests"] += 1
        self.metrics["local_prefill" if local else "remote_prefill"] += 1
        sampling = gpb.SamplingParams()
        sampling.CopyFrom(prepared.sampling)
        sampling.max_new_tokens -= len(resumed)
        if resumed:  # the client has the prompt's log-probabilities from the first attempt
            sampling.ClearField("prompt_logprobs")
        wreq = wpb.WorkerRequest(room=room, request_id=rid, token_ids=prompt,
                                 images=prepared.images, sampling=sampling,
                                 videos=prepared.videos, resumed_tokens=len(resumed))
        run = RoomRun(room, wreq, decode, prefill, bootstrap, self.spawn,
                      timeout_s=self.config.worker_timeout_s, deadline_s=context.time_remaining())
        self.running[rid] = run
        run.start()
        return run

    def _new_room(self) -> int:
        """A random nonzero 63-bit room id not used by any live room (reserved on return)."""
        while True:
            room = secrets.randbits(ROOM_BITS)
            if room and room not in self.rooms:
                self.rooms.add(room)
                return room

    def stats(self) -> dict[str, int]:
        """The router's figures for ``Admin.GetStats`` (it holds no pages or aux slots).

        ``transfers_failed`` counts requests that ended with a worker failure; ``kv_retries``,
        ``kv_recomputes`` and ``decode_failovers`` the recoveries (:mod:`router.recovery`): a
        prompt run again on a prefill, computed on the decode (after a failure, or because no
        prefill was usable), a stream moved to another decode."""
        m = self.metrics
        return {"requests_running": len(self.ids), "rooms_active": len(self.rooms),
                "requests_total": m["requests"], "requests_rejected": m["rejected"],
                "transfers_failed": m["failed"], "kv_retries": m["recovered_retry"],
                "kv_recomputes": m["recovered_recompute"] + m["recovered_no_prefill"],
                "decode_failovers": m["recovered_failover"]}

    async def GetModelInfo(  # noqa: N802
        self, request: gpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gpb.ModelInfo:
        cfg = self.assets.config
        return gpb.ModelInfo(model_type=cfg.model_type, vocab_size=cfg.text.vocab_size,
                             max_model_len=self.assets.max_model_len,
                             has_tokenizer=self.assets.tokenizer is not None,
                             mode=self.config.mode,
                             chat_template=self.assets.chat_template.text,
                             chat_template_source=self.assets.chat_template.source,
                             chat_special_tokens=dict(self.assets.chat_template.special_tokens))

    async def Abort(  # noqa: N802
        self, request: gpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gpb.AbortResponse:
        run = self.running.get(request.request_id)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no running request {request.request_id!r}")
        self.metrics["aborted"] += 1
        await run.abort()
        return gpb.AbortResponse()
