"""OpenAI request bodies -> ``GenerateRequest``: the HTTP door's input conversion.

Only the conversion is checked here (JSON types, roles, content parts, image data URLs, ``n``,
``stop``, ``stream_options``); the ranges of the sampling values are the shared validator's,
behind :meth:`GenerationService.generate`. Anything unusable raises :class:`BadRequest` (HTTP
400). Chat messages are rendered with the one chat template, :mod:`engine.chat`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from engine.chat import IMAGE_BLOCK, conversation_prompt
from proto.pdserve.v1 import generate_pb2 as gpb

IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg")
MAX_STOPS = 4


class BadRequest(Exception):
    """A request body that cannot be converted (HTTP 400)."""


@dataclass(frozen=True)
class OpenAICall:
    """One parsed ``/v1/completions`` or ``/v1/chat/completions`` call."""

    request: gpb.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool  # only ever True when streaming
    stops: list[str]  # non-empty stop strings, at most MAX_STOPS


def completion_call(body: dict[str, Any], request_id: str) -> OpenAICall:
    """A ``/v1/completions`` body: ``prompt`` is a string, a list of one string, or token ids."""
    req = gpb.GenerateRequest(request_id=request_id, sampling=sampling(body))
    prompt = body.get("prompt")
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
    return _call(body, req, chat=False)


def chat_call(body: dict[str, Any], request_id: str) -> OpenAICall:
    """A ``/v1/chat/completions`` body: ``messages`` rendered with the chat template."""
    text, images = chat_prompt(body.get("messages"))
    req = gpb.GenerateRequest(request_id=request_id, text=text,
                              images=[gpb.Image(encoded=im) for im in images],
                              sampling=sampling(body))
    return _call(body, req, chat=True)


def _call(body: dict[str, Any], req: gpb.GenerateRequest, *, chat: bool) -> OpenAICall:
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = stream and bool(options.get("include_usage"))
    return OpenAICall(req, chat, stream, include_usage, stops(body))


def chat_prompt(messages: Any) -> tuple[str, list[bytes]]:
    """The chat template's text (:func:`engine.chat.conversation_prompt`) and the images in prompt
    order.

    Every message needs a string ``role`` (passed through as written); its ``content`` is a
    string, null, or a list of ``text`` and ``image_url`` parts, and each image part becomes
    :data:`engine.chat.IMAGE_BLOCK` at its place.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    turns: list[tuple[str, str]] = []
    images: list[bytes] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        turns.append((msg["role"], _content(msg.get("content"), f"messages[{i}]", images)))
    return conversation_prompt(turns), images


def _content(content: Any, where: str, images: list[bytes]) -> str:
    """One message's text; appends its images to ``images``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "image_url":
            images.append(_data_url(part.get("image_url"), f"{where}.content[{j}]"))
            pieces.append(IMAGE_BLOCK)
        else:
            raise BadRequest(f"{where}.content[{j}]: parts must be of type "
                             "'text' (with a string 'text') or 'image_url'")
    return "".join(pieces)


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


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{key}' must be a number")
    return float(value)


def _int(body: dict[str, Any], key: str, *keys: str) -> int | None:
    """The first of ``key, *keys`` that is set; it must be an integer."""
    for k in (key, *keys):
        value = body.get(k)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"'{k}' must be an integer")
        return value
    return None


def stops(body: dict[str, Any]) -> list[str]:
    """``stop``: a string or a list of at most :data:`MAX_STOPS` strings; empty ones dropped."""
    stop = body.get("stop")
    if stop is None:
        return []
    found = [stop] if isinstance(stop, str) else stop
    if not isinstance(found, list) or not all(isinstance(s, str) for s in found) \
            or len(found) > MAX_STOPS:
        raise BadRequest("'stop' must be a string or a list of at most 4 strings")
    return [s for s in found if s]
