"""A stage's link to the next stage of a pipeline: announcements, aborts, steps and the gate.

Every message to the next stage is one ``PipelineStage.RunStep`` call, made synchronously from
the stage's loop thread: rooms announced since the last call, rooms given up since then, and the
step's items with their hidden states. The reply says which rooms are ready on every later
stage (their destination arrived there), which failed there, and the sampled first tokens.

Invariant: a room is in exactly one of "pending announcement", "announced", or neither; an
abort of an announced room is delivered with the next call, and a room reported failed by the
next stage is forgotten (the next stage has already released it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from proto.convert import ConversionError
from proto.pdserve.v1 import worker_pb2 as wpb
from proto.pdserve.v1 import worker_pb2_grpc
from serving.auth import Metadata
from serving.keepalive import DEFAULT_KEEPALIVE, Keepalive
from serving.server import SERVER_OPTIONS

GATE_POLL_S = 0.005  # how often a stage asks the next one about rooms it is waiting for
STEP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class StepReply:
    samples: list[tuple[int, float]]  # one per item with needs_sample, in item order
    failed: list[tuple[int, str]]  # announced rooms a later stage failed (room, reason)


def pack_step_tensors(hidden: torch.Tensor, mrope: torch.Tensor) -> tuple[bytes, bytes]:
    """``[T, H]`` hidden states as float32 bytes and ``[3, T]`` positions as int64 bytes."""
    h = hidden.detach().to(device="cpu", dtype=torch.float32).contiguous()
    m = mrope.detach().to(device="cpu", dtype=torch.int64).contiguous()
    return h.numpy().tobytes(), m.numpy().tobytes()


def unpack_step_tensors(step: wpb.StageStep, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_step_tensors` (float32 ``[T, H]``, int64 ``[3, T]``); raises
    ``ConversionError`` when the tensors do not match the step's items."""
    t = sum(it.num_tokens for it in step.items)
    hidden = torch.frombuffer(bytearray(step.hidden), dtype=torch.float32)
    mrope = torch.frombuffer(bytearray(step.mrope_positions), dtype=torch.int64)
    if hidden.numel() != t * hidden_size or mrope.numel() != 3 * t:
        raise ConversionError(f"step tensors do not match its {t} tokens")
    return hidden.view(t, hidden_size), mrope.view(3, t)


class NextStageLink:
    """The next stage, as seen by the stage before it. Not thread-safe: one thread uses it (the
    first stage's loop thread, or a later stage's ``RunStep`` under its lock)."""

    def __init__(self, address: str, metadata: Metadata = (),
                 keepalive: Keepalive = DEFAULT_KEEPALIVE) -> None:
        self.address = address
        self._metadata = metadata  # the internal token, when the cluster has one
        self._channel = grpc.insecure_channel(
            address, options=[*SERVER_OPTIONS[:2], *keepalive.channel_options()])
        self._stub = worker_pb2_grpc.PipelineStageStub(self._channel)
        self._new: dict[int, wpb.StageRoom] = {}
        self._aborted: list[wpb.StageAbort] = []
        self._announced: set[int] = set()
        self._ready: set[int] = set()
        self._last_call = 0.0

    def describe(self, timeout_s: float = 120.0) -> wpb.StageInfo:
        """The next stage's place and bootstrap addresses, waiting for it to come up."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._stub.Describe(wpb.DescribeStageRequest(), timeout=5.0,
                                           metadata=self._metadata)
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def close(self) -> None:
        self._channel.close()

    def announce(self, room: wpb.StageRoom) -> None:
        self._new[room.room] = room

    def abort(self, room: int, reason: str) -> None:
        """Tell the next stage (with the next call) that ``room`` is given up."""
        if self._new.pop(room, None) is None and room in self._announced:
            self._aborted.append(wpb.StageAbort(room=room, reason=reason))
        self.forget(room)

    def forget(self, room: int) -> None:
        """Drop a room the next stage has finished with."""
        self._announced.discard(room)
        self._ready.discard(room)

    @property
    def has_news(self) -> bool:
        """Announcements or aborts wait for the next call."""
        return bool(self._new or self._aborted)

    def is_ready(self, room: int) -> bool:
        return room in self._ready

    def poll_due(self, waiting: bool) -> bool:
        """Whether a call without items is due: news to deliver, or rooms waiting at the gate
        (rate-limited to one call per ``GATE_POLL_S``)."""
        if self.has_news:
            return True
        return waiting and time.monotonic() - self._last_call >= GATE_POLL_S

    def step(
        self, items: Sequence[wpb.StageItem] = (), hidden: bytes = b"", mrope: bytes = b"",
        aux: bytes = b"",
    ) -> StepReply:
        """One ``RunStep`` call (``aux``: :mod:`prefill_node.pipeline.aux_layers`); raises
        ``grpc.RpcError`` when the next stage fails or is gone (pending news is dropped then:
        the caller fails every room)."""
        msg = wpb.StageStep(new_rooms=list(self._new.values()), aborted=self._aborted,
                            items=list(items), hidden=hidden, mrope_positions=mrope, aux=aux)
        self._announced.update(self._new)
        self._new, self._aborted = {}, []
        self._last_call = time.monotonic()
        reply = self._stub.RunStep(msg, timeout=STEP_TIMEOUT_S, metadata=self._metadata)
        self._ready.update(r for r in reply.ready if r in self._announced)
        failed = [(f.room, f.reason) for f in reply.failed if f.room in self._announced]
        for room, _ in failed:
            self.forget(room)
        return StepReply([(s.token, s.logprob) for s in reply.samples], failed)
