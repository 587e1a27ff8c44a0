"""Structured request logs: the router writes one JSON line per request with its timings and
workers, and the prefill and decode nodes write theirs under the same request id (the client's
``x-request-id`` metadata or HTTP header, or one the router draws)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.cluster.harness import Node, running

pytestmark = pytest.mark.slow
Line = dict[str, object]


def request_lines(node: Node, request_id: str, count: int = 1, timeout_s: float = 10.0
                  ) -> list[Line]:
    """The node's log lines for ``request_id`` (waits until ``count`` of them arrived)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(x) for x in list(node.log) if x.startswith("{")]
        found = [x for x in lines if x.get("request_id") == request_id]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[dict[str, Node]]:
    node = ["--model", str(tiny_dir), "--port", "0", "--num-pages", "128"]
    with running(["prefill", *node], ["decode", *node]) as [p, d]:
        with running(["router", "--model", str(tiny_dir), "--prefill", p.address, "--decode",
                      d.address, "--port", "0", "--http-port", "0"]) as [r]:
            yield {"prefill": p, "decode": d, "router": r}


def test_one_line_per_request_follows_the_id_through_every_node(
        cluster: dict[str, Node]) -> None:
    router, prefill, decode = cluster["router"], cluster["prefill"], cluster["decode"]
    req = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=list(range(1, 17))),
                              sampling=gpb.SamplingParams(max_new_tokens=5, ignore_eos=True))
    with grpc.insecure_channel(router.address) as channel:
        msgs = list(generate_pb2_grpc.GenerationStub(channel).Generate(
            req, timeout=60, metadata=(("x-request-id", "trace-ok-1"),)))
    assert msgs[-1].request_id == "trace-ok-1"
    [line] = request_lines(router, "trace-ok-1")
    assert line["role"] == "router" and line["status"] == "OK"
    assert line["prompt_tokens"] == 16 and line["completion_tokens"] == 5
    assert line["prefill"] == prefill.address and line["decode"] == decode.address
    assert line["finish_reason"] == "length"
    assert 0 < line["ttft_ms"] <= line["e2e_ms"]  # type: ignore[operator]
    [p] = request_lines(prefill, "trace-ok-1")
    [d] = request_lines(decode, "trace-ok-1")
    assert p["role"] == "prefill" and p["status"] == "OK" and p["room"] == line["room"]
    assert d["role"] == "decode" and d["status"] == "OK" and d["completion_tokens"] == 5
    assert d["local_prefill"] is False


def test_refused_and_http_requests_are_logged_too(cluster: dict[str, Node]) -> None:
    router = cluster["router"]
    bad = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[10**9]),
                              sampling=gpb.SamplingParams(max_new_tokens=5))
    with grpc.insecure_channel(router.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(
                bad, timeout=60, metadata=(("x-request-id", "trace-bad-1"),)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [line] = request_lines(router, "trace-bad-1")
    assert line["status"] == "INVALID_ARGUMENT" and line["completion_tokens"] == 0

    port = next(int(x.split()[1]) for x in router.log if x.startswith("HTTP "))
    body = json.dumps({"model": "m", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 3,
                       "temperature": 0, "ignore_eos": True}).encode()
    http = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                  headers={"Content-Type": "application/json",
                                           "X-Request-Id": "trace-http-1"})
    with urllib.request.urlopen(http, timeout=60) as reply:
        assert reply.status == 200
    [line] = request_lines(router, "trace-http-1")
    assert line["status"] == "OK" and line["completion_tokens"] == 3
    assert request_lines(cluster["decode"], "trace-http-1")
