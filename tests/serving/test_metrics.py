"""Prometheus ``/metrics`` (``--metrics-port``) on a decode node and a router (colocated):
after traffic the counters moved, the router's TTFT/ITL histograms filled, and the gauges agree
with ``Admin.GetStats`` and are back to zero once idle."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proto.metrics import RouterMetrics, StatsCollector
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from tests.serving.harness import Node, running
from tests.serving.stats import GAUGES, assert_all_idle, get_stats

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_collectors_export_figures_and_latencies() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector("decode", lambda: {"running_requests": 2,
                                                        "requests_total": 5,
                                                        "bootstrap_addr": "x"}))
    router = RouterMetrics({"local_prefill": 3, "remote_prefill": 1})
    for c in router.collectors():
        registry.register(c)
    timer = router.stream(time.monotonic())
    timer.tokens(2)
    timer.tokens(3)
    s = parse(generate_latest(registry).decode())
    assert value(s, "pdserve_requests_running", role="decode") == 2  # the GetStats name
    assert value(s, "pdserve_requests_total", role="decode") == 5
    assert value(s, "pdserve_router_ttft_seconds_count") == 1
    assert value(s, "pdserve_router_itl_seconds_count") == 4
    assert value(s, "pdserve_router_prefill_decisions_total", role="router",
                 decision="local") == 3
    assert value(s, "pdserve_router_prefill_decisions_total", role="router",
                 decision="disaggregated") == 1


def metrics_port(node: Node) -> int:
    ports = [int(line.split()[1]) for line in node.log if line.startswith("METRICS ")]
    assert ports, f"no METRICS line before READY:\n{''.join(node.log)}"
    return ports[0]


def scrape(node: Node) -> Samples:
    url = f"http://127.0.0.1:{metrics_port(node)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse(reply.read().decode())


@pytest.fixture(scope="module")
def nodes(tiny_dir: Path) -> Iterator[tuple[Node, Node]]:
    decode = ["decode", "--model", str(tiny_dir), "--port", "0", "--num-pages", "128",
              "--metrics-port", "0"]
    with running(decode) as [d]:
        with running(["router", "--model", str(tiny_dir), "--colocated", d.address,
                      "--port", "0", "--metrics-port", "0"]) as [r]:
            yield d, r


@pytest.mark.slow
def test_metrics_move_with_traffic_and_match_get_stats(nodes: tuple[Node, Node]) -> None:
    decode, router = nodes
    with grpc.insecure_channel(router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for i in range(3):
            req = gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=[(i * 7 + j) % 200 + 1 for j in range(6 + i)]),
                sampling=gpb.SamplingParams(max_new_tokens=6, ignore_eos=True))
            msgs = list(stub.Generate(req, timeout=60))
            assert msgs[-1].finished
    assert_all_idle([decode.address, router.address])

    r = scrape(router)
    assert value(r, "pdserve_requests_total", role="router") >= 3
    assert value(r, "pdserve_router_ttft_seconds_count") >= 3
    assert value(r, "pdserve_router_itl_seconds_count") > 0
    assert value(r, "pdserve_router_prefill_decisions_total", role="router",
                 decision="local") >= 3
    d = scrape(decode)
    assert value(d, "pdserve_requests_total", role="decode") >= 3
    for node, samples, role in ((router, r, "router"), (decode, d, "decode")):
        stats = get_stats(node.address)
        assert value(samples, "pdserve_requests_total", role=role) == stats.requests_total
        present = [g for g in GAUGES if (f"pdserve_{g}", (("role", role),)) in samples]
        assert "requests_running" in present
        assert {g: value(samples, f"pdserve_{g}", role=role) for g in present} == \
            dict.fromkeys(present, 0.0)
