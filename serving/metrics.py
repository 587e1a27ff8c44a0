"""Prometheus metrics over HTTP, the same way on every node (``--metrics-port``).

Each process gets its own :class:`~prometheus_client.CollectorRegistry` with a
:class:`StatsCollector` that calls the node's :data:`~serving.admin.StatsSource` (the callable
``Admin.GetStats`` uses) on every scrape and exports each figure as ``pdserve_<name>`` labelled
with the node's ``role`` (a gauge, or a counter for the totals in :data:`COUNTERS`, plus
``pdserve_kv_pages_free``), so metrics and ``GetStats`` always agree. The router adds its
latency histograms and prefill-decision counters (:class:`RouterMetrics`); nodes that send KV
add the transfer series of :class:`TransferMetrics`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from serving.admin import _RENAMES, StatsSource

PREFIX = "pdserve_"
# seconds; TTFT includes queueing and prefill, ITL is per output token
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# seconds per send_kvcache / send_aux call (engine calls included)
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 1.0)
# figures that are totals since start: exported as counters ``pdserve_<name>_total``
COUNTERS = {"requests_total": "requests", "requests_rejected": "requests_rejected",
            "transfers_failed": "transfers_failed", "drafted_tokens": "drafted_tokens",
            "accepted_tokens": "accepted_tokens", "spec_rounds": "spec_rounds",
            "faults_injected": "faults_injected", "kv_retries": "kv_retries",
            "kv_recomputes": "kv_recomputes", "decode_failovers": "decode_failovers",
            "prefix_cache_queried_tokens": "prefix_cache_queried_tokens",
            "prefix_cache_hit_tokens": "prefix_cache_hit_tokens",
            "prefix_cache_evicted_blocks": "prefix_cache_evicted_blocks",
            "kv_pages_not_sent": "kv_pages_not_sent", "kv_bytes_not_sent": "kv_bytes_not_sent",
            "state_checkpoints_saved": "state_checkpoints_saved",
            "state_checkpoints_restored": "state_checkpoints_restored",
            "state_checkpoints_evicted": "state_checkpoints_evicted"}


class StatsCollector(Collector):
    """A series ``pdserve_<name>{role=...}`` per numeric figure of ``source``, read per scrape:
    a counter ``pdserve_<name>_total`` for the totals in :data:`COUNTERS`, a gauge otherwise,
    and ``pdserve_kv_pages_free`` where the node reports its pages."""

    def __init__(self, role: str, source: StatsSource) -> None:
        self.role = role
        self.source = source

    def collect(self) -> Iterator[Metric]:
        figures = {_RENAMES.get(k, k): v for k, v in self.source().items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "kv_pages_total" in figures and "kv_pages_used" in figures \
                and "kv_pages_free" not in figures:
            figures["kv_pages_free"] = figures["kv_pages_total"] - figures["kv_pages_used"]
        for name, value in sorted(figures.items()):
            doc = f"{name} as Admin.GetStats reports it"
            family: GaugeMetricFamily | CounterMetricFamily
            if name in COUNTERS:
                family = CounterMetricFamily(PREFIX + COUNTERS[name], doc, labels=["role"])
            else:
                family = GaugeMetricFamily(PREFIX + name, doc, labels=["role"])
            family.add_metric([self.role], float(value))
            yield family


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
    decisions. Unregistered until :func:`metrics_registry` gets :meth:`collectors`."""

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


SendObserver = Callable[[int, float, bool], None]


class Sender(Protocol):
    """A KV manager (:class:`transfer.base.KVManager`): calls ``on_send`` after every send."""

    on_send: SendObserver | None


class TransferMetrics:
    """A sending node's KV transfer series: bytes moved, seconds per send, failed sends.
    Unregistered until :func:`metrics_registry` gets :meth:`watch`'s collectors."""

    def __init__(self) -> None:
        self.bytes = Counter("pdserve_transfer_bytes", "KV and aux bytes pushed to decode nodes",
                             registry=None)
        self.seconds = Histogram("pdserve_transfer_seconds",
                                 "seconds per send_kvcache / send_aux call (engine calls included)",
                                 registry=None, buckets=TRANSFER_BUCKETS)
        self.failures = Counter("pdserve_transfer_failures", "sends that failed in the engine",
                                registry=None)

    def watch(self, *senders: Sender) -> list[Collector]:
        """Observe every send of ``senders`` (a node's manager, and the stand-ins of its other
        TP ranks); returns the collectors to register."""
        for sender in senders:
            sender.on_send = self.observe
        return [self.bytes, self.seconds, self.failures]

    def observe(self, nbytes: int, seconds: float, ok: bool) -> None:
        """One send: ``nbytes`` moved in ``seconds`` (``ok`` False: it failed). Thread-safe."""
        if ok:
            self.bytes.inc(nbytes)
            self.seconds.observe(seconds)
        else:
            self.failures.inc()


def metrics_registry(role: str, source: StatsSource,
                     collectors: Iterable[Collector] = ()) -> CollectorRegistry:
    """A registry with the node's figures (:class:`StatsCollector`) and ``collectors``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(role, source))
    for collector in collectors:
        registry.register(collector)
    return registry


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> int:
    """Serve ``/metrics`` of ``registry`` on ``host:port`` (0 picks a free port) from a thread
    of its own; prints ``METRICS <port>`` and returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    print(f"METRICS {bound}", flush=True)
    return bound
