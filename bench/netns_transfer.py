"""KV transfer between two hosts on one machine (:mod:`bench.netns_hosts`), measured.

**Benchmark** (:func:`main`): one request's KV (2,048 tokens of a Qwen2-VL-2B-shaped model,
56 MiB) sent with ``MooncakeKVManager.send_kvcache`` from host 0 to host 1: over the plain link
(the baseline), over the link capped at 1000, 500 and 100 Mbit/s (bytes/s over the cap), and
with 1 and 10 ms added on both hosts (time over the baseline); each row on two fresh hosts.

    python -m bench.netns_transfer --reps 5
    python -m bench.netns_transfer --quick      # a small request, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from bench.netns_hosts import Hosts, Shape, cleanup_leftovers, unavailable


@dataclass(frozen=True)
class KVShape:
    """The KV of one request: its model's layers, KV heads, head size, page size and dtype,
    and its prompt length."""

    layers: int = 28
    kv_heads: int = 2
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"
    tokens: int = 2048

    @property
    def num_pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def nbytes(self) -> int:
        """Bytes of the request's pages, K and V of every layer."""
        item = 2 if self.dtype in ("bfloat16", "float16") else 4
        return 2 * self.layers * self.num_pages * self.page_size * self.kv_heads * \
            self.head_dim * item


QUICK = KVShape(layers=4, kv_heads=2, head_dim=64, tokens=256)


def _pool(shape: KVShape) -> Any:
    import torch

    from engine.kv.pool import KVPool

    return KVPool(shape.num_pages, shape.page_size, shape.kv_heads, shape.head_dim,
                  list(range(shape.layers)), getattr(torch, shape.dtype))


def _receiver(conn: Connection, address: str, shape: KVShape) -> None:
    """The decode host: register a pool on ``address``, publish it and hold it (until the
    hosts' teardown, or the other end of ``conn`` closes)."""
    from transfer.backends.mooncake import MooncakeKVManager

    pool = _pool(shape)
    mgr = MooncakeKVManager(hostname=address)
    mgr.register(pool.buffer_infos())
    conn.send((mgr.session_id, mgr.kv_ptrs, mgr.kv_layer_ids, mgr.kv_bytes_per_page))
    conn.recv()


def _sender(conn: Connection, address: str, shape: KVShape, dst: tuple[Any, ...]) -> None:
    """The prefill host: a pool of random bytes on ``address``; answers each message (a count
    of sends) with the seconds of each send of the whole request into ``dst`` (the receiver's
    session, pointers, layer ids and bytes per page), until the hosts' teardown."""
    import torch

    from transfer.backends.mooncake import MooncakeKVManager

    pool = _pool(shape)
    for e in pool.entries():
        e.copy_(torch.randn(e.shape).to(e.dtype))
    mgr = MooncakeKVManager(hostname=address)
    mgr.register(pool.buffer_infos())
    session, ptrs, layer_ids, bytes_per_page = dst
    pages = list(range(shape.num_pages))
    conn.send("ready")
    while True:
        seconds = []
        for _ in range(conn.recv()):
            t0 = time.perf_counter()
            result = mgr.send_kvcache(session, pages, ptrs, pages, dst_layer_ids=layer_ids,
                                      dst_bytes_per_page=bytes_per_page)
            seconds.append(time.perf_counter() - t0)
            if result.nbytes != shape.nbytes:
                raise RuntimeError(f"sent {result.nbytes} bytes, the request has "
                                   f"{shape.nbytes}")
        conn.send(seconds)


class _Bench:
    """A receiver on host 1 and a sender on host 0 of ``hosts``."""

    def __init__(self, hosts: Hosts, shape: KVShape) -> None:
        self._recv_conn, child = mp.get_context("spawn").Pipe()  # open: the receiver holds on
        hosts[1].spawn(_receiver, child, hosts[1].address, shape)
        dst = self._recv_conn.recv()
        self.conn, child = mp.get_context("spawn").Pipe()
        hosts[0].spawn(_sender, child, hosts[0].address, shape, dst)
        if self.conn.recv() != "ready":
            raise RuntimeError("the sender did not start")

    def sends(self, count: int) -> list[float]:
        """Seconds of each of ``count`` sends of the request."""
        self.conn.send(count)
        seconds: list[float] = self.conn.recv()
        return seconds


def _row(seconds: list[float], nbytes: int) -> dict[str, float]:
    t = statistics.median(seconds)
    return {"ms": t * 1e3, "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3,
            "mbit": nbytes * 8 / t / 1e6}


def _measure(shape: KVShape, sender: Shape, receiver: Shape, reps: int,
             warmup: int) -> tuple[list[float], str]:
    """Seconds of ``reps`` sends of the request over a link of its own (two fresh hosts, their
    links shaped ``sender`` and ``receiver``), after ``warmup`` untimed ones; and the hosts' TCP
    congestion control."""
    with Hosts(2) as hosts:
        hosts[0].link.set(**asdict(sender))
        hosts[1].link.set(**asdict(receiver))
        bench = _Bench(hosts, shape)
        bench.sends(warmup)
        algorithm = hosts[0].run(["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).strip()
        return bench.sends(reps), algorithm


def run(shape: KVShape, caps: Sequence[float], delays: Sequence[float], reps: int,
        warmup: int = 2) -> dict[str, Any]:
    """The request's send over the plain link (the baseline), over the link capped at each of
    ``caps`` (Mbit/s, on the sending host) and with each of ``delays`` added (ms, on both
    hosts: the round trip grows by twice as much); each row on two fresh hosts, ``reps`` sends
    after ``warmup`` untimed ones. Fresh hosts, not one pair reshaped: TCP carries what it
    learnt of a link into the next row (BBR's bandwidth and minimum round trip take seconds
    to follow a link that got faster or slower), which a real link never asks of it."""
    load = os.getloadavg()[0]
    seconds, algorithm = _measure(shape, Shape(), Shape(), reps, warmup)
    base = _row(seconds, shape.nbytes)
    caps_out = []
    for cap in caps:
        r = _row(_measure(shape, Shape(rate_mbit=cap), Shape(), reps, warmup)[0], shape.nbytes)
        caps_out.append({"cap_mbit": cap, **r, "over_cap": r["mbit"] / cap})
    delays_out = []
    for delay in delays:
        r = _row(_measure(shape, Shape(delay_ms=delay), Shape(delay_ms=delay), reps,
                          warmup)[0], shape.nbytes)
        delays_out.append({"delay_ms": delay, "rtt_added_ms": 2 * delay, **r,
                           "over_baseline": r["ms"] / base["ms"]})
    return {"shape": asdict(shape), "bytes": shape.nbytes, "reps": reps, "warmup": warmup,
            "congestion_control": algorithm, "baseline": base, "caps": caps_out,
            "delays": delays_out, "load_average": [load, os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a small request ({asdict(QUICK)})")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default 2048)")
    ap.add_argument("--caps", type=float, nargs="+", default=[1000, 500, 100],
                    metavar="MBIT", help="rate caps of the sending host's link, Mbit/s")
    ap.add_argument("--delays", type=float, nargs="+", default=[1, 10], metavar="MS",
                    help="delays added on both hosts' links, ms")
    ap.add_argument("--reps", type=int, default=3, help="timed sends per row (the median)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else KVShape()
    if args.tokens is not None:
        shape = replace(shape, tokens=args.tokens)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    reason = unavailable()
    if reason:
        ap.error(f"cannot build hosts here: {reason}")
    cleanup_leftovers()
    result = run(shape, args.caps, args.delays, args.reps)
    if args.json:
        print(json.dumps(result))
        return result
    base = result["baseline"]
    print(f"request: {asdict(shape)}, {shape.nbytes / 2**20:.1f} MiB; median (min-max) of "
          f"{args.reps} sends per row after {result['warmup']}, each row on 2 fresh hosts "
          f"(network namespaces) on one machine of {os.cpu_count()} cores; TCP "
          f"{result['congestion_control']}; load average {result['load_average'][0]:.1f} "
          f"before, {result['load_average'][1]:.1f} after")
    print(f"baseline (plain link): {base['ms']:.1f} ms ({base['min_ms']:.1f}-"
          f"{base['max_ms']:.1f}), {base['mbit']:.0f} Mbit/s")
    print(f"{'cap Mbit/s':>10} {'ms':>9} {'min-max ms':>17} {'Mbit/s':>9} {'over cap':>9}")
    for r in result["caps"]:
        print(f"{r['cap_mbit']:>10g} {r['ms']:>9.1f} {r['min_ms']:>8.1f}-{r['max_ms']:<8.1f} "
              f"{r['mbit']:>9.1f} {r['over_cap']:>9.3f}")
    print(f"{'delay ms':>10} {'RTT +ms':>9} {'ms':>9} {'min-max ms':>17} {'over base':>9}")
    for r in result["delays"]:
        print(f"{r['delay_ms']:>10g} {r['rtt_added_ms']:>9g} {r['ms']:>9.1f} "
              f"{r['min_ms']:>8.1f}-{r['max_ms']:<8.1f} {r['over_baseline']:>9.2f}")
    return result


if __name__ == "__main__":
    main()
