"""The router's OpenAI-compatible HTTP door: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and Prometheus ``/metrics``, served by aiohttp on the router's event
loop.

Requests are converted into a ``GenerateRequest`` and run by :meth:`GenerationService.generate`,
the very code behind the gRPC ``Generate`` (same admission, validation, workers and relay); its
gRPC status is mapped to an HTTP status and an OpenAI-style error body. Only the conversion itself
(JSON types, the chat template, data URLs) is checked here.

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

import base64
import binascii
import hmac
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from proto.pdserve.v1 import generate_pb2 as gpb
from router.service import DoorError, GenerationService
from serving.overload import RETRY_AFTER_KEY

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg")
MAX_BODY_BYTES = 64 << 20

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              409: "conflict_error",
              429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class BadRequest(Exception):
    """A request body that cannot be converted (HTTP 400)."""


def chat_prompt(messages: Any) -> tuple[str, list[bytes]]:
    """The chat template's text and the images in prompt order.

    ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``;
    each image part becomes ``<|vision_start|><|image_pad|><|vision_end|>`` at its place.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    parts: list[str] = []
    images: list[bytes] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = msg.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image_url":
                    images.append(_data_url(part.get("image_url"), f"messages[{i}].content[{j}]"))
                    pieces.append(IMAGE_BLOCK)
                else:
                    raise BadRequest(f"messages[{i}].content[{j}]: parts must be of type "
                                     "'text' (with a string 'text') or 'image_url'")
            text = "".join(pieces)
        else:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        parts.append(f"<|im_start|>{msg['role']}\n{text}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts), images


def _data_url(value: Any, where: str) -> bytes:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(f"{where}: image_url must be a data: URL (remote URLs are not fetched)")
    head, sep, payload = url[len("data:"):].partition(",")
    mime, _, encoding = head.partition(";")
    if not sep or encoding != "base64":
        raise BadRequest(f"{where}: the data URL must be data:<mime>;base64,<data>")
    if mime.lower() not in IMAGE_MIME:
        raise BadRequest(f"{where}: images must be image/png or image/jpeg, not {mime!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"{where}: bad base64 in the data URL") from exc


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number")
    return float(value)


def _int(body: dict[str, Any], key: str, *keys: str) -> int | None:
    for k in (key, *keys):
        value = body.get(k)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{k}' must be an integer")
        return value
    return None


def sampling(body: dict[str, Any]) -> gpb.SamplingParams:
    """OpenAI sampling fields -> ``SamplingParams`` (their ranges are the validator's)."""
    out = gpb.SamplingParams()
    max_tokens = _int(body, "max_completion_tokens", "max_tokens")
    if max_tokens is not None:
        if not 1 <= max_tokens < 1 << 32:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        out.max_new_tokens = max_tokens
    out.temperature = _number(body, "temperature", 1.0)  # OpenAI's default
    top_p = _number(body, "top_p", 1.0)
    if top_p <= 0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    out.top_p = top_p
    top_k = _int(body, "top_k")  # vLLM extension; -1 means off there
    if top_k is not None and top_k > 0:
        out.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        out.seed = seed % (1 << 64)
    if body.get("ignore_eos"):
        out.ignore_eos = True
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("only n = 1 is supported")
    return out


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) \
            or len(stops) > 4:
        raise BadRequest("'stop' must be a string or a list of at most 4 strings")
    return [s for s in stops if s]


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back what could start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buf = ""
        self.hit = False

    def feed(self, text: str) -> str:
        self.buf += text
        found = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.buf, self.hit = self.buf[:min(found)], "", True
            return out
        keep = min(self.hold, len(self.buf))
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Outcome:
    """What one generation produced, kept while it streams."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"),
                      "param": None, "code": code}}


def error_response(exc: Exception) -> web.Response:
    headers: dict[str, str] = {}
    if isinstance(exc, BadRequest):
        status, message, code = 400, str(exc), "invalid_argument"
    elif isinstance(exc, DoorError):
        status = HTTP_STATUS.get(exc.code, 500)
        message, code = exc.details, exc.code.name.lower()
        retry = dict(exc.trailing).get(RETRY_AFTER_KEY)
        if retry and retry.isdigit():
            headers["Retry-After"] = str(max(1, -(-int(retry) // 1000)))
            headers[RETRY_AFTER_KEY] = retry
    else:
        status, message, code = 500, "internal error", "internal"
    return web.json_response(error_body(status, message, code), status=status, headers=headers)


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
            prompt = body.get("prompt")
            req = gpb.GenerateRequest(request_id=_request_id(request, "cmpl"),
                                      sampling=sampling(body))
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                req.text = prompt
            elif isinstance(prompt, list) and prompt and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                req.token_ids.ids.extend(prompt)
            else:
                raise BadRequest("'prompt' must be a string (or a list of token ids)")
            if body.get("echo"):
                raise BadRequest("echo is not supported")
            return await self._run(request, body, req, chat=False)
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            text, images = chat_prompt(body.get("messages"))
            req = gpb.GenerateRequest(request_id=_request_id(request, "chatcmpl"), text=text,
                                      images=[gpb.Image(encoded=im) for im in images],
                                      sampling=sampling(body))
            return await self._run(request, body, req, chat=True)
        except (BadRequest, DoorError) as exc:
            return error_response(exc)

    # ---- generation --------------------------------------------------------------------------

    async def _run(self, request: web.Request, body: dict[str, Any], req: gpb.GenerateRequest,
                   *, chat: bool) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object")
        include_usage = stream and bool(options.get("include_usage"))
        stops = StopMatcher(_stops(body))
        out = Outcome()
        chunk = _Chunks(req.request_id, self.model_name, chat)
        async with aclosing(self._texts(req, stops, out)) as texts:
            first = await anext(texts, None)  # refusals raise here, before any byte is sent
            if not stream:
                if first is not None:
                    out.text.append(first)
                    out.text.extend([t async for t in texts])
                return web.json_response(chunk.whole("".join(out.text), out))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if chat:
                await _send(resp, chunk.delta({"role": "assistant", "content": ""}, None))
            try:
                if first is not None:
                    await _send(resp, chunk.piece(first))
                async for text in texts:
                    await _send(resp, chunk.piece(text))
                await _send(resp, chunk.piece("", out.finish_reason))
                if include_usage:
                    await _send(resp, chunk.usage(out))
            except DoorError as exc:
                status = HTTP_STATUS.get(exc.code, 500)
                await _send(resp, error_body(status, exc.details, exc.code.name.lower()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def _texts(self, req: gpb.GenerateRequest, stops: StopMatcher,
                     out: Outcome) -> AsyncIterator[str]:
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


class _Chunks:
    """OpenAI response objects of one request."""

    def __init__(self, request_id: str, model: str, chat: bool) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _base(self, suffix: str) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if suffix and self.chat:
            kind += suffix
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, out: Outcome) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason,
                                  "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._base(""), "choices": [choice], "usage": out.usage()}

    def delta(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._base(".chunk"), "choices": [choice]}

    def piece(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            return self.delta({"content": text} if text or not finish_reason else {},
                              finish_reason)
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return {**self._base(".chunk"), "choices": [choice]}

    def usage(self, out: Outcome) -> dict[str, Any]:
        return {**self._base(".chunk"), "choices": [], "usage": out.usage()}


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
