"""KV transfer benchmark: send_kvcache vs the raw engine vs memcpy, on the same blocks.

A decode node (its own process) holds KV buffers of a model shape; the prefill (this process)
pushes 512 to 16k tokens of KV, as contiguous and as fragmented page lists, over Mooncake on
loopback TCP. For every case it times (a) ``MooncakeKVManager.send_kvcache``, (b) the engine's
``batch_transfer_sync_write`` on the very blocks ``send_kvcache`` builds, and (c) a local memcpy
of those blocks, and prints GB/s with the ratios a/b and b/c.

    python -m bench.transfer --small --json

With ``--tp P:D ...`` it measures head-sliced sends between a prefill of TP ``P`` and a decode of
TP ``D`` against equal TP on the same bytes instead (:mod:`bench.transfer_tp`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from bench.transfer_shape import HOST, Shape, random_pages
from bench.transfer_tp import print_table, run_tp
from transfer.backends.mooncake import MooncakeKVManager
from transfer.bootstrap.messages import Registration
from transfer.plan.blocks import as_page_list, build_blocks, contiguous_runs
from transfer.plan.layers import pair_entries


def _decode_main(conn: Any, shape: Shape) -> None:
    """The decode process: register a pool, publish it, hold it until told to stop."""
    pool = shape.pool()
    mgr = MooncakeKVManager(hostname=HOST)
    mgr.register(pool.buffer_infos())
    conn.send(asdict(Registration(
        session_id=mgr.session_id, kv_ptrs=mgr.kv_ptrs, kv_bytes_per_page=mgr.kv_bytes_per_page,
        kv_layer_ids=mgr.kv_layer_ids or [], num_pages=mgr.num_pages, aux_ptr=0,
        aux_row_bytes=0, aux_num_rows=0, page_size=shape.page_size, dtype=shape.dtype,
        model_fingerprint="bench",
    )))
    conn.recv()


def _best(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(shape: Shape, batch_limit: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child_conn, shape), daemon=True)
    proc.start()
    try:
        reg = Registration(**conn.recv())
        return _measure(shape, reg, batch_limit)
    finally:
        conn.send("stop")
        proc.join(10)


def _case(mgr: MooncakeKVManager, reg: Registration, src: list[int], dst: list[int],
          copy_ptrs: list[int], reps: int) -> dict[str, Any]:
    """Time send_kvcache, the raw engine and memcpy on one page list pair."""
    limit = mgr.batch_limit
    pairs = pair_entries(mgr.kv_layer_ids, reg.kv_layer_ids, len(mgr.kv_ptrs), len(reg.kv_ptrs))
    runs = contiguous_runs(as_page_list(src, "src"), as_page_list(dst, "dst"))
    srcs, dsts, lens = build_blocks(pairs, mgr.kv_ptrs, reg.kv_ptrs, mgr.kv_bytes_per_page, runs)
    _, local_dsts, _ = build_blocks(pairs, mgr.kv_ptrs, copy_ptrs, mgr.kv_bytes_per_page, runs)

    def send() -> object:
        return mgr.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst,
                                dst_layer_ids=reg.kv_layer_ids,
                                dst_bytes_per_page=reg.kv_bytes_per_page)

    def engine() -> None:
        for k in range(0, len(srcs), limit):
            ret = mgr.engine.batch_transfer_sync_write(
                reg.session_id, srcs[k : k + limit], dsts[k : k + limit], lens[k : k + limit])
            if ret != 0:
                raise RuntimeError(f"engine write failed: {ret}")

    def memcpy() -> None:
        for s, d, ln in zip(srcs, local_dsts, lens, strict=True):
            ctypes.memmove(d, s, ln)

    nbytes = sum(lens)
    t_send, t_eng, t_mem = (_best(f, reps) for f in (send, engine, memcpy))
    return {"blocks": len(srcs), "bytes": nbytes, "t_send": t_send, "t_engine": t_eng,
            "t_memcpy": t_mem, "send_kvcache_gbps": nbytes / t_send / 1e9,
            "engine_gbps": nbytes / t_eng / 1e9, "memcpy_gbps": nbytes / t_mem / 1e9}


def _measure(shape: Shape, reg: Registration, batch_limit: int) -> dict[str, Any]:
    src_pool, copy_pool = shape.pool(), shape.pool()
    for e in src_pool.entries():
        e.copy_(torch.randn(e.shape).to(e.dtype))
    mgr = MooncakeKVManager(hostname=HOST, batch_limit=batch_limit)
    mgr.register(src_pool.buffer_infos())
    copy_ptrs = [b.ptr for b in copy_pool.buffer_infos()]
    rng = random.Random(0)
    cases = []
    for tokens in shape.tokens:
        for fragmented in (False, True):
            n = -(-tokens // shape.page_size)
            src = random_pages(n, shape.num_pages, fragmented, rng)
            dst = random_pages(n, shape.num_pages, fragmented, rng)
            case = _case(mgr, reg, src, dst, copy_ptrs, shape.reps)
            cases.append({"tokens": tokens, "fragmented": fragmented, **case})
    total = sum(c["bytes"] for c in cases)
    send_g, eng_g, mem_g = (total / sum(c[k] for c in cases) / 1e9
                            for k in ("t_send", "t_engine", "t_memcpy"))
    return {
        "shape": asdict(shape), "batch_limit": batch_limit,
        "send_kvcache_gbps": send_g, "engine_gbps": eng_g, "memcpy_gbps": mem_g,
        "send_over_engine": send_g / eng_g, "engine_over_memcpy": eng_g / mem_g,
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="8 layers, 512 and 2048 tokens")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-limit", type=int, default=1024)
    ap.add_argument("--tp", nargs="+", default=[], metavar="P:D",
                    help="prefill TP : decode TP pairs, each against equal TP on the same bytes")
    args = ap.parse_args(argv)
    layers, tokens = (8, (512, 2048)) if args.small else (args.layers, tuple(args.tokens))
    shape = Shape(layers, args.kv_heads, args.head_dim, args.page_size, args.dtype, tokens,
                  args.reps)
    if args.tp:
        pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.tp]
        tp_result = run_tp(shape, [(p, d) for p, d in pairs])
        if args.json:
            print(json.dumps(tp_result))
        else:
            print_table(tp_result)
        return
    result = run(shape, args.batch_limit)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'tokens':>7} {'layout':>10} {'blocks':>7} {'send GB/s':>10} {'engine GB/s':>12} "
          f"{'memcpy GB/s':>12}")
    for c in result["cases"]:
        layout = "fragmented" if c["fragmented"] else "contiguous"
        print(f"{c['tokens']:>7} {layout:>10} {c['blocks']:>7} {c['send_kvcache_gbps']:>10.2f} "
              f"{c['engine_gbps']:>12.2f} {c['memcpy_gbps']:>12.2f}")
    print(f"overall: send {result['send_kvcache_gbps']:.2f} GB/s, engine "
          f"{result['engine_gbps']:.2f} GB/s, memcpy {result['memcpy_gbps']:.2f} GB/s; "
          f"send/engine {result['send_over_engine']:.3f}, engine/memcpy "
          f"{result['engine_over_memcpy']:.3f}")


if __name__ == "__main__":
    main()
