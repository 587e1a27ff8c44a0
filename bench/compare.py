"""``pdserve bench --compare``: the same requests against several serving setups, in one run.

Targets (``--compare-targets``, in this order by default):

* ``disaggregated``: one prefill node, one decode node, a router;
* ``colocated``: one decode node that also prefills, a router;
* ``disaggregated+eagle``: the disaggregated cluster with the model's EAGLE draft (``DIR/draft``)
  on both workers and rounds of K draft tokens on the decode (``--num-draft-tokens``, default 4);
* ``transformers``: transformers' ``generate`` on the same checkpoint (:mod:`bench.hf_baseline`),
  static batches of ``--max-concurrency`` (token-id prompts only, no multi-turn load);
* ``disaggregated-no-cache``, ``colocated-no-cache``: those clusters with workers started with
  ``--no-prefix-cache``, the baselines of the prefix cache (on by default everywhere else).

Each cluster is started on loopback (:mod:`bench.clusters`, one engine thread per
process), warmed up with one request outside the load (so the first measured run starts with an
empty prefix cache), measured at every ``--request-rate`` and torn down before the next starts,
so no two setups share the machine. A cluster stays up across rates: a later rate finds the
earlier runs' prompts in its prefix cache (``cached_tokens_per_request`` shows it). Every row
gets ratios against the baseline row (``--baseline``) at the same rate and the share of requests
whose tokens equal the baseline's (greedy everywhere, so they should).

A cluster's workers serve ``/metrics`` on a free port; the counters of :data:`KV_COUNTERS` are
read from each before and after every measured run, so a row has what each node did in that run
(``node_counters``) and the KV bytes the prefill pushed to the decode per request
(``kv_bytes_sent_per_request``, aux rows included; ``None`` without a prefill node).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import clusters as cc
from bench import loadgen
from bench.compare_targets import NO_CACHE

# the counters (``pdserve_<name>_total``) a row reports per node; absent ones are left out
KV_COUNTERS = ("transfer_bytes", "kv_bytes_not_sent", "kv_pages_not_sent",
               "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
GOODPUT_LEVEL = 0.9  # a rate "meets the SLO" when this share of its requests does
Row = dict[str, object]


def rate_key(rate: float) -> float | None:
    """A request rate as JSON has it: ``None`` for all at once."""
    return rate if math.isfinite(rate) else None


def run_compare(model: Path, targets: Sequence[str], works: loadgen.Load,
                rates: Sequence[float], *, max_concurrency: int, num_draft_tokens: int,
                draft_topk: int = 1, draft_steps: int | None = None,
                seed: int, log: Callable[[str], None], slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None) -> tuple[list[Row], list[list[list[int]]]]:
    """One row per target and rate (target-major) and each row's output token ids; with an SLO,
    each row has its ``goodput``. The EAGLE target drafts ``num_draft_tokens`` per round, as a
    tree when ``draft_topk``/``draft_steps`` say so."""
    rows: list[Row] = []
    outputs: list[list[list[int]]] = []
    engine = cc.engine_flags(model, max_num_seqs=max(64, max_concurrency))
    for target in targets:
        log(f"{target}: starting")
        if target == "transformers":
            if isinstance(works, loadgen.MultiTurn):
                raise ValueError("the transformers baseline does not run a multi-turn load")
            for rate in rates:
                report, ids = _transformers(model, works, rate, max_concurrency, seed,
                                            slo_ttft_ms, slo_tpot_ms)
                rows.append({"target": target, "request_rate": rate_key(rate), **report})
                outputs.append(ids)
            continue
        k = num_draft_tokens if target == "disaggregated+eagle" else 0
        procs = cc.Processes()
        try:
            address = _start(procs, target, model, engine, k, (draft_topk, draft_steps))
            asyncio.run(loadgen.run(address, [loadgen.WARMUP], max_concurrency=1))
            for rate in rates:
                log(f"{target}: {len(works)} requests at rate {rate_key(rate) or 'max'}")
                before = _counters(procs)
                traces, wall = asyncio.run(loadgen.run(
                    address, works, max_concurrency=max_concurrency, request_rate=rate,
                    seed=seed))
                rows.append({"target": target, "request_rate": rate_key(rate),
                             **loadgen.report(traces, wall, k, slo_ttft_ms, slo_tpot_ms),
                             **kv_figures(before, _counters(procs), len(traces))})
                outputs.append([t.token_ids for t in traces])
        finally:
            procs.stop_all()
    return rows, outputs


def _start(procs: cc.Processes, target: str, model: Path, engine: list[str], k: int,
           tree: tuple[int, int | None] = (1, None)) -> str:
    engine = [*engine, "--metrics-port", "0"]
    if target.endswith(NO_CACHE):
        engine.append("--no-prefix-cache")
        target = target.removesuffix(NO_CACHE)
    if target == "colocated":
        return cc.start_colocated(procs, model, engine).address
    if target == "disaggregated+eagle":
        draft = model / "draft"
        if not (draft / "config.json").is_file():
            raise RuntimeError(f"{model} has no EAGLE draft in draft/ (needed by {target})")
        return cc.start_disaggregated(procs, model, engine, draft, k, *tree).address
    return cc.start_disaggregated(procs, model, engine).address


def _counters(procs: cc.Processes) -> dict[str, dict[str, float]]:
    """Each worker's counters of :data:`KV_COUNTERS` now, by process name."""
    out: dict[str, dict[str, float]] = {}
    for proc in procs.procs:
        now = proc.counters()
        if now:
            out[proc.name] = {name: now[f"pdserve_{name}_total"] for name in KV_COUNTERS
                              if f"pdserve_{name}_total" in now}
    return out


def kv_figures(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
               requests: int) -> Row:
    """A run's ``node_counters`` (each node's counters grown from ``before`` to ``after``) and
    ``kv_bytes_sent_per_request``: the bytes the nodes that send KV pushed, over ``requests``
    (``None`` if no node sends KV)."""
    grown = {node: {k: int(v - before.get(node, {}).get(k, 0.0)) for k, v in figures.items()}
             for node, figures in after.items()}
    sent = [f["transfer_bytes"] for f in grown.values() if "transfer_bytes" in f]
    return {"node_counters": grown,
            "kv_bytes_sent_per_request": round(sum(sent) / max(1, requests)) if sent else None}


def _transformers(model: Path, works: Sequence[loadgen.Workload], rate: float,
                  max_concurrency: int, seed: int, slo_ttft_ms: float | None,
                  slo_tpot_ms: float | None) -> tuple[dict[str, object], list[list[int]]]:
    """Run :mod:`bench.hf_baseline` in a process of its own, one engine thread like the
    cluster's processes."""
    spec = {"model": str(model), "max_concurrency": max_concurrency,
            "request_rate": rate_key(rate), "seed": seed,
            "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
            "works": [{"token_ids": w.token_ids, "new_tokens": w.new_tokens} for w in works]}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(cc.ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", "bench.hf_baseline", f.name],
                              capture_output=True, text=True, env=env, cwd=cc.ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the transformers baseline failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["report"], out["token_ids"]


def goodput_rates(rows: Sequence[Row], level: float = GOODPUT_LEVEL
                  ) -> dict[str, float | str | None]:
    """Per target, the highest tested request rate whose run had at least ``level`` of its
    requests within the SLO: a rate, ``"max"`` for the all-at-once run, or None if no run did.
    Rows without ``goodput`` (no SLO given) are skipped."""
    best: dict[str, float] = {}
    out: dict[str, float | str | None] = {}
    for row in rows:
        if "goodput" not in row:
            continue
        target, rate = str(row["target"]), row["request_rate"]
        out.setdefault(target, None)
        value = math.inf if rate is None else float(rate)  # type: ignore[arg-type]
        good = float(row["goodput"])  # type: ignore[arg-type]
        if good >= level and value > best.get(target, -1.0):
            best[target] = value
            out[target] = "max" if rate is None else value
    return out


def add_ratios(rows: list[Row], outputs: list[list[list[int]]], baseline: str) -> None:
    """Give every row ``ratios`` against the ``baseline`` row of the same rate: throughput
    (higher is better) and latency (lower is better) ratios, and ``same_tokens``: the share of
    requests whose output equals the baseline's."""
    base = {row["request_rate"]: (row, ids) for row, ids in zip(rows, outputs, strict=True)
            if row["target"] == baseline}
    for row, ids in zip(rows, outputs, strict=True):
        if row["request_rate"] not in base:
            continue
        ref, ref_ids = base[row["request_rate"]]
        same = sum(a == b for a, b in zip(ids, ref_ids, strict=True)) / max(1, len(ids))
        row["ratios"] = {**ratios(row, ref), "same_tokens": round(same, 3)}


def ratios(r: Row, base: Row) -> dict[str, float]:
    """``r / base`` of the headline figures (``nan`` where the baseline's is zero)."""
    def ratio(key: str, sub: str | None = None) -> float:
        a, b = r[key], base[key]
        if sub is not None:
            assert isinstance(a, dict) and isinstance(b, dict)
            a, b = a[sub], b[sub]
        assert isinstance(a, (int, float)) and isinstance(b, (int, float))
        return round(a / b, 3) if b else float("nan")

    out = {"request_throughput": ratio("request_throughput"),
           "output_tokens_per_s": ratio("output_tokens_per_s"),
           "ttft_p50": ratio("ttft_ms", "p50"), "tpot_p50": ratio("tpot_ms", "p50")}
    if r.get("kv_bytes_sent_per_request") is not None \
            and base.get("kv_bytes_sent_per_request") is not None:
        out["kv_bytes_sent_per_request"] = ratio("kv_bytes_sent_per_request")
    return out


def table(rows: Sequence[Row], baseline: str) -> str:
    """The rows as a Markdown table (times in ms; ``x`` columns are ratios to ``baseline``)."""
    head = ["target", "rate (req/s)", "req/s", "output tok/s", "TTFT p50 / p99",
            "TPOT p50 / p99", "ITL p50 / p99", "accept len", "cached tok/req", "KV KiB/req",
            f"tok/s x {baseline}", f"TTFT p50 x {baseline}", f"KV/req x {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ratio = row.get("ratios") or {}
        assert isinstance(ratio, dict)
        rate = row["request_rate"]
        cells = [str(row["target"]), "max" if rate is None else f"{rate:g}",
                 f"{row['request_throughput']:.2f}", f"{row['output_tokens_per_s']:.0f}",
                 _pair(row, "ttft_ms"), _pair(row, "tpot_ms"), _pair(row, "itl_ms"),
                 str(row.get("acceptance_length", "-")),
                 f"{row.get('cached_tokens_per_request', 0):.0f}", _kib(row),
                 _num(ratio.get("output_tokens_per_s")), _num(ratio.get("ttft_p50")),
                 _num(ratio.get("kv_bytes_sent_per_request"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pair(row: Row, key: str) -> str:
    s = row[key]
    assert isinstance(s, dict)
    return f"{s['p50']:.1f} / {s['p99']:.1f}"


def _num(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, float) and math.isfinite(x) else "-"


def _kib(row: Row) -> str:
    sent = row.get("kv_bytes_sent_per_request")
    return f"{sent / 1024:.1f}" if isinstance(sent, (int, float)) else "-"
