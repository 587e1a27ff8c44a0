"""Requests that do not parse as their protobuf end ``INVALID_ARGUMENT`` with the parser's reason.

grpc itself parses a request before the servicer runs and answers a parse failure with
``UNKNOWN``; :class:`ParseInterceptor` moves the parse into the handler instead (the handler
receives the raw bytes), so a malformed message is the caller's error, said as such. Applies to
unary-request methods (every method of ours); streaming-request methods are left to grpc.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, cast

import grpc

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
Parse = Callable[[bytes], Any]
# grpc's stubs type a handler's behaviours as the synchronous server calls them; under grpc.aio
# a unary one is a coroutine function, a streaming one an async generator function or a coroutine
# function that writes with ``context.write``.
AioUnary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
AioStream = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None] | Awaitable[None]]


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Parses unary requests inside the handler: ``INVALID_ARGUMENT`` when they do not parse."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _parsing(handler, handler.request_deserializer, handler_call_details.method or "")


async def _parse(parse: Parse, raw: bytes, context: grpc.aio.ServicerContext,
                 method: str) -> Any:
    try:
        return parse(raw)
    except Exception as exc:  # noqa: BLE001 - any parser failure is a malformed request
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method}: malformed request ({len(raw)} bytes): {exc}")


def _parsing(handler: grpc.RpcMethodHandler, parse: Parse, method: str
             ) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes and parsing them itself with ``parse``."""
    ser = handler.response_serializer
    if handler.response_streaming:
        inner_stream = cast(AioStream, handler.unary_stream)

        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await _parse(parse, raw, context, method)
            result = inner_stream(request, context)
            if not isinstance(result, AsyncIterable):  # a servicer that writes with context.write
                await result
                return
            async with aclosing(result) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(stream, None, ser)
    inner_unary = cast(AioUnary, handler.unary_unary)

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await inner_unary(await _parse(parse, raw, context, method), context)

    return grpc.unary_unary_rpc_method_handler(unary, None, ser)
