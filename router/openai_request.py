"""OpenAI request bodies -> ``GenerateRequest``: the HTTP door's input conversion.

Only the conversion is checked here (JSON types, roles, content parts, image data URLs, ``n``,
``stop``, ``stream_options``, ``logprobs``/``top_logprobs``/``echo``, ``tools``/``tool_choice``:
:mod:`router.openai_tools`); the ranges of the sampling values are the shared validator's,
behind :meth:`GenerationService.generate`. Anything unusable raises :class:`BadRequest` (HTTP
400). Chat messages are rendered with the served checkpoint's chat template
(:mod:`engine.text.chat_template`; the built-in ChatML when it has none).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, replace
from typing import Any

from engine.core.request import MAX_SEED, MAX_TOP_LOGPROBS
from engine.errors import InvalidRequestError
from engine.text.chat_template import ChatTemplate
from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import BadRequest
from router.openai_structured import structured_output
from router.openai_tools import ToolUse, history_calls, refuse_tools, tool_use

IMAGE_MIME = ("image/png", "image/jpeg", "image/jpg")
MAX_STOPS = 4
MAX_N = 16  # completions per request
_CHATML = ChatTemplate.builtin()


@dataclass(frozen=True)
class OpenAICall:
    """One parsed ``/v1/completions`` or ``/v1/chat/completions`` call."""

    request: gpb.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool  # only ever True when streaming
    n: int  # completions to generate (OpenAI ``n``)
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for
    echo: bool = False  # completions: the prompt comes first in the text (and the logprobs)
    tools: ToolUse | None = None  # chat: the tools offered and how their calls are parsed


def completion_call(body: dict[str, Any], request_id: str) -> OpenAICall:
    """A ``/v1/completions`` body: ``prompt`` is a string, a list of one string, or token ids."""
    refuse_tools(body)
    req = gpb.GenerateRequest(request_id=request_id, sampling=sampling(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt (a one-token prompt stays token ids)
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        req.token_ids.ids.extend(prompt)
    else:
        raise BadRequest("'prompt' must be a string (or a list of token ids)")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest("'echo' must be a boolean")
    logprobs = _int(body, "logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        _ask_logprobs(req.sampling, logprobs, prompt=bool(echo))
    return _call(body, req, chat=False, logprobs=logprobs, echo=bool(echo))


def chat_call(body: dict[str, Any], request_id: str,
              template: ChatTemplate | None = None) -> OpenAICall:
    """A ``/v1/chat/completions`` body: ``messages`` rendered with ``template`` (the served
    checkpoint's; None means the built-in ChatML), with their images and videos, offering the
    body's ``tools`` (:mod:`router.openai_tools`); ``tool_choice`` ``required`` or a named
    function sets the grammar that enforces it."""
    tools = tool_use(body)
    chat = chat_prompt(body.get("messages"), template, tools.tools)
    req = gpb.GenerateRequest(request_id=request_id, text=chat.text,
                              images=[gpb.Image(encoded=im) for im in chat.images],
                              videos=chat.videos, sampling=sampling(body))
    grammar = tools.grammar()
    if grammar is not None:
        req.sampling.structured_output.CopyFrom(grammar)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("'logprobs' must be a boolean")
    top = _int(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if top is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true")
    logprobs = (top or 0) if wanted else None
    if logprobs is not None:
        _ask_logprobs(req.sampling, logprobs, prompt=False)
    return replace(_call(body, req, chat=True, logprobs=logprobs), tools=tools)


# Fields that change what a request produces and that the door does not honour yet: refused by
# name rather than ignored, so no client gets unconstrained output it did not ask for. Each maps
# to the values that mean "off". (OpenAI's legacy ``functions``/``function_call`` stay refused:
# chat takes ``tools``/``tool_choice``, :mod:`router.openai_tools`.)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "suffix": (None, ""), "prompt_logprobs": (None,),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A :class:`BadRequest` naming the first field of :data:`UNSUPPORTED` the body sets to
    something other than "off", and for ``best_of`` above ``n``."""
    for key, off in UNSUPPORTED.items():
        if body.get(key) not in off:
            raise BadRequest(f"'{key}' is not supported by this server yet")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise BadRequest("'best_of' is not supported (use 'n')")


def _ask_logprobs(out: gpb.SamplingParams, top: int, *, prompt: bool) -> None:
    """Ask for each token's log-probability with ``top`` alternatives (and the prompt's too)."""
    out.logprobs = True
    out.top_logprobs = top
    if prompt:
        out.prompt_logprobs = top


def _call(body: dict[str, Any], req: gpb.GenerateRequest, *, chat: bool,
          logprobs: int | None = None, echo: bool = False) -> OpenAICall:
    refuse_unsupported(body)
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = stream and bool(options.get("include_usage"))
    return OpenAICall(req, chat, stream, include_usage, choices(body), logprobs, echo)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat body's prompt: the rendered text, and its images and videos in message order (the
    order in which the template writes their placeholders)."""

    text: str
    images: list[bytes]
    videos: list[gpb.Video]


def chat_prompt(messages: Any, template: ChatTemplate | None = None,
                tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
    """``messages`` rendered with ``template`` (None: the built-in ChatML), offering ``tools``
    (checked ones: :func:`router.openai_tools.tool_use`; None for none).

    Every message needs a string ``role`` (passed through as written, as are its other keys);
    its ``content`` is a string, null, or a list of parts: ``text``, ``image_url`` (a data URL)
    and ``video`` (``{"type": "video", "video": [frame data URLs, in time order], "fps": ...}``,
    ``fps`` optional). The template sees ``{"type": "image"}`` and ``{"type": "video"}`` parts
    and places their placeholders; an assistant message's ``tool_calls`` reach it with each
    call's ``arguments`` as a JSON value rather than its text (:func:`history_calls`). A template
    that refuses the messages is a BadRequest.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    images: list[bytes] = []
    videos: list[gpb.Video] = []
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = _content(msg.get("content"), f"messages[{i}]", images, videos)
        turn = {**msg, "content": content}
        if msg.get("tool_calls") is not None:  # past calls, as vLLM hands them to templates
            turn["tool_calls"] = history_calls(msg["tool_calls"], f"messages[{i}]") or None
            turn["content"] = "" if content is None else content
        turns.append(turn)
    try:
        text = (template or _CHATML).render(turns, tools=tools)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc)) from exc
    return ChatPrompt(text, images, videos)


def _content(content: Any, where: str, images: list[bytes],
             videos: list[gpb.Video]) -> str | list[dict[str, str]] | None:
    """One message's content in the template's form; appends its images and videos."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        here = f"{where}.content[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            images.append(_data_url(part.get("image_url"), here))
            parts.append({"type": "image"})
        elif kind == "video":
            videos.append(_video(part, here))
            parts.append({"type": "video"})
        else:
            raise BadRequest(f"{here}: parts must be of type 'text' (with a string 'text'), "
                             "'image_url' or 'video'")
    return parts


def _video(part: dict[str, Any], where: str) -> gpb.Video:
    """A ``video`` part: its frames (image data URLs) and optional ``fps`` (> 0; unset means the
    video processor's default)."""
    frames = part.get("video")
    if not isinstance(frames, list) or not frames:
        raise BadRequest(f"{where}: 'video' must be a non-empty list of frame data URLs")
    fps = part.get("fps")
    if fps is None:
        fps = 0.0
    elif isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps < math.inf:
        raise BadRequest(f"{where}: 'fps' must be a positive number")
    data = [_data_url(f, f"{where}.video[{k}]") for k, f in enumerate(frames)]
    return gpb.Video(frames=gpb.VideoFrames(frames=data, fps=float(fps)))


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
    """OpenAI sampling fields (and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``) and the
    structured-output fields (:mod:`router.openai_structured`) -> ``SamplingParams``; their
    ranges are the validator's. A field the body leaves out stays unset,
    so the checkpoint's generation_config.json default applies (the door supplies OpenAI's
    temperature 1 when the checkpoint has none). ``stop`` strings travel in the message."""
    out = gpb.SamplingParams()
    max_tokens = _int(body, "max_completion_tokens", "max_tokens")
    if max_tokens is not None:
        if not 1 <= max_tokens < 1 << 32:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}")
        out.max_new_tokens = max_tokens
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty"):
        value = _number(body, key)
        if value is not None:
            setattr(out, key, value)
    if out.HasField("top_p") and out.top_p <= 0:
        raise BadRequest(f"top_p must be in (0, 1], got {out.top_p}")
    top_k = _int(body, "top_k")  # vLLM extension; -1 (or 0) means off
    if top_k is not None:
        out.top_k = max(top_k, 0)
    seed = _int(body, "seed")
    if seed is not None:
        out.seed = door_seed(seed)
    if body.get("ignore_eos"):
        out.ignore_eos = True
    out.stop.extend(stops(body))
    out.logit_bias.update(logit_bias(body))
    grammar = structured_output(body)
    if grammar is not None:
        out.structured_output.CopyFrom(grammar)
    return out


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """``logit_bias``: an object from token ids (JSON keys: strings of integers) to numbers; the
    ranges (ids in the vocabulary, biases in [-100, 100]) are the validator's."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must be an object from token ids to biases")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < 1 << 32:
            raise BadRequest(f"'logit_bias' keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise BadRequest(f"'logit_bias' of token {key} must be a number")
        out[token] = float(bias)
    return out


def door_seed(seed: int) -> int:
    """Any integer ``seed`` (OpenAI's is any integer) as one the engine takes: reduced modulo
    ``MAX_SEED + 1`` (2**63), so ``-1`` is ``MAX_SEED`` and ``MAX_SEED + 1`` is 0."""
    return seed % (MAX_SEED + 1)


def choices(body: dict[str, Any]) -> int:
    """``n``: how many completions to generate, 1 to :data:`MAX_N` (default 1)."""
    n = _int(body, "n")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be in [1, {MAX_N}], got {n}")
    return n


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
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
