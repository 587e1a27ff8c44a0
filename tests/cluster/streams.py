"""A ``Generate`` call read on a background thread, and polling with a deadline: what the fault,
fault-injection and cancel-storm tests use to hold streams open while they act on the nodes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc

TIMEOUT_S = 120.0


class Stream:
    """One ``Generate`` call read on a thread: its tokens, whether the last message said
    ``finished``, the error that ended it and when it ended (``time.monotonic``; 0 while open)."""

    def __init__(self, stub: generate_pb2_grpc.GenerationStub, req: gpb.GenerateRequest,
                 timeout_s: float = TIMEOUT_S) -> None:
        self.tokens: list[int] = []
        self.finished = False
        self.usage = gpb.Usage()  # of the last message, once it said finished
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.call = stub.Generate(req, timeout=timeout_s)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for msg in self.call:
                self.tokens.extend(msg.token_ids)
                if msg.finished:
                    self.finished = True
                    self.usage = msg.usage
        except grpc.RpcError as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def cancel(self) -> Stream:
        """Cancel, wait for the end, and check the call ended CANCELLED."""
        assert self.running, f"the stream ended before it was cancelled: {self.error}"
        self.call.cancel()
        self.join()
        assert self.error is not None and self.error.code() == grpc.StatusCode.CANCELLED, \
            self.error
        return self

    def join(self, timeout_s: float = TIMEOUT_S) -> Stream:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"
        return self


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``cond`` every 5 ms; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
