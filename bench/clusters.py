"""Starting local clusters of ``pdserve`` subprocesses on loopback for benchmarks.

Used by ``pdserve bench --compare``, ``bench.serving`` and ``bench.serving_peer``. Every process
gets ``OMP_NUM_THREADS=1`` unless started with more threads (so clusters of different sizes
compete for cores the same way, one engine thread per process); its output is read by a thread
of its own, so a chatty node never blocks on a full pipe. :meth:`Processes.stop_all` ends every
process started (SIGTERM, then SIGKILL), and runs however the benchmark ends. A node started
with ``--metrics-port 0`` has its Prometheus counters read by :meth:`Proc.counters`; a router
started with ``--http-port 0`` has the port of its OpenAI-compatible door in
:attr:`Proc.http_port`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0


@dataclass
class Proc:
    """One started ``pdserve`` process; its output is collected by a reader thread."""

    name: str
    popen: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)
    port: int | None = None
    metrics_port: int | None = None
    http_port: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def read(self) -> None:
        """Reader thread: record output; note the ``METRICS <port>``, ``HTTP <port>`` and
        ``READY <port>`` lines (a node prints the others before ``READY``)."""
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.log.append(line)
            if self.metrics_port is None and line.startswith("METRICS "):
                self.metrics_port = int(line.split()[1])
            if self.http_port is None and line.startswith("HTTP "):
                self.http_port = int(line.split()[1])
            if self.port is None and line.startswith("READY "):
                self.port = int(line.split()[1])
                self.ready.set()
        self.ready.set()  # exited: wake the waiter

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def counters(self) -> dict[str, float]:
        """The node's Prometheus counters now, by sample name (``pdserve_<name>_total``), from
        its ``/metrics``; empty for a node started without ``--metrics-port``."""
        if self.metrics_port is None:
            return {}
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                if family.type == "counter" for sample in family.samples
                if sample.name.endswith("_total")}


class Processes:
    """Every process this run started; :meth:`stop_all` ends them all (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, name: str, args: Sequence[str], threads: int = 1,
              netns: str | None = None) -> Proc:
        """``pdserve ARGS`` with ``threads`` OpenMP threads; in network namespace ``netns``
        when given (``ip netns exec``: a host of :mod:`bench.netns_hosts`)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = str(threads)
        enter = ["ip", "netns", "exec", netns] if netns is not None else []
        return self.spawn(name, [*enter, sys.executable, "-m", "cli.main", *args], env)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Proc:
        """Any command (a peer's server), its output read and its end owed to :meth:`stop_all`
        like a node's."""
        popen = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=ROOT,
        )
        proc = Proc(name, popen)
        self.procs.append(proc)
        threading.Thread(target=proc.read, daemon=True).start()
        return proc

    @staticmethod
    def wait_ready(procs: Sequence[Proc]) -> None:
        """Block until each of ``procs`` printed ``READY``; raise with its log if it exited."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in procs:
            if not proc.ready.wait(max(0.0, deadline - time.monotonic())) or proc.port is None:
                raise RuntimeError(f"{proc.name} did not become ready:\n{proc.tail()}")

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.procs.clear()


def start_disaggregated(procs: Processes, model: Path, engine: Sequence[str],
                        draft: Path | None = None, num_draft_tokens: int = 0,
                        draft_topk: int = 1, draft_steps: int | None = None,
                        router_flags: Sequence[str] = ()) -> Proc:
    """One prefill node, one decode node and their router; returns the router.
    With ``draft`` both workers load the EAGLE draft and the decode runs rounds of
    ``num_draft_tokens`` (a tree of ``draft_topk`` children per node, ``draft_steps`` deep,
    when those are given). ``router_flags``: more flags for the router (``--http-port 0``)."""
    spec = [] if draft is None else ["--draft", str(draft)]
    prefill = procs.start("prefill", ["prefill", *engine, *spec])
    steps = [] if draft_steps is None else ["--draft-steps", str(draft_steps)]
    tree = ["--num-draft-tokens", str(num_draft_tokens), "--draft-topk", str(draft_topk), *steps]
    decode = procs.start("decode", ["decode", *engine, *spec, *(tree if draft is not None
                                                                  else [])])
    procs.wait_ready([prefill, decode])
    router = procs.start("disaggregated router", [
        "router", "--model", str(model), "--port", "0",
        "--prefill", prefill.address, "--decode", decode.address, *router_flags])
    procs.wait_ready([router])
    return router


def start_colocated(procs: Processes, model: Path, engine: Sequence[str], threads: int = 1,
                    router_flags: Sequence[str] = ()) -> Proc:
    """One decode node that also prefills (with ``threads`` OpenMP threads), behind a router;
    returns the router. ``router_flags``: as for :func:`start_disaggregated`."""
    worker = procs.start("colocated decode", ["decode", *engine], threads)
    procs.wait_ready([worker])
    router = procs.start("colocated router", [
        "router", "--model", str(model), "--port", "0", "--colocated", worker.address,
        *router_flags])
    procs.wait_ready([router])
    return router


def engine_flags(model: Path, *, page_size: int = 16, num_pages: int = 4096,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512) -> list[str]:
    """The flags every worker of a benchmark cluster gets."""
    return ["--model", str(model), "--port", "0", "--page-size", str(page_size),
            "--num-pages", str(num_pages), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens)]
