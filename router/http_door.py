"""The router's OpenAI-compatible HTTP door: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, Prometheus ``/metrics`` and vLLM's tokenizer endpoints
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``: :mod:`router.openai_tokenize`), served by
aiohttp on the router's event loop.

Requests are converted into a ``GenerateRequest`` (:mod:`router.openai_request`) and run by
:meth:`GenerationService.generate`, the very code behind the gRPC ``Generate`` (same admission,
validation, workers and relay); results and its gRPC status become OpenAI bodies and HTTP
statuses (:mod:`router.openai_response`). This module is the HTTP: routes, auth, streaming.

With the router's ``--tls-cert/--tls-key`` the door serves HTTPS with the same certificate, and
with ``--auth-token-file`` every call (``/v1/*``, the tokenizer's) must carry ``Authorization:
Bearer <token>`` (compared in constant time; 401 otherwise), as on the gRPC door; ``/health``
and ``/metrics`` stay open, like gRPC health and the metrics port. ``/health`` mirrors the
router's gRPC health: 200 ``{"status": "ok"}`` while the worker pool is ready, else 503
``{"status": "not ready", "reason": ...}`` (:func:`router.workers.readiness`). ``/v1/models``
follows the same readiness, so a client that lists the models before its first call learns
whether one can succeed: the model list while ready, else 503 with an OpenAI error body (type
``service_unavailable``, the reason in its message).

A request with ``n > 1`` runs ``n`` generations concurrently (ids ``<id>-<i>``, seed ``seed + i``
when seeded) and answers with ``n`` choices; usage counts the prompt once and sums the
completions. Stop strings travel in the request and are cut by the router's relay.

A chat call with tools has its text parsed into tool calls (:mod:`router.openai_tools`): the
whole message, or content and ``tool_calls`` deltas as the text streams.

Streams use server-sent events (``data: {...}`` chunks, then ``data: [DONE]``). The first message
is awaited before the response starts, so refusals (400, 429, ...) keep their HTTP status; a
failure later in a stream is sent as a ``data: {"error": ...}`` event. A client that goes away
cancels its request (the handler is cancelled and the generator closed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import ssl
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import DoorError
from router.openai_logprobs import CompletionLogprobs, TokenTexts, chat_logprobs, merge_logprobs
from router.openai_request import BadRequest, OpenAICall, chat_call, completion_call, door_seed
from router.openai_response import (
    Chunks,
    Outcome,
    door_error_body,
    error_body,
    error_reply,
)
from router.openai_tokenize import detokenize, tokenize, tokenizer_info
from router.preprocess import ModelAssets
from router.service import GenerationService

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Part = tuple[str, dict[str, Any] | None]  # text, and its tokens' logprobs (when asked for)
Piece = tuple[int, Part | None]  # (choice index, a part; None: that choice ended)

MAX_BODY_BYTES = 64 << 20
OPEN_PATHS = ("/health", "/metrics")  # served without the bearer token, like gRPC health


def error_response(exc: Exception) -> web.Response:
    """The JSON error response for a failed call (see :func:`error_reply`)."""
    status, body, headers = error_reply(exc)
    return web.json_response(body, status=status, headers=headers)


class HttpDoor:
    """The aiohttp application over one :class:`GenerationService`."""

    def __init__(self, service: GenerationService, model_name: str,
                 metrics: CollectorRegistry | None = None, *,
                 ssl_context: ssl.SSLContext | None = None, bearer_token: str | None = None
                 ) -> None:
        self.service = service
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        self.ssl_context = ssl_context
        self._expected_auth = f"Bearer {bearer_token}".encode() if bearer_token else None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self._require_token])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/tokenize", self._plain(tokenize))
        self.app.router.add_post("/detokenize", self._plain(detokenize))
        self.app.router.add_get("/tokenizer_info", self.tokenizer_info)
        if metrics is not None:
            self.app.router.add_get("/metrics", self.prometheus)
        self._runner: web.AppRunner | None = None
        self._token_texts = TokenTexts(service.assets.tokenizer)  # shared by every request

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0 = a free port); returns the bound port."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.ssl_context)
        await site.start()
        server = site._server  # noqa: SLF001 - the only way to learn a port-0 bind
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _require_token(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse calls without the bearer token (when the router has one), but to
        :data:`OPEN_PATHS`."""
        if self._expected_auth is not None and request.path not in OPEN_PATHS:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, self._expected_auth):
                body = error_body(401, "missing or wrong bearer token", "unauthenticated")
                return web.json_response(body, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # ---- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        state = self.service.pool.readiness
        if state.ready:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "not ready", "reason": state.reason}, status=503)

    async def prometheus(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics, the same as on ``--metrics-port``."""
        assert self.metrics is not None
        body = generate_latest(self.metrics)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The served model while the worker pool is ready, else 503 saying why not."""
        state = self.service.pool.readiness
        if not state.ready:
            body = error_body(503, f"not ready: {state.reason}", "unavailable")
            return web.json_response(body, status=503)
        info = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.service.assets.max_model_len}
        return web.json_response({"object": "list", "data": [info]})

    def _plain(self, answer: Callable[[dict[str, Any], ModelAssets], dict[str, Any]]
               ) -> Handler:
        """A handler answering a JSON body with ``answer(body, assets)`` (BadRequest: 400)."""
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return web.json_response(answer(await _json(request), self.service.assets))
            except BadRequest as exc:
                return error_response(exc)
        return handle

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(tokenizer_info(self.service.assets))
        except BadRequest as exc:
            return error_response(exc)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            return await self._run(request, completion_call(body, _request_id(request, "cmpl")))
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            call = chat_call(body, _request_id(request, "chatcmpl"),
                             self.service.assets.chat_template)
            return await self._run(request, call)
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    # ---- generation --------------------------------------------------------------------------

    async def _run(self, request: web.Request, call: OpenAICall) -> web.StreamResponse:
        reqs = self._completions(call)
        outs = [Outcome(tools=call.tools.parser() if call.tools else None) for _ in reqs]
        chunk = Chunks(call.request.request_id, self.model_name, call.chat)
        async with aclosing(self._pieces(call, reqs, outs)) as pieces:
            first = await anext(pieces, None)  # refusals raise here, before any byte is sent
            if not call.stream:
                if first is not None:
                    async for _ in pieces:
                        pass
                return web.json_response(chunk.whole(["".join(o.text) for o in outs], outs,
                                                     call.logprobs is not None))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if call.chat:
                for index in range(len(reqs)):
                    await _send(resp, chunk.delta({"role": "assistant", "content": ""}, None,
                                                  index))
            try:
                if first is not None:
                    await _send_all(resp, _piece(chunk, first, outs))
                async for piece in pieces:
                    await _send_all(resp, _piece(chunk, piece, outs))
                if call.include_usage:
                    await _send(resp, chunk.usage(outs))
            except DoorError as exc:
                await _send(resp, door_error_body(exc)[1])
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    def _completions(self, call: OpenAICall) -> list[gpb.GenerateRequest]:
        """The ``n`` generation requests of a call: ids ``<id>-<i>`` when ``n > 1``, seed
        ``seed + i`` when seeded; OpenAI's temperature 1 when neither the body nor the
        checkpoint's generation_config.json sets one."""
        base = call.request
        if not base.sampling.HasField("temperature") \
                and self.service.assets.generation.temperature is None:
            base.sampling.temperature = 1.0
        if call.n == 1:
            return [base]
        reqs = []
        for i in range(call.n):
            req = gpb.GenerateRequest()
            req.CopyFrom(base)
            req.request_id = f"{base.request_id}-{i}"
            if base.sampling.HasField("seed"):
                req.sampling.seed = door_seed(base.sampling.seed + i)
            reqs.append(req)
        return reqs

    async def _pieces(self, call: OpenAICall, reqs: list[gpb.GenerateRequest],
                      outs: list[Outcome]) -> AsyncGenerator[Piece, None]:
        """``(index, text)`` pieces of the generations, run concurrently, in arrival order;
        ``(index, None)`` when generation ``index`` ended (its ``outs`` entry is complete). The
        first failure of any raises here; closing this generator cancels every generation."""
        queue: asyncio.Queue[Piece | Exception] = asyncio.Queue()

        async def run(index: int) -> None:
            try:
                async with aclosing(self._parts(call, reqs[index], outs[index])) as parts:
                    async for part in parts:
                        queue.put_nowait((index, part))
                queue.put_nowait((index, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(run(i)) for i in range(len(reqs))]
        try:
            left = len(reqs)
            while left:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                left -= item[1] is None
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _parts(self, call: OpenAICall, req: gpb.GenerateRequest,
                     out: Outcome) -> AsyncGenerator[Part, None]:
        """Text pieces of one generation (stop strings already cut by the relay), each with its
        tokens' log-probabilities when the call asks for them (then a piece may have no text);
        with ``echo`` the prompt (and its log-probabilities) leads the first. Fills ``out``
        (text, logprobs, usage, finish reason)."""
        texts = self._token_texts
        scored = CompletionLogprobs(texts) if call.logprobs is not None and not call.chat \
            else None
        lead = self._prompt_text(req) if call.echo else ""
        async with aclosing(self.service.generate(req)) as msgs:
            async for msg in msgs:
                out.completion_tokens += len(msg.token_ids)
                if msg.finished:
                    out.finish_reason = msg.finish_reason or "stop"
                    out.prompt_tokens = msg.usage.prompt_tokens
                    out.cached_tokens = msg.usage.cached_tokens
                    out.completion_tokens = msg.usage.completion_tokens or out.completion_tokens
                part = None
                if scored is not None:
                    lead_part = [scored.prompt(msg)] if msg.prompt_token_ids else []
                    part = merge_logprobs([*lead_part, scored.tokens(msg)])
                elif call.logprobs is not None:
                    part = chat_logprobs(texts, msg, call.logprobs)
                text, lead = lead + msg.text, ""
                if part is not None:
                    out.logprobs.append(part)
                if text:
                    out.text.append(text)
                if text or (part is not None and msg.token_ids):
                    yield text, part

    def _prompt_text(self, req: gpb.GenerateRequest) -> str:
        """An echoed prompt's text: as given, or the decoding of the given token ids."""
        if req.HasField("text") or not req.token_ids.ids:
            return req.text
        tok = self.service.assets.tokenizer
        return tok.decode(req.token_ids.ids, skip_special_tokens=False) if tok else ""


def _piece(chunk: Chunks, piece: Piece, outs: list[Outcome]) -> list[dict[str, Any]]:
    """The stream chunks of one piece: its text (and logprobs), or the finish of its choice;
    with tools, the piece's content and tool-call deltas (none while text is held back)."""
    index, part = piece
    tools = outs[index].tools
    if tools is None:
        if part is None:
            return [chunk.piece("", outs[index].finish_reason, index)]
        return [chunk.piece(part[0], None, index, part[1])]
    if part is None:
        held = tools.finish()
        end = chunk.delta({}, tools.finish_reason(outs[index].finish_reason), index)
        return [chunk.delta(held, None, index), end] if held else [end]
    delta = tools.feed(part[0])
    return [chunk.delta(delta, None, index, part[1])] if delta or part[1] is not None else []


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def _send_all(resp: web.StreamResponse, objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        await _send(resp, obj)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _request_id(request: web.Request, prefix: str) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if given else f"{prefix}-{uuid.uuid4().hex}"
