"""The router's recovery rules (:mod:`router.recovery`) and the worker cool-down that keeps a
failed worker from being sticky (:class:`router.workers.Worker`), without processes; the cluster
tests (``tests/cluster/test_failover.py``, ``test_faults.py``, ``test_fault_injection.py``,
``test_soak.py``) run them on real nodes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from engine.text.tokenizer import Tokenizer
from proto.pdserve.v1 import generate_pb2 as gpb
from router.errors import WorkerFailure
from router.recovery import KVFailurePolicy, Recovery, RecoveryConfig, Step
from router.relay import Outgoing, relay
from router.workers import COOLDOWN_BASE_S, COOLDOWN_MAX_S, DECODE, PREFILL, WorkerPool
from tests.router.test_readiness import BOOT, FakeStub, worker

DOWN = WorkerFailure(grpc.StatusCode.UNAVAILABLE, "prefill worker p:1: lost", blame="prefill")


def _steps(policy: KVFailurePolicy, failures: int, *, streamed: int = 0, local: bool = False,
           retries: int = 2, failovers: int = 2) -> list[Step | None]:
    rec = Recovery(RecoveryConfig(policy, retries, failovers))
    steps: list[Step | None] = []
    for _ in range(failures):
        step = rec.next_step(DOWN, streamed, local or steps[-1:] == [Step.LOCAL], None)
        steps.append(step)
    return steps


def test_policy_before_the_first_token() -> None:
    assert _steps(KVFailurePolicy.RETRY, 5) == [Step.PREFILL, Step.PREFILL, Step.LOCAL,
                                                Step.LOCAL, Step.LOCAL]
    assert _steps(KVFailurePolicy.RETRY, 6)[-1] is None  # two local failovers, then the end
    assert _steps(KVFailurePolicy.RETRY, 2, retries=0) == [Step.LOCAL, Step.LOCAL]
    assert _steps(KVFailurePolicy.RECOMPUTE, 1) == [Step.LOCAL]
    assert _steps(KVFailurePolicy.FAIL, 1) == [None]
    assert not RecoveryConfig(KVFailurePolicy.FAIL).local_fallback
    assert RecoveryConfig().local_fallback


def test_after_tokens_only_failovers_and_never_past_the_bound() -> None:
    assert _steps(KVFailurePolicy.FAIL, 3, streamed=5) == [Step.FAILOVER, Step.FAILOVER, None]
    assert _steps(KVFailurePolicy.RETRY, 1, streamed=5, failovers=0) == [None]


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.UNAUTHENTICATED])
def test_refusals_and_deadlines_end_the_request(code: grpc.StatusCode) -> None:
    rec = Recovery(RecoveryConfig())
    assert rec.next_step(WorkerFailure(code, "x", blame="decode"), 0, False, None) is None
    assert rec.next_step(WorkerFailure(code, "x", blame="decode"), 3, False, None) is None


def test_a_call_the_worker_cancelled_is_recovered() -> None:
    """A worker's side ended the call CANCELLED (seen once in a fresh-clone run: a prefill
    whose TP rank died ended itself, and the router handed the client that CANCELLED)."""
    cancelled = WorkerFailure(grpc.StatusCode.CANCELLED, "prefill worker p:1: CANCELLED",
                              blame="prefill")
    rec = Recovery(RecoveryConfig())
    assert rec.next_step(cancelled, 0, False, None) is Step.PREFILL
    assert rec.next_step(cancelled, 4, False, None) is Step.FAILOVER


def test_the_routers_own_cancels_never_reach_recovery() -> None:
    """Recovering ``CANCELLED`` relies on this: a call the router cancels (``call.cancel()``, as
    closing a room does, or by closing its channel; a cancelled task raises CancelledError by
    asyncio's own rule) raises ``asyncio.CancelledError`` in the router, never an
    ``AioRpcError`` with that status. Checked against a real server on loopback, unary and
    streaming calls."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    class Slow(health_pb2_grpc.HealthServicer):
        async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802
            await asyncio.sleep(30)

        async def Watch(self, request: Any, context: Any) -> Any:  # noqa: N802
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            await asyncio.sleep(30)

    async def outcome(call: Any, stream: bool) -> str:
        try:
            if stream:
                async for _ in call:
                    pass
            else:
                await call
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        except asyncio.CancelledError:
            return "CancelledError"
        return "ended"

    async def main() -> list[str]:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        got = []
        try:
            for stream in (False, True):
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
                stub = health_pb2_grpc.HealthStub(channel)
                req = health_pb2.HealthCheckRequest()
                call = stub.Watch(req) if stream else stub.Check(req)
                task = asyncio.create_task(outcome(call, stream))
                await asyncio.sleep(0.2)
                call.cancel()
                got.append(await asyncio.wait_for(task, 5))
                call = stub.Watch(req) if stream else stub.Check(req)
                task = asyncio.create_task(outcome(call, stream))
                await asyncio.sleep(0.2)
                await channel.close()
                got.append(await asyncio.wait_for(task, 5))
        finally:
            await server.stop(0)
        return got

    assert asyncio.run(main()) == ["CancelledError"] * 4


def test_an_expired_deadline_ends_the_request() -> None:
    rec = Recovery(RecoveryConfig())
    assert rec.next_step(DOWN, 0, False, 0.0) is None
    assert rec.next_step(DOWN, 0, False, 1.5) is Step.PREFILL


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="--kv-retries"):
        RecoveryConfig(kv_retries=-1)


def test_cooldown_doubles_per_fault_and_ends_on_success() -> None:
    a, b = worker("d:1", DECODE, True), worker("d:2", DECODE, True)
    a.running, b.running = 0, 5  # a is the less loaded one
    assert WorkerPool.pick([a, b]) is a
    a.note_failure("stream broke")
    assert a.cooling and a.suspect and a.failures == 1
    assert WorkerPool.pick([a, b]) is b  # cooling sorts after a busier healthy worker
    first = a.cooldown_until - time.monotonic()
    assert COOLDOWN_BASE_S - 0.1 < first <= COOLDOWN_BASE_S
    a.note_failure("the same fault, another request")  # while cooling: no escalation
    assert a.failures == 1
    a.cooldown_until = 0.0  # the cool-down has passed
    assert WorkerPool.pick([a, b]) is a  # used again
    a.note_failure("again")
    assert a.failures == 2 and a.cooldown_until - time.monotonic() > COOLDOWN_BASE_S * 1.5
    for _ in range(10):
        a.cooldown_until = 0.0
        a.note_failure("and again")
    assert a.cooldown_until - time.monotonic() <= COOLDOWN_MAX_S
    a.note_success()
    assert not a.cooling and a.failures == 0
    assert WorkerPool.pick([a, b]) is a


def test_a_suspect_worker_is_asked_before_its_next_request() -> None:
    async def main() -> None:
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"])
        p = FakeStub(BOOT)
        p.up = True
        w = pool.prefill[0]
        w.stub = cast(Any, p)
        await pool.refresh()
        assert w.healthy and not w.suspect
        p.calls.clear()
        await pool.ensure(w)
        assert p.calls == []  # healthy and trusted: nothing to ask
        w.note_failure("transfer failed")
        p.up = False  # it died meanwhile: the probe finds out before a request is sent
        await pool.ensure(w)
        assert p.calls == [True] and not w.healthy
        p.up = True  # back: the next probe clears it
        await pool.ensure(w)
        assert w.healthy and not w.suspect and w.kind == PREFILL
        await pool.close()

    asyncio.run(main())


class _Attempt:
    """What the relay uses of a RoomRun: a queue fed with one attempt's worker messages, then
    a failure (or nothing: the attempt's last message is the final one)."""

    def __init__(self, msgs: list[gpb.GenerateResponse], failure: WorkerFailure | None) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.aborted = False
        self.scores_due = False  # the prompt's log-probabilities are not asked for
        self.decode = SimpleNamespace(address="d")
        for m in msgs:
            self.queue.put_nowait(m)
        if failure is not None:
            self.queue.put_nowait(failure)

    def close(self) -> None:
        raise AssertionError("no stop string here: the relay never closes the run")


def test_one_outgoing_stream_across_attempts(tiny_dir: Path) -> None:
    """A decode fails after some tokens; the next attempt's tokens continue the same client
    stream: text decoded across the seam, usage of the whole request."""
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok is not None
    ids = tok.encode("alpha beta gamma delta epsilon")
    cut = len(ids) // 2
    first = _Attempt([gpb.GenerateResponse(token_ids=[t]) for t in ids[:cut]], DOWN)
    rest = [gpb.GenerateResponse(token_ids=[t]) for t in ids[cut:]]
    rest[-1].finished, rest[-1].finish_reason = True, "length"
    rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens = 7 + cut, len(ids) - cut
    second = _Attempt(rest, None)

    async def go() -> list[gpb.GenerateResponse]:
        out = Outgoing("r", [0] * 7, tok.detokenizer(), False, ())
        msgs = []
        with pytest.raises(WorkerFailure):
            async for m in relay(cast(Any, first), out):
                msgs.append(m)
        assert out.token_ids == ids[:cut]  # what a failover resubmits after the prompt
        msgs += [m async for m in relay(cast(Any, second), out)]
        return msgs

    msgs = asyncio.run(go())
    assert [t for m in msgs for t in m.token_ids] == ids
    assert "".join(m.text for m in msgs) == tok.decode(ids)
    assert msgs[-1].finished and (msgs[-1].usage.prompt_tokens,
                                  msgs[-1].usage.completion_tokens) == (7, len(ids))


def test_speculative_counts_add_up_across_attempts() -> None:
    """Each decode message carries its attempt's running drafted/accepted counts; the client's
    usage adds the failed attempt's last report to the next attempt's final one."""
    def msg(token: int, drafted: int, accepted: int) -> gpb.GenerateResponse:
        m = gpb.GenerateResponse(token_ids=[token])
        m.usage.drafted_tokens, m.usage.accepted_tokens = drafted, accepted
        return m

    first = _Attempt([msg(1, 0, 0), msg(2, 4, 3), msg(3, 8, 5)], DOWN)
    rest = [msg(4, 0, 0), msg(5, 4, 4)]
    rest[-1].finished, rest[-1].finish_reason = True, "length"
    second = _Attempt(rest, None)

    async def go() -> list[gpb.GenerateResponse]:
        out = Outgoing("r", [0] * 7, None, False, ())
        msgs = []
        with pytest.raises(WorkerFailure):
            async for m in relay(cast(Any, first), out):
                msgs.append(m)
        return msgs + [m async for m in relay(cast(Any, second), out)]

    msgs = asyncio.run(go())
    assert [t for m in msgs for t in m.token_ids] == [1, 2, 3, 4, 5]
    usage = msgs[-1].usage
    assert (usage.drafted_tokens, usage.accepted_tokens) == (8 + 4, 5 + 4)
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 5)
    assert all(not m.HasField("usage") for m in msgs[:-1])  # the client's usage comes last
