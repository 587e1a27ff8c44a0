"""Generation results -> OpenAI response bodies: the HTTP door's output conversion.

Whole responses, stream chunks and the final usage chunk (:class:`Chunks`, one choice per
completion of an ``n`` request), and errors as an HTTP status with an OpenAI-style error body
(:func:`error_reply`). Plain JSON-ready dicts; the door does the HTTP. Stop strings are cut by the
router's relay, for both doors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from router.errors import DoorError
from router.openai_logprobs import merge_logprobs
from router.openai_request import BadRequest
from router.openai_tools import ToolCallParser
from serving.overload import RETRY_AFTER_KEY

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


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for an HTTP status."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"),
                      "param": None, "code": code}}


def door_error_body(exc: DoorError) -> tuple[int, dict[str, Any]]:
    """A gRPC refusal as an HTTP status and error body (500 for codes without a mapping)."""
    status = HTTP_STATUS.get(exc.code, 500)
    return status, error_body(status, exc.details, exc.code.name.lower())


def error_reply(exc: Exception) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, body and headers for a failed call. An overload refusal's retry-after
    hint becomes ``Retry-After`` (whole seconds, rounded up, at least 1) plus the hint itself;
    anything but a :class:`BadRequest` or :class:`DoorError` is an opaque 500."""
    headers: dict[str, str] = {}
    if isinstance(exc, BadRequest):
        status, body = 400, error_body(400, str(exc), "invalid_argument")
    elif isinstance(exc, DoorError):
        status, body = door_error_body(exc)
        retry = dict(exc.trailing).get(RETRY_AFTER_KEY)
        if retry and retry.isdigit():
            headers["Retry-After"] = str(max(1, -(-int(retry) // 1000)))
            headers[RETRY_AFTER_KEY] = retry
    else:
        status, body = 500, error_body(500, "internal error", "internal")
    return status, body, headers


@dataclass
class Outcome:
    """What one generation produced, kept while it streams."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # parts, when asked for
    tools: ToolCallParser | None = None  # chat with tools: parses the text into tool calls


def total_usage(outs: list[Outcome]) -> dict[str, Any]:
    """The usage of all completions of one request: the prompt counted once (every completion
    has the same one), completion tokens summed (as OpenAI and vLLM count ``n``), the prompt's
    cached tokens once too (``prompt_tokens_details.cached_tokens``, as OpenAI names them)."""
    prompt = max((o.prompt_tokens for o in outs), default=0)
    completion = sum(o.completion_tokens for o in outs)
    cached = min(max((o.cached_tokens for o in outs), default=0), prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Chunks:
    """OpenAI response objects of one request (``chat.completion`` or ``text_completion``);
    ``index`` names the choice (the completion of an ``n`` request)."""

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

    def whole(self, texts: list[str], outs: list[Outcome],
              logprobs: bool = False) -> dict[str, Any]:
        """The non-streaming response: one choice per completion (with its log-probabilities
        when ``logprobs``; a chat message with its tool calls when the call has tools)."""
        choices = []
        for index, (text, out) in enumerate(zip(texts, outs, strict=True)):
            scored = merge_logprobs(out.logprobs) if logprobs else None
            choice: dict[str, Any] = {"index": index, "finish_reason": out.finish_reason,
                                      "logprobs": scored}
            if self.chat and out.tools is not None:
                choice["message"] = out.tools.whole(text)
                choice["finish_reason"] = out.tools.finish_reason(out.finish_reason)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._base(""), "choices": choices, "usage": total_usage(outs)}

    def delta(self, delta: dict[str, Any], finish_reason: str | None,
              index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chat stream chunk carrying ``delta`` (and its tokens' ``logprobs``)."""
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": logprobs}
        return {**self._base(".chunk"), "choices": [choice]}

    def piece(self, text: str, finish_reason: str | None = None,
              index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A stream chunk of text and its tokens' ``logprobs`` (the last one, with
        ``finish_reason``, may be empty)."""
        if self.chat:
            return self.delta({"content": text} if text or not finish_reason else {},
                              finish_reason, index, logprobs)
        choice = {"index": index, "text": text, "finish_reason": finish_reason,
                  "logprobs": logprobs}
        return {**self._base(".chunk"), "choices": [choice]}

    def usage(self, outs: list[Outcome]) -> dict[str, Any]:
        """The ``include_usage`` chunk that ends a stream: no choices, the usage."""
        return {**self._base(".chunk"), "choices": [], "usage": total_usage(outs)}
