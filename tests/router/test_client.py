"""The multi-router client (:mod:`router.client`) against fake routers in this process: failover
before the first message, the replay of a pinned stream after its router failed mid-stream
(tokens, text and log-probabilities checked and dropped, whatever the batching), the refusal to
replay an unpinned stream, a replay that diverges, statuses that do not fail over."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from router.client import ReplayMismatch, RouterClient, replayable
from serving.keepalive import DEFAULT_KEEPALIVE
from tests.cluster.harness import free_port

TOKENS = list(range(100, 112))


@dataclass
class Script:
    """What a fake router streams: ``tokens`` in messages of ``per_message``, failing with
    ``fail`` after ``fail_after`` messages (None: never), or refusing at once with ``refuse``."""

    tokens: list[int] = field(default_factory=lambda: list(TOKENS))
    per_message: int = 1
    fail_after: int | None = None
    fail: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    refuse: grpc.StatusCode | None = None
    refusals: int = 1_000_000  # how many calls it refuses before it serves
    requests: list[gpb.GenerateRequest] = field(default_factory=list)


def text(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


class FakeRouter(generate_pb2_grpc.GenerationServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    def Generate(self, request, context):  # noqa: N802
        s = self.script
        s.requests.append(request)
        if s.refuse is not None and len(s.requests) <= s.refusals:
            context.abort(s.refuse, "refused")
        chunks = [s.tokens[i:i + s.per_message] for i in range(0, len(s.tokens), s.per_message)]
        for n, ids in enumerate(chunks):
            if n == s.fail_after:
                context.abort(s.fail, "router going away")
            last = n == len(chunks) - 1
            msg = gpb.GenerateResponse(request_id=request.request_id, token_ids=ids,
                                       text=text(ids), logprobs=[-float(i) for i in ids],
                                       finished=last, finish_reason="length" if last else "")
            if n == 0:
                msg.prompt_token_ids.extend([1, 2, 3])
                msg.prompt_logprobs.extend([-0.5, -0.25])
            if last:
                msg.usage.completion_tokens = len(s.tokens)
            yield msg

    def GetModelInfo(self, request, context):  # noqa: N802
        if self.script.refuse is not None:
            context.abort(self.script.refuse, "refused")
        return gpb.ModelInfo(model_type="fake")


@pytest.fixture
def routers() -> Iterator[tuple[list[str], list[Script]]]:
    """Two fake routers and one address nothing listens on (first in the list)."""
    scripts = [Script(), Script()]
    servers = []
    addresses = [f"127.0.0.1:{free_port()}"]
    for script in scripts:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        generate_pb2_grpc.add_GenerationServicer_to_server(FakeRouter(script), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield addresses, scripts
    for server in servers:
        server.stop(0)


def greedy() -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 2, 3]),
                               sampling=gpb.SamplingParams(temperature=0, logprobs=True))


def collect(client: RouterClient, req: gpb.GenerateRequest) -> list[gpb.GenerateResponse]:
    return list(client.generate(req, timeout=10))


def test_a_router_that_is_down_hands_the_call_to_the_next(routers) -> None:
    (down, a, b), (sa, sb) = routers
    with RouterClient([down, a, b]) as client:
        msgs = collect(client, greedy())
        assert [t for m in msgs for t in m.token_ids] == TOKENS and msgs[-1].finished
        assert client.order == [a, b, down]  # the failed one is tried last from now on
        assert client.model_info(timeout=10).model_type == "fake"
    assert len(sa.requests) == 1 and not sb.requests
    assert sa.requests[0].request_id  # the client names the request, for every attempt


def test_a_pinned_stream_is_replayed_on_the_next_router_and_deduplicated(routers) -> None:
    (_, a, b), (sa, sb) = routers
    sa.fail_after = 5  # five tokens arrive from A, then it goes away
    sb.per_message = 3  # B batches differently: the overlap cuts a message in two
    with RouterClient([a, b]) as client:
        msgs = collect(client, greedy())
    assert [t for m in msgs for t in m.token_ids] == TOKENS
    assert "".join(m.text for m in msgs) == text(TOKENS)
    assert [lp for m in msgs for lp in m.logprobs] == [-float(i) for i in TOKENS]
    assert [list(m.prompt_logprobs) for m in msgs if m.prompt_logprobs] == [[-0.5, -0.25]]
    assert [list(m.prompt_token_ids) for m in msgs if m.prompt_token_ids] == [[1, 2, 3]]
    assert msgs[-1].finished and msgs[-1].usage.completion_tokens == len(TOKENS)
    assert [r.request_id for r in sb.requests] == [sa.requests[0].request_id]
    assert sb.requests[0].token_ids.ids == [1, 2, 3]  # the same request, from the start


def test_a_stream_that_is_not_pinned_is_not_replayed(routers) -> None:
    (_, a, b), (sa, sb) = routers
    sa.fail_after = 4
    sampled = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 2, 3]))
    assert not replayable(sampled.sampling)
    got: list[int] = []
    with RouterClient([a, b]) as client, pytest.raises(grpc.RpcError) as err:
        for msg in client.generate(sampled, timeout=10):
            got.extend(msg.token_ids)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert got == TOKENS[:4] and not sb.requests
    # before the first token, any stream is sent again
    sa.fail_after = 0
    with RouterClient([a, b]) as client:
        assert [t for m in collect(client, sampled) for t in m.token_ids] == TOKENS


def test_a_seeded_stream_is_pinned() -> None:
    assert replayable(gpb.SamplingParams(temperature=0.8, seed=7))
    assert not replayable(gpb.SamplingParams(temperature=0.8))


def test_a_replay_that_differs_fails_the_call(routers) -> None:
    (_, a, b), (sa, sb) = routers
    sa.fail_after = 3
    sb.tokens = [*TOKENS[:2], 999, *TOKENS[3:]]
    with RouterClient([a, b]) as client, pytest.raises(ReplayMismatch) as err:
        collect(client, greedy())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "router going away" in err.value.details() and "from token 2" in err.value.details()
    # a replay that ends before reaching what was delivered differs too
    sb.tokens = TOKENS[:2]
    with RouterClient([a, b]) as client, pytest.raises(ReplayMismatch):
        collect(client, greedy())


def test_one_address_is_tried_again_after_a_pause(routers) -> None:
    """One address in front of several routers (a Kubernetes Service): the call goes to it
    again, after a pause, until it answers or the attempts are spent."""
    (_, a, _), (sa, _) = routers
    sa.refuse, sa.refusals = grpc.StatusCode.UNAVAILABLE, 2
    with RouterClient([a], retry_pause_s=0.01) as client:
        assert [t for m in collect(client, greedy()) for t in m.token_ids] == TOKENS
    assert len(sa.requests) == 3
    with RouterClient([a], attempts=2, retry_pause_s=0.01) as client, \
            pytest.raises(grpc.RpcError) as err:
        sa.requests.clear()
        collect(client, greedy())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(sa.requests) == 2
    # no pause outlasts the call's deadline: the call ends with the failure instead
    with RouterClient([a], retry_pause_s=30) as client, pytest.raises(grpc.RpcError) as err:
        sa.requests.clear()
        list(client.generate(greedy(), timeout=5))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(sa.requests) == 1


def test_other_statuses_do_not_fail_over(routers) -> None:
    (_, a, b), (sa, sb) = routers
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        sa.refuse = code
        with RouterClient([a, b]) as client, pytest.raises(grpc.RpcError) as err:
            collect(client, greedy())
        assert err.value.code() == code
    assert not sb.requests


def test_every_router_unavailable_ends_the_call(routers) -> None:
    (down, a, b), (sa, sb) = routers
    sa.refuse = sb.refuse = grpc.StatusCode.UNAVAILABLE
    with RouterClient([down, a, b]) as client:
        with pytest.raises(grpc.RpcError) as err:
            collect(client, greedy())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            client.model_info(timeout=10)
    assert len(sa.requests) == len(sb.requests) == 1
    with pytest.raises(ValueError):
        RouterClient([])


def test_channels_keep_alive_by_default() -> None:
    """Every channel pings its router (a router that vanished is found within about 10 s);
    options given change them."""
    keepalive = dict(DEFAULT_KEEPALIVE.channel_options())
    with RouterClient(["127.0.0.1:1"]) as client:
        assert dict(client._options) == keepalive
    given = [("grpc.keepalive_time_ms", 3000), ("grpc.max_receive_message_length", 7)]
    with RouterClient(["127.0.0.1:1"], options=given) as client:
        assert dict(client._options) == {**keepalive, **dict(given)}
        assert len(client._options) == len(keepalive) + 1
