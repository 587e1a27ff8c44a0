"""What the router does when a request's workers fail: run the prompt again on a prefill, let
the decode compute it itself, or move the stream to another decode, so that the client sees one
uninterrupted stream.

A failure is *recoverable* when it is the path's fault, not the request's: a worker call that
ended ``UNAVAILABLE``, ``ABORTED``, ``INTERNAL``, ``UNKNOWN``, ``DATA_LOSS`` or ``CANCELLED`` (a
transfer that failed or timed out, a worker that died, shut down or closed its stream early),
while the request's own deadline has time left. ``CANCELLED`` is always the worker's side: the
router's own cancels (a closed room, a client gone) end its calls with ``asyncio.CancelledError``,
never with that status, and an aborted room is never recovered. Everything else ends the
request with the failure's status, as before: the request's deadline (``DEADLINE_EXCEEDED``), a
refusal of the request itself (``INVALID_ARGUMENT``, ``FAILED_PRECONDITION`` such as an unpaired
draft), an overloaded worker (``RESOURCE_EXHAUSTED``: backpressure, with its retry hint, for the
client), a credential refusal.

Before the first token (the prompt's KV never arrived, or a worker died meanwhile),
``--kv-failure-policy`` decides:

* ``retry`` (default): run the prompt again on a prefill (a new room; the failed worker sorts
  last while it cools down, :meth:`router.workers.Worker.note_failure`) up to ``--kv-retries``
  times, then let the decode compute the prompt itself;
* ``recompute``: the decode computes the prompt itself at once;
* ``fail``: end the request with the failure.

The same policy covers a request admitted while no prefill is usable: ``retry`` and
``recompute`` prefill it on the decode, ``fail`` refuses it with ``UNAVAILABLE``.

After tokens were streamed (a decode died, or its stream broke, mid-generation), the request is
resubmitted up to ``--decode-failovers`` times (0: never) with the prompt plus the tokens already
streamed as its prompt (``WorkerRequest.resumed_tokens`` says how many of them are output), to
the least loaded decode, through a prefill when the first attempt used one. Greedy output equals
an uninterrupted run. A sampled request continues from the same ``seed`` (its random stream
restarts at the failover, so its tail is a different, equally valid sample than an
uninterrupted run would have drawn).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from router.errors import WorkerFailure

RECOVERABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                         grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED})


class KVFailurePolicy(str, enum.Enum):
    """``--kv-failure-policy``: what a failure before the first token leads to."""

    RETRY = "retry"
    RECOMPUTE = "recompute"
    FAIL = "fail"


@dataclass(frozen=True)
class RecoveryConfig:
    """The router's recovery settings (see the module docstring)."""

    kv_failure_policy: KVFailurePolicy = KVFailurePolicy.RETRY
    kv_retries: int = 2  # prompt re-runs on a prefill before recomputing (policy retry)
    decode_failovers: int = 2  # resubmissions after tokens were streamed; 0: never

    def __post_init__(self) -> None:
        if self.kv_retries < 0 or self.decode_failovers < 0:
            raise ValueError("--kv-retries and --decode-failovers must be >= 0")

    @property
    def local_fallback(self) -> bool:
        """Whether a prompt may be computed on the decode when no prefill is usable."""
        return self.kv_failure_policy is not KVFailurePolicy.FAIL


class Step(enum.Enum):
    """How the next attempt of a failed request runs."""

    PREFILL = "retry"  # the prompt again, on a prefill
    LOCAL = "recompute"  # the prompt on the decode itself
    FAILOVER = "failover"  # prompt + streamed tokens, to another decode


@dataclass
class Recovery:
    """One request's recovery budget; :meth:`next_step` is asked after each failed attempt."""

    config: RecoveryConfig
    kv_retries: int = 0  # PREFILL steps taken
    failovers: int = 0  # LOCAL steps after a local attempt failed, and FAILOVER steps

    def next_step(self, failure: WorkerFailure, streamed: int, local: bool,
                  time_left: float | None) -> Step | None:
        """The next attempt after ``failure``, or None: the request ends with it.

        ``streamed``: tokens the client already has; ``local``: the failed attempt computed
        the prompt on the decode; ``time_left``: of the request's deadline (None: none).
        """
        if failure.code not in RECOVERABLE or (time_left is not None and time_left <= 0):
            return None
        cfg = self.config
        if streamed or local:  # the decode failed: only another decode helps
            if self.failovers >= cfg.decode_failovers:
                return None
            self.failovers += 1
            return Step.FAILOVER if streamed else Step.LOCAL
        if cfg.kv_failure_policy is KVFailurePolicy.FAIL:
            return None
        if cfg.kv_failure_policy is KVFailurePolicy.RETRY and self.kv_retries < cfg.kv_retries:
            self.kv_retries += 1
            return Step.PREFILL
        return Step.LOCAL
