"""KV transfer between a prefill and a decode of different TP size, against equal TP.

The decode process holds, for every TP size in the runs, that many rank managers, each a pool of
its TP heads; the prefill (this process) likewise, with a staging buffer per rank. For each
``P:D`` pair and each page list it times every prefill rank sending its planned head slices
(:func:`transfer.plan.heads.plan_head_copies`, ranks one after another) and compares with equal TP
``P:P`` and ``D:D`` on the same page lists: the same total bytes, every KV head of every page
once. The three are timed in turns, rep by rep (best of ``--reps`` each), so that load from
other processes falls on all three alike. A prefill rank whose slice lands (a smaller decode
TP, :mod:`transfer.plan.heads`) writes whole pages into the decode rank's landing buffer, and the
decode's scatter into its pool counts in the time. Reported ratios are heterogeneous GB/s
over equal-TP GB/s; ``ratio_same_blocks`` is the one over equal TP at the larger of the two
sizes, which sends as many page-sized blocks as the heterogeneous send (the smaller size sends
fewer, larger blocks: a property of the TP size, not of the slicing).

    python -m bench.transfer --small --tp 1:2 2:1 --json
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from bench.transfer_shape import HOST, Shape, random_pages
from engine.kv.pool import KVPool
from engine.kv.staging import HeadLandingBuffer, HeadStagingBuffer
from transfer.backends.mooncake import MooncakeKVManager
from transfer.bootstrap.messages import Registration
from transfer.plan.heads import HeadLayout, landing_slices, plan_head_copies

STAGING_BYTES = 64 << 20


def _layout(shape: Shape, tp: int) -> HeadLayout:
    return HeadLayout.tensor_parallel(shape.kv_heads, tp, head_dim=shape.head_dim,
                                      dtype=shape.dtype, page_size=shape.page_size)


def _rank_pool(shape: Shape, heads: int) -> KVPool:
    return KVPool(shape.num_pages, shape.page_size, heads, shape.head_dim,
                  list(range(shape.layers)), getattr(torch, shape.dtype))


def _decode_main(conn: Any, shape: Shape, pairs: list[tuple[int, int]]) -> None:
    """Register every TP size's rank pools (with a landing buffer per pair that lands on
    them), publish them, then scatter landed pages when asked, until told to stop."""
    sizes = sorted({t for pair in pairs for t in pair})
    keep: list[Any] = []
    regs: dict[int, list[dict[str, Any]]] = {}
    landings: dict[tuple[int, int], list[HeadLandingBuffer | None]] = {}
    slots: dict[tuple[int, int], list[list[tuple[list[int], list[int], list[int]]]]] = {}
    for tp in sizes:
        regs[tp] = []
        for j, (_, count) in enumerate(_layout(shape, tp).ranges):
            pool = _rank_pool(shape, count)
            mine = []
            for p, d in pairs:
                if d != tp:
                    continue
                slices = landing_slices(_layout(shape, p), _layout(shape, d), j)
                buf = (HeadLandingBuffer(pool.entries(), pool.entry_layer_ids(), slices,
                                         shape.num_pages) if slices else None)
                landings.setdefault((p, d), []).append(buf)
                if buf is None:
                    continue
                mine.extend(buf.buffer_infos())
                infos = [buf.buffer_infos(k) for k in range(len(slices))]
                slots.setdefault((p, d), [[] for _ in range(d)])[j] = [
                    ([b.ptr for b in i], [b.layer_id for b in i], [b.bytes_per_page for b in i])
                    for i in infos]
            mgr = MooncakeKVManager(hostname=HOST)
            mgr.register(pool.buffer_infos(), landing=mine)
            keep.append((pool, mgr))
            regs[tp].append(asdict(Registration(
                session_id=mgr.session_id, kv_ptrs=mgr.kv_ptrs,
                kv_bytes_per_page=mgr.kv_bytes_per_page, kv_layer_ids=mgr.kv_layer_ids or [],
                num_pages=mgr.num_pages, aux_ptr=0, aux_row_bytes=0, aux_num_rows=0,
                page_size=shape.page_size, dtype=shape.dtype, model_fingerprint="bench")))
    conn.send((regs, slots))
    while (msg := conn.recv()) != "stop":
        p, d, pages = msg
        t0 = time.perf_counter()
        for buf in landings[p, d]:
            if buf is not None:
                buf.scatter(pages, pages)
        conn.send(time.perf_counter() - t0)


def _prefill_ranks(shape: Shape, tp: int) -> list[MooncakeKVManager]:
    mgrs = []
    for _, count in _layout(shape, tp).ranges:
        pool = _rank_pool(shape, count)
        for e in pool.entries():
            e.copy_(torch.randn(e.shape).to(e.dtype))
        mgr = MooncakeKVManager(hostname=HOST)
        mgr.register(pool.buffer_infos(), staging=HeadStagingBuffer(pool.entries(), STAGING_BYTES))
        mgr.pool = pool  # type: ignore[attr-defined]  # keep the buffers alive with the manager
        mgrs.append(mgr)
    return mgrs


def _sender(shape: Shape, p: int, d: int, src_mgrs: list[MooncakeKVManager],
            regs: list[Registration], slots: list[list[Any]] | None, conn: Any,
            src: list[int], dst: list[int]) -> tuple[Callable[[], float], int, int]:
    """A timed send of every rank's slices, landing ones into the landing buffer (``slots``:
    per decode rank, per landing slot, pointers, ids and bytes per page) and then scattered by
    the decode, whose time counts; with the bytes and blocks of one send (after a warm-up)."""
    src_l, dst_l = _layout(shape, p), _layout(shape, d)
    plans = [plan_head_copies(src_l, dst_l, r) for r in range(p)]
    lands = slots is not None and any(c.lands for copies in plans for c in copies)

    def once() -> tuple[int, int]:
        nbytes = blocks = 0
        for mgr, copies in zip(src_mgrs, plans, strict=True):
            for c in copies:
                reg = regs[c.dst_rank]
                if c.lands and slots is not None:
                    slot = landing_slices(src_l, dst_l, c.dst_rank).index((c.dst_head, c.count))
                    ptrs, ids, bpp = slots[c.dst_rank][slot]
                    res = mgr.send_kvcache(reg.session_id, src, ptrs, dst, dst_layer_ids=ids,
                                           dst_bytes_per_page=bpp)
                else:
                    res = mgr.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst,
                                           dst_layer_ids=reg.kv_layer_ids,
                                           dst_bytes_per_page=reg.kv_bytes_per_page, dst_heads=c)
                nbytes, blocks = nbytes + res.nbytes, blocks + res.blocks
        return nbytes, blocks

    def timed() -> float:
        t0 = time.perf_counter()
        once()
        if not lands:
            return time.perf_counter() - t0
        conn.send((p, d, dst))  # the decode scatters what landed: its time counts
        conn.recv()
        return time.perf_counter() - t0

    nbytes, blocks = once()
    return timed, nbytes, blocks


def run_tp(shape: Shape, pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Heterogeneous vs equal TP for every ``(P, D)`` in ``pairs`` (see the module docstring)."""
    sizes = sorted({t for pair in pairs for t in pair})
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child_conn, shape, list(pairs)), daemon=True)
    proc.start()
    try:
        raw_regs, slots = conn.recv()
        regs = {tp: [Registration(**r) for r in rs] for tp, rs in raw_regs.items()}
        srcs = {tp: _prefill_ranks(shape, tp) for tp in sizes}
        rng = random.Random(0)
        lists = []
        for tokens in shape.tokens:
            n = -(-tokens // shape.page_size)
            for fragmented in (False, True):
                lists.append((tokens, fragmented,
                              random_pages(n, shape.num_pages, fragmented, rng),
                              random_pages(n, shape.num_pages, fragmented, rng)))
        runs = []
        for p, d in pairs:
            totals = {"hetero": [0.0, 0], "equal_p": [0.0, 0], "equal_d": [0.0, 0]}
            cases = []
            for tokens, fragmented, src, dst in lists:
                case: dict[str, Any] = {"tokens": tokens, "fragmented": fragmented}
                senders = {key: _sender(shape, a, b, srcs[a], regs[b], slots.get((a, b)), conn,
                                        src, dst)
                           for key, (a, b) in (("hetero", (p, d)), ("equal_p", (p, p)),
                                               ("equal_d", (d, d)))}
                # interleaved reps, so that load from elsewhere hits the three alike; best of
                best = {key: min(times) for key, times in zip(senders, zip(*(
                    [fn() for fn, _, _ in senders.values()] for _ in range(shape.reps)
                ), strict=True), strict=True)}
                for key, (_, nbytes, blocks) in senders.items():
                    case[f"{key}_gbps"] = nbytes / best[key] / 1e9
                    case[f"{key}_blocks"] = blocks
                    totals[key][0] += best[key]
                    totals[key][1] = int(totals[key][1]) + nbytes
                cases.append(case)
            gbps = {k: v[1] / v[0] / 1e9 for k, v in totals.items()}
            runs.append({"prefill_tp": p, "decode_tp": d, **{f"{k}_gbps": v for k, v in
                                                            gbps.items()},
                         "ratio_vs_prefill_tp": gbps["hetero"] / gbps["equal_p"],
                         "ratio_vs_decode_tp": gbps["hetero"] / gbps["equal_d"],
                         # equal TP at the larger size sends as many page-sized blocks
                         "ratio_same_blocks": gbps["hetero"] / gbps["equal_d" if d > p
                                                                    else "equal_p"],
                         "cases": cases})
        return {"shape": asdict(shape), "runs": runs}
    finally:
        conn.send("stop")
        proc.join(10)


def print_table(result: dict[str, Any]) -> None:
    print(f"{'P:D':>5} {'hetero GB/s':>12} {'P:P GB/s':>9} {'D:D GB/s':>9} "
          f"{'vs P:P':>7} {'vs D:D':>7} {'same blocks':>12}")
    for r in result["runs"]:
        print(f"{r['prefill_tp']:>2}:{r['decode_tp']:<2} {r['hetero_gbps']:>12.3f} "
              f"{r['equal_p_gbps']:>9.3f} {r['equal_d_gbps']:>9.3f} "
              f"{r['ratio_vs_prefill_tp']:>7.3f} {r['ratio_vs_decode_tp']:>7.3f} "
              f"{r['ratio_same_blocks']:>12.3f}")
