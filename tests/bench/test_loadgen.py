"""The prefix-cache loads of ``pdserve bench`` (shared prefix, multi-turn) and the per-run KV
figures of ``--compare``, without a cluster."""

from __future__ import annotations

import argparse

from bench import loadgen
from bench.compare import kv_figures, ratios
from cli.bench import add_bench_args, workloads


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(["--compare", *argv])


def test_shared_prefix_ratio_sets_the_common_part() -> None:
    works = workloads(_args("--dataset", "shared-prefix", "--input-len", "100",
                            "--shared-prefix-ratio", "0.9", "--num-requests", "3"))
    assert isinstance(works, list)
    ids = [w.token_ids or [] for w in works]
    assert all(len(p) == 100 for p in ids)
    assert ids[0][:90] == ids[1][:90] == ids[2][:90]
    assert len({tuple(p[90:]) for p in ids}) == 3


def test_multi_turn_prompt_is_the_conversation_so_far() -> None:
    load = workloads(_args("--dataset", "multi-turn", "--num-conversations", "2",
                           "--num-turns", "3", "--turn-len", "5", "--output-len", "2"))
    assert isinstance(load, loadgen.MultiTurn)
    assert len(load) == 6 and load.new_tokens == 2
    again = loadgen.multi_turn_workloads(2, 3, 5, 2, vocab=512, seed=0)
    assert again == load  # deterministic by seed
    assert loadgen.multi_turn_workloads(2, 3, 5, 2, vocab=512, seed=1) != load
    m = load.messages[1]
    assert [len(x) for x in m] == [5, 5, 5] and m != load.messages[0]
    assert load.prompt(1, []) == m[0]
    assert load.prompt(1, [[7, 8], [9]]) == m[0] + [7, 8] + m[1] + [9] + m[2]


def test_kv_figures_are_what_each_node_did_in_the_run() -> None:
    before = {"prefill": {"transfer_bytes": 1000.0, "kv_bytes_not_sent": 0.0},
              "decode": {"kv_pages_not_sent": 2.0}}
    after = {"prefill": {"transfer_bytes": 5000.0, "kv_bytes_not_sent": 9000.0},
             "decode": {"kv_pages_not_sent": 7.0}}
    figures = kv_figures(before, after, requests=4)
    assert figures == {"node_counters": {"prefill": {"transfer_bytes": 4000,
                                                     "kv_bytes_not_sent": 9000},
                                         "decode": {"kv_pages_not_sent": 5}},
                       "kv_bytes_sent_per_request": 1000}
    colocated = kv_figures({}, {"colocated decode": {"kv_pages_not_sent": 0.0}}, requests=4)
    assert colocated["kv_bytes_sent_per_request"] is None
    row = {"request_throughput": 2.0, "output_tokens_per_s": 20.0, "ttft_ms": {"p50": 10.0},
           "tpot_ms": {"p50": 1.0}, "kv_bytes_sent_per_request": 250}
    base = {"request_throughput": 1.0, "output_tokens_per_s": 10.0, "ttft_ms": {"p50": 40.0},
            "tpot_ms": {"p50": 1.0}, "kv_bytes_sent_per_request": 1000}
    assert ratios(row, base) == {"request_throughput": 2.0, "output_tokens_per_s": 2.0,
                                 "ttft_p50": 0.25, "tpot_p50": 1.0,
                                 "kv_bytes_sent_per_request": 0.25}
    assert "kv_bytes_sent_per_request" not in ratios({**row, "kv_bytes_sent_per_request": None},
                                                     base)
