"""Prometheus metrics over HTTP, the same way on every node (``--metrics-port``).

Each process gets its own :class:`~prometheus_client.CollectorRegistry` with a
:class:`StatsCollector` that calls the node's :data:`~proto.admin.StatsSource` (the callable
``Admin.GetStats`` uses) on every scrape and exports each figure as a gauge ``pdserve_<name>``
labelled with the node's ``role``, so metrics and ``GetStats`` always agree. The router adds its
latency histograms and prefill-decision counters (:class:`RouterMetrics`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from proto.admin import _RENAMES, StatsSource

PREFIX = "pdserve_"
# seconds; TTFT includes queueing and prefill, ITL is per output token
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StatsCollector(Collector):
    """A gauge ``pdserve_<name>{role=...}`` per numeric figure of ``source``, read per scrape."""

    def __init__(self, role: str, source: StatsSource) -> None:
        self.role = role
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.source().items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            gauge = GaugeMetricFamily(PREFIX + _RENAMES.get(name, name),
                                      f"{name} as Admin.GetStats reports it", labels=["role"])
            gauge.add_metric([self.role], float(value))
            yield gauge


class DecisionCollector(Collector):
    """``pdserve_router_prefill_decisions_total{decision="disaggregated"|"local"}`` from the
    router's counters (``remote_prefill`` / ``local_prefill``)."""

    def __init__(self, counters: Mapping[str, int]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("pdserve_router_prefill_decisions",
                                     "requests by where their prefill ran",
                                     labels=["role", "decision"])
        family.add_metric(["router", "disaggregated"], self.counters.get("remote_prefill", 0))
        family.add_metric(["router", "local"], self.counters.get("local_prefill", 0))
        yield family


class RouterMetrics:
    """The router's own series: TTFT and inter-token latency seen in the relay, and its P/D
    decisions. Unregistered until :func:`serve_metrics` gets :meth:`collectors`."""

    def __init__(self, counters: Mapping[str, int]) -> None:
        self.ttft = Histogram("pdserve_router_ttft_seconds",
                              "time from request arrival to its first output token",
                              registry=None, buckets=TTFT_BUCKETS)
        self.itl = Histogram("pdserve_router_itl_seconds",
                             "time between output tokens (a batch's gap split over its tokens)",
                             registry=None, buckets=ITL_BUCKETS)
        self.decisions = DecisionCollector(counters)

    def collectors(self) -> list[Collector]:
        return [self.ttft, self.itl, self.decisions]

    def stream(self, start: float) -> StreamTimer:
        """A timer for one request that arrived at ``start`` (``time.monotonic()``)."""
        return StreamTimer(self, start)


class StreamTimer:
    """Observes TTFT on a stream's first tokens and ITL on every later batch."""

    def __init__(self, metrics: RouterMetrics, start: float) -> None:
        self.metrics = metrics
        self.last: float | None = None
        self.start = start

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
            n -= 1  # the first token's latency is TTFT; the rest of its batch came at once
            gap = 0.0
        else:
            gap = (now - self.last) / n
        for _ in range(n):
            self.metrics.itl.observe(gap)
        self.last = now


def serve_metrics(host: str, port: int, role: str, source: StatsSource,
                  collectors: Iterable[Collector] = ()) -> int:
    """Serve ``/metrics`` on ``host:port`` (0 picks a free port) from a thread of its own;
    prints ``METRICS <port>`` and returns the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(role, source))
    for collector in collectors:
        registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    print(f"METRICS {bound}", flush=True)
    return bound
