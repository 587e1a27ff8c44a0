"""Prometheus ``/metrics`` on every node of a 1P1D EAGLE cluster (``--metrics-port``, and the
router's HTTP door): after traffic the counters moved (requests, P/D decisions, transfer bytes
and latency, drafted and accepted tokens, TTFT/ITL histograms), the gauges agree with
``Admin.GetStats`` and are back to zero once idle, and every series the Grafana dashboard
queries exists."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.builtin import builtin_model_dir
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc
from serving.metrics import RouterMetrics, StatsCollector, TransferMetrics
from tests.cluster.harness import ROOT, Node, running
from tests.cluster.stats import GAUGES, assert_all_idle, get_stats

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_collectors_export_figures_and_latencies() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector("decode", lambda: {"running_requests": 2,
                                                        "requests_total": 5, "kv_pages_used": 3,
                                                        "kv_pages_total": 10,
                                                        "bootstrap_addr": "x"}))
    router = RouterMetrics({"local_prefill": 3, "remote_prefill": 1})
    transfer = TransferMetrics()

    class Sender:
        on_send = None

    sender = Sender()
    for c in [*router.collectors(), *transfer.watch(sender)]:
        registry.register(c)
    assert sender.on_send is not None
    sender.on_send(4096, 0.002, True)
    sender.on_send(0, 0.001, False)
    timer = router.stream(time.monotonic())
    timer.tokens(2)
    timer.tokens(3)
    s = parse(generate_latest(registry).decode())
    assert value(s, "pdserve_requests_running", role="decode") == 2  # the GetStats name
    assert value(s, "pdserve_requests_total", role="decode") == 5
    assert value(s, "pdserve_kv_pages_free", role="decode") == 7
    assert value(s, "pdserve_transfer_bytes_total") == 4096
    assert value(s, "pdserve_transfer_seconds_count") == 1
    assert value(s, "pdserve_transfer_failures_total") == 1
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


def scrape_url(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return parse(reply.read().decode())


def scrape(node: Node) -> Samples:
    return scrape_url(f"http://127.0.0.1:{metrics_port(node)}/metrics")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Node]]:
    """A 1P1D EAGLE cluster on the built-in model; the router prefills prompts shorter than 8
    tokens locally on the decode node and serves its HTTP door too."""
    model = builtin_model_dir()
    node = ["--model", str(model), "--port", "0", "--num-pages", "128", "--metrics-port", "0",
            "--draft", str(model / "draft")]
    with running(["prefill", *node], ["decode", *node, "--num-draft-tokens", "3"]) as [p, d]:
        with running(["router", "--model", str(model), "--prefill", p.address, "--decode",
                      d.address, "--local-prefill-threshold", "8", "--port", "0",
                      "--metrics-port", "0", "--http-port", "0"]) as [r]:
            yield {"prefill": p, "decode": d, "router": r}


@pytest.fixture(scope="module")
def scraped(cluster: dict[str, Node]) -> dict[str, Samples]:
    """Every node's metrics after two disaggregated requests and one prefilled locally."""
    router = cluster["router"]
    with grpc.insecure_channel(router.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for n in (12, 20, 4):
            req = gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=[(n * 7 + j) % 200 + 1 for j in range(n)]),
                sampling=gpb.SamplingParams(max_new_tokens=8, ignore_eos=True))
            msgs = list(stub.Generate(req, timeout=60))
            assert msgs[-1].finished
    assert_all_idle([node.address for node in cluster.values()])
    return {role: scrape(node) for role, node in cluster.items()}


@pytest.mark.slow
def test_metrics_move_with_traffic_and_match_get_stats(cluster: dict[str, Node],
                                                       scraped: dict[str, Samples]) -> None:
    r, p, d = scraped["router"], scraped["prefill"], scraped["decode"]
    assert value(r, "pdserve_requests_total", role="router") == 3
    assert value(r, "pdserve_router_ttft_seconds_count") == 3
    assert value(r, "pdserve_router_itl_seconds_count") > 0
    decisions = {k: value(r, "pdserve_router_prefill_decisions_total", role="router",
                          decision=k) for k in ("disaggregated", "local")}
    assert decisions == {"disaggregated": 2, "local": 1}
    assert value(p, "pdserve_requests_total", role="prefill") == 2
    assert value(p, "pdserve_transfer_bytes_total") > 0
    assert value(p, "pdserve_transfer_seconds_count") >= 2  # a KV send and an aux row per room
    assert value(p, "pdserve_transfer_failures_total") == 0
    assert value(d, "pdserve_requests_total", role="decode") == 3
    assert value(d, "pdserve_drafted_tokens_total", role="decode") > 0
    assert 0 <= value(d, "pdserve_accepted_tokens_total", role="decode") <= \
        value(d, "pdserve_drafted_tokens_total", role="decode")
    for role, samples in scraped.items():
        node = cluster[role]
        stats = get_stats(node.address)
        assert value(samples, "pdserve_requests_total", role=role) == stats.requests_total
        present = [g for g in GAUGES if (f"pdserve_{g}", (("role", role),)) in samples]
        assert {g: value(samples, f"pdserve_{g}", role=role) for g in present} == \
            dict.fromkeys(present, 0.0)
        assert "requests_running" in present
        if role != "router":  # the workers' queues and pages
            assert "requests_waiting" in present
            # idle: every page is free or held only by the prefix cache (evictable)
            free = value(samples, "pdserve_kv_pages_free", role=role)
            assert value(samples, "pdserve_kv_pages_cached", role=role) == stats.kv_pages_cached
            assert free + stats.kv_pages_cached == stats.kv_pages_total


@pytest.mark.slow
def test_router_http_door_serves_the_same_metrics(cluster: dict[str, Node],
                                                  scraped: dict[str, Samples]) -> None:
    router = cluster["router"]
    http = [int(line.split()[1]) for line in router.log if line.startswith("HTTP ")]
    door = scrape_url(f"http://127.0.0.1:{http[0]}/metrics")
    assert value(door, "pdserve_requests_total", role="router") == 3
    assert value(door, "pdserve_router_ttft_seconds_count") == 3
    assert set(door) == set(scraped["router"])


@pytest.mark.slow
def test_grafana_dashboard_queries_only_exported_series(scraped: dict[str, Samples]) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 10
    queried = {name for e in exprs for name in re.findall(r"pdserve_[a-z_]+", e)}
    exported = {name for samples in scraped.values() for name, _ in samples}
    assert queried - exported == set()
    for want in ("pdserve_transfer_bytes_total", "pdserve_router_ttft_seconds_bucket",
                 "pdserve_drafted_tokens_total", "pdserve_kv_pages_free",
                 "pdserve_router_prefill_decisions_total", "pdserve_requests_waiting"):
        assert want in queried, want
