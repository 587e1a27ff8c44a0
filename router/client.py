"""A client of the public API (``pdserve.v1.Generation``) that knows several routers and fails
over between them; ``pdserve client --target A,B`` uses it.

Routers are independent front doors over the same workers (``docs/deploy.md``, "Two routers"),
so any of them serves any request. :class:`RouterClient` keeps one channel per address and sends
each call to the first address of its order. A call that fails ``UNAVAILABLE`` (the router is
down, unreachable, went away mid-call, or has no usable worker) moves that address to the end of
the order and goes to the next one, ``attempts`` tries in all (default 3), all within the call's
one ``timeout``. An address is tried again in the same call only after a pause (``retry_pause_s``,
doubling): that is how one address in front of several routers (a Kubernetes Service) reaches
a live one once the dead one left it. Any other status ends the call as it is
(``RESOURCE_EXHAUSTED`` from a full router included: it is backpressure for the caller).

``Generate``: a stream that fails before its first message is simply sent again. One that fails
after tokens arrived is *replayed* only when its output is pinned (:func:`replayable`: greedy,
or seeded): the next router runs the same request (same request id: the client sets one when the
request has none) from the start, and the client checks that the replayed tokens equal the ones
the caller already has and drops them (with their text, log-probabilities and the prompt's
log-probabilities), so the caller sees one stream. A replay that differs raises
:class:`ReplayMismatch`. A stream that is not pinned re-raises its ``UNAVAILABLE``: its tokens
cannot be reproduced, and the caller decides.

A router that dies takes its calls to the workers with it (its connections close; with keepalive,
also when its host vanishes), and the workers free what those rooms held, so a replay holds the
request's pages on the workers once, not twice.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from serving.auth import Metadata
from serving.keepalive import DEFAULT_KEEPALIVE

ChannelOptions = Sequence[tuple[str, Any]]
ATTEMPTS = 3  # tries of one call, over every address in turn
RETRY_PAUSE_S = 0.5  # before an address is tried again in the same call; doubles each time


def replayable(sampling: gpb.SamplingParams) -> bool:
    """Whether a request's output is pinned, so that running it again reproduces the tokens
    already streamed: greedy (``temperature`` set to 0) or seeded (``seed`` set). An unset
    temperature takes the checkpoint's default, which the client cannot see: not pinned."""
    greedy = sampling.HasField("temperature") and sampling.temperature == 0
    return greedy or sampling.HasField("seed")


class ReplayMismatch(grpc.RpcError):
    """A stream replayed on another router after its router failed did not reproduce the tokens
    the caller already had; the call ends with the original failure's status."""

    def __init__(self, cause: grpc.RpcError, details: str) -> None:
        super().__init__(details)
        self._code = _code(cause)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class RouterClient:
    """Calls to the routers at ``targets`` (``HOST:PORT`` each), failing over in order (see the
    module docstring). ``root_cert``: connect over TLS with this CA; ``metadata`` goes with every
    call (a bearer token); ``options``: of every channel, over the default gRPC keepalive
    (:mod:`serving.keepalive`: a router that vanished is found within about 10 s), whose
    options they may change; ``attempts`` and ``retry_pause_s``: how
    often one call tries and how long it pauses before an address it tried already.
    Thread-safe; close it (or use it as a context manager) to close the channels."""

    def __init__(self, targets: Sequence[str], *, root_cert: bytes | None = None,
                 metadata: Metadata = (), options: ChannelOptions = (),
                 attempts: int = ATTEMPTS, retry_pause_s: float = RETRY_PAUSE_S) -> None:
        if not targets:
            raise ValueError("give at least one router address")
        if attempts < 1 or retry_pause_s < 0:
            raise ValueError("attempts must be at least 1 and retry_pause_s at least 0")
        self.attempts, self.retry_pause_s = attempts, retry_pause_s
        self._order = list(dict.fromkeys(targets))
        self._root_cert = root_cert
        self._metadata = metadata
        self._options = list({**dict(DEFAULT_KEEPALIVE.channel_options()),
                              **dict(options)}.items())
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    @property
    def order(self) -> list[str]:
        """The addresses in the order the next call tries them."""
        with self._lock:
            return list(self._order)

    def generate(self, request: gpb.GenerateRequest,
                 timeout: float | None = None) -> Iterator[gpb.GenerateResponse]:
        """``Generate``'s messages, across routers (see the module docstring); raises
        ``grpc.RpcError`` when the call fails for good. ``timeout`` (seconds) bounds the whole
        call, failovers included. Closing the iterator early cancels the call."""
        req = gpb.GenerateRequest()
        req.CopyFrom(request)
        if not req.request_id:  # every attempt runs under one id
            req.request_id = uuid.uuid4().hex
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = _Delivered()
        failure: grpc.RpcError | None = None
        for target in self._attempts(deadline):
            call = self._stub(target).Generate(req, timeout=_left(deadline),
                                               metadata=self._metadata)
            try:
                for msg in call:
                    out = seen.take(msg, failure)
                    if out is not None:
                        yield out
                return
            except grpc.RpcError as exc:
                if isinstance(exc, ReplayMismatch) or _code(exc) != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._demote(target)
                if seen.tokens and not replayable(req.sampling):
                    raise
                failure = exc
                seen.replay()
            finally:
                call.cancel()
        assert failure is not None  # every address tried ended in one
        raise failure

    def model_info(self, timeout: float | None = None) -> gpb.ModelInfo:
        """``GetModelInfo`` of the first router that answers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failure: grpc.RpcError | None = None
        for target in self._attempts(deadline):
            try:
                info: gpb.ModelInfo = self._stub(target).GetModelInfo(
                    gpb.GetModelInfoRequest(), timeout=_left(deadline), metadata=self._metadata)
                return info
            except grpc.RpcError as exc:
                if _code(exc) != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._demote(target)
                failure = exc
        assert failure is not None  # every address tried ended in one
        raise failure

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _attempts(self, deadline: float | None) -> Iterator[str]:
        """The address of each try of one call: round the order as it stands at each try,
        :attr:`attempts` in all; one tried already in this call only after a pause (doubling
        from :attr:`retry_pause_s`), and none once the pause would outlast ``deadline``."""
        tried: set[str] = set()
        pause = self.retry_pause_s
        for _ in range(self.attempts):
            order = self.order
            target = next((t for t in order if t not in tried), order[0])
            if target in tried:
                left = _left(deadline)
                if left is not None and left <= pause:
                    return
                time.sleep(pause)
                pause *= 2
            tried.add(target)
            yield target

    def _stub(self, target: str) -> generate_pb2_grpc.GenerationStub:
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = self._channels[target] = self._channel(target)
        return generate_pb2_grpc.GenerationStub(channel)

    def _channel(self, target: str) -> grpc.Channel:
        if self._root_cert is None:
            return grpc.insecure_channel(target, options=self._options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self._root_cert)
        return grpc.secure_channel(target, credentials, options=self._options)

    def _demote(self, target: str) -> None:
        """``target`` failed: the next calls try it last."""
        with self._lock:
            if target in self._order:
                self._order.remove(target)
                self._order.append(target)


class _Delivered:
    """What the caller of one ``Generate`` already has, and the replay that catches up with it:
    a replayed message's tokens (and their text) up to what was delivered are checked and
    dropped."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # every token the caller was given
        self.text_len = 0  # characters of text the caller was given
        self.messages = 0
        self._replaying = False
        self._tokens_seen = 0  # tokens of the replay so far
        self._text_seen = 0  # characters of the replay's text so far

    def replay(self) -> None:
        """The stream starts over on another router."""
        self._replaying = self.messages > 0
        self._tokens_seen = self._text_seen = 0

    def take(self, msg: gpb.GenerateResponse,
             failure: grpc.RpcError | None) -> gpb.GenerateResponse | None:
        """The message to give the caller for ``msg`` (None: nothing new in it); raises
        :class:`ReplayMismatch` (with ``failure``, the error that started the replay) when a
        replayed token differs from the delivered one."""
        if self._replaying:
            out = self._catch_up(msg, failure)
            if out is None:
                return None
        else:
            out = msg
        self.messages += 1
        self.tokens.extend(out.token_ids)
        self.text_len += len(out.text)
        return out

    def _catch_up(self, msg: gpb.GenerateResponse,
                  failure: grpc.RpcError | None) -> gpb.GenerateResponse | None:
        assert failure is not None
        start, ids = self._tokens_seen, list(msg.token_ids)
        known = max(0, min(len(ids), len(self.tokens) - start))
        if ids[:known] != self.tokens[start:start + known] or \
                (msg.finished and start + len(ids) < len(self.tokens)):
            raise ReplayMismatch(failure, f"{_details(failure)}; the stream was replayed on "
                                 "another router, whose tokens differ from those already "
                                 f"received (from token {start})")
        skip_text = max(0, min(len(msg.text), self.text_len - self._text_seen))
        self._tokens_seen += len(ids)
        self._text_seen += len(msg.text)
        self._replaying = self._tokens_seen < len(self.tokens) or \
            self._text_seen < self.text_len
        out = gpb.GenerateResponse()
        out.CopyFrom(msg)
        out.ClearField("prompt_logprobs")  # the caller has the prompt's, from the first message
        out.ClearField("prompt_top_logprobs")
        out.ClearField("prompt_token_ids")
        del out.token_ids[:known]
        if len(msg.logprobs) == len(ids):
            del out.logprobs[:known]
        if len(msg.top_logprobs) == len(ids):
            del out.top_logprobs[:known]
        out.text = msg.text[skip_text:]
        if not (out.token_ids or out.text or out.finished):
            return None
        return out


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _code(exc: grpc.RpcError) -> grpc.StatusCode:
    code = getattr(exc, "code", None)
    return code() if callable(code) else grpc.StatusCode.UNKNOWN


def _details(exc: grpc.RpcError) -> str:
    details = getattr(exc, "details", None)
    return str(details()) if callable(details) else str(exc)
