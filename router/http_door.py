"""The router's OpenAI-compatible HTTP door: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and Prometheus ``/metrics``, served by aiohttp on the router's event
loop.

Requests are converted into a ``GenerateRequest`` (:mod:`router.openai_request`) and run by
:meth:`GenerationService.generate`, the very code behind the gRPC ``Generate`` (same admission,
validation, workers and relay); results and its gRPC status become OpenAI bodies and HTTP
statuses (:mod:`router.openai_response`). This module is the HTTP: routes, auth, streaming.

With the router's ``--tls-cert/--tls-key`` the door serves HTTPS with the same certificate, and
with ``--auth-token-file`` every ``/v1/*`` call must carry ``Authorization: Bearer <token>``
(compared in constant time; 401 otherwise), as on the gRPC door; ``/health`` and ``/metrics``
stay open, like gRPC health and the metrics port.

Streams use server-sent events (``data: {...}`` chunks, then ``data: [DONE]``). The first message
is awaited before the response starts, so refusals (400, 429, ...) keep their HTTP status; a
failure later in a stream is sent as a ``data: {"error": ...}`` event. A client that goes away
cancels its request (the handler is cancelled and the generator closed).
"""

from __future__ import annotations

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
from router.openai_request import BadRequest, OpenAICall, chat_call, completion_call
from router.openai_response import (
    Chunks,
    Outcome,
    StopMatcher,
    door_error_body,
    error_body,
    error_reply,
)
from router.service import GenerationService

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_BODY_BYTES = 64 << 20


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
        if metrics is not None:
            self.app.router.add_get("/metrics", self.prometheus)
        self._runner: web.AppRunner | None = None

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
        """Refuse ``/v1/*`` calls without the bearer token (when the router has one)."""
        if self._expected_auth is not None and request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, self._expected_auth):
                body = error_body(401, "missing or wrong bearer token", "unauthenticated")
                return web.json_response(body, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # ---- handlers ----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics, the same as on ``--metrics-port``."""
        assert self.metrics is not None
        body = generate_latest(self.metrics)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        info = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pdserve", "max_model_len": self.service.assets.max_model_len}
        return web.json_response({"object": "list", "data": [info]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            return await self._run(request, completion_call(body, _request_id(request, "cmpl")))
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            return await self._run(request, chat_call(body, _request_id(request, "chatcmpl")))
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    # ---- generation --------------------------------------------------------------------------

    async def _run(self, request: web.Request, call: OpenAICall) -> web.StreamResponse:
        stops = StopMatcher(call.stops)
        out = Outcome()
        chunk = Chunks(call.request.request_id, self.model_name, call.chat)
        async with aclosing(self._texts(call.request, stops, out)) as texts:
            first = await anext(texts, None)  # refusals raise here, before any byte is sent
            if not call.stream:
                if first is not None:
                    out.text.append(first)
                    out.text.extend([t async for t in texts])
                return web.json_response(chunk.whole("".join(out.text), out))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if call.chat:
                await _send(resp, chunk.delta({"role": "assistant", "content": ""}, None))
            try:
                if first is not None:
                    await _send(resp, chunk.piece(first))
                async for text in texts:
                    await _send(resp, chunk.piece(text))
                await _send(resp, chunk.piece("", out.finish_reason))
                if call.include_usage:
                    await _send(resp, chunk.usage(out))
            except DoorError as exc:
                await _send(resp, door_error_body(exc)[1])
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def _texts(self, req: gpb.GenerateRequest, stops: StopMatcher,
                     out: Outcome) -> AsyncGenerator[str, None]:
        """Non-empty text pieces of the generation; fills ``out`` (usage, finish reason)."""
        async with aclosing(self.service.generate(req)) as msgs:
            async for msg in msgs:
                out.completion_tokens += len(msg.token_ids)
                text = stops.feed(msg.text)
                if stops.hit:  # cut here; closing the generator cancels the request
                    out.finish_reason = "stop"
                    out.prompt_tokens = self._prompt_tokens(req)
                    if text:
                        yield text
                    return
                if msg.finished:
                    text += stops.flush()
                    out.finish_reason = msg.finish_reason or "stop"
                    out.prompt_tokens = msg.usage.prompt_tokens
                    out.completion_tokens = msg.usage.completion_tokens or out.completion_tokens
                if text:
                    yield text

    def _prompt_tokens(self, req: gpb.GenerateRequest) -> int:
        """Prompt length for a request cut by a stop string (its final usage never comes);
        image placeholders count as written, not expanded."""
        if req.WhichOneof("input") == "token_ids":
            return len(req.token_ids.ids)
        tok = self.service.assets.tokenizer
        return len(tok.encode(req.text)) if tok is not None else 0


async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


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
