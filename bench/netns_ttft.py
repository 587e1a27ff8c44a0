"""Time to first token of a long prompt as the network's latency grows, disaggregated vs
colocated, across hosts on one machine (:mod:`bench.netns_hosts`).

Three hosts: 0 runs the routers and the client, 1 the prefill, 2 the decodes. Disaggregated:
the router in host 0 sends each request to the prefill in host 1 and the decode in host 2, and
the prompt's KV moves from host 1 to host 2 over Mooncake. Colocated: the other router in host
0 sends it to a decode in host 2 that computes the prompt itself. Every host's link gets the
same added delay ``d`` (a round trip between two hosts gains ``2 d``); a client in host 0
streams one request at a time (a fresh random prompt each, so no prefix cache helps) and takes
its TTFT: the first message with a token. Each delay's row is the median of ``--reps``
requests per target after one warm-up request each; the 0 ms row is the baseline.

    python -m bench.netns_ttft --reps 5                 # 2,048 tokens, delays 0 1 5 10 ms
    python -m bench.netns_ttft --model qwen2-0.5b       # a 0.5B-parameter checkpoint's KV
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.checkpoints import shaped_or_dir
from bench.clusters import Proc, Processes, engine_flags
from bench.netns_hosts import Host, Hosts, cleanup_leftovers, unavailable
from bench.random_prompts import prompts
from engine.builtin import builtin_model_dir
from engine.config import ModelConfig

TARGETS = ("disaggregated", "colocated")


def _start(procs: Processes, host: Host, name: str, args: Sequence[str]) -> Proc:
    """``pdserve ARGS`` in ``host``, bound to and advertising its address."""
    return procs.start(name, [*args, "--host", host.address], netns=host.netns)


def _address(host: Host, proc: Proc) -> str:
    return f"{host.address}:{proc.port}"


def start_targets(procs: Processes, hosts: Hosts, model: Path,
                  prompt_len: int) -> dict[str, str]:
    """Both targets' routers (their addresses in host 0), every node ready."""
    engine = [*engine_flags(model, num_pages=4 * -(-prompt_len // 16) + 64, max_num_seqs=4,
                            max_num_batched_tokens=prompt_len),
              "--advertise-host"]
    prefill = _start(procs, hosts[1], "prefill", ["prefill", *engine, hosts[1].address])
    decode = _start(procs, hosts[2], "decode", ["decode", *engine, hosts[2].address])
    colocated = _start(procs, hosts[2], "colocated decode",
                       ["decode", *engine, hosts[2].address])
    procs.wait_ready([prefill, decode, colocated])
    router = ["router", "--model", str(model), "--port", "0"]
    disagg_router = _start(procs, hosts[0], "disaggregated router", [
        *router, "--prefill", _address(hosts[1], prefill),
        "--decode", _address(hosts[2], decode)])
    coloc_router = _start(procs, hosts[0], "colocated router", [
        *router, "--colocated", _address(hosts[2], colocated)])
    procs.wait_ready([disagg_router, coloc_router])
    return {"disaggregated": _address(hosts[0], disagg_router),
            "colocated": _address(hosts[0], coloc_router)}


def _client(conn: Connection) -> None:
    """The client (in host 0): answers ``(router, token_ids, new_tokens)`` with the request's
    TTFT in seconds, until the other end closes."""
    from bench import loadgen
    from proto.pdserve.v1 import generate_pb2_grpc

    async def ttft(address: str, ids: list[int], new_tokens: int) -> float:
        import grpc

        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            # the channel connects before the clock starts: a client's connection is set up
            # once, not per request
            await channel.channel_ready()
            trace = await loadgen.one_request(stub, loadgen.Workload(new_tokens, ids), 120.0)
        if not trace.ok:
            raise RuntimeError(f"request to {address} failed: {trace.error}")
        return trace.ttft

    while True:
        try:
            address, ids, new_tokens = conn.recv()
        except EOFError:
            return
        conn.send(asyncio.run(ttft(address, ids, new_tokens)))


def run(model: Path, delays: Sequence[float], reps: int, prompt_len: int,
        new_tokens: int) -> dict[str, Any]:
    """Every delay's median TTFT (ms) of both targets, on three fresh hosts."""
    import multiprocessing as mp

    vocab = ModelConfig.from_dir(model).text.vocab_size
    asks = iter(prompts(len(delays) * len(TARGETS) * (reps + 1), prompt_len, vocab, seed=7))
    rows = []
    procs = Processes()
    with Hosts(3) as hosts:
        try:
            routers = start_targets(procs, hosts, model, prompt_len)
            conn, child = mp.get_context("spawn").Pipe()
            hosts[0].spawn(_client, child)
            child.close()

            def ttft_ms(target: str) -> float:
                conn.send((routers[target], next(asks), new_tokens))
                if not conn.poll(180):
                    raise TimeoutError(f"no TTFT from the {target} target in 180 s")
                return float(conn.recv()) * 1e3

            for delay in delays:
                for host in hosts:
                    host.link.set(delay_ms=delay)
                row: dict[str, Any] = {"delay_ms": delay, "rtt_added_ms": 2 * delay}
                for target in TARGETS:
                    ttft_ms(target)  # warm-up: the first request after a change pays extra
                    samples = [ttft_ms(target) for _ in range(reps)]
                    row[target] = {"median_ms": statistics.median(samples),
                                   "min_ms": min(samples), "max_ms": max(samples)}
                rows.append(row)
        finally:
            procs.stop_all()
    base = rows[0]
    for row in rows:
        for target in TARGETS:
            row[target]["added_ms"] = row[target]["median_ms"] - base[target]["median_ms"]
        row["disaggregated_over_colocated"] = (row["disaggregated"]["median_ms"]
                                               / row["colocated"]["median_ms"])
    return {"model": str(model), "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "reps": reps, "cores": os.cpu_count(), "rows": rows}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.netns_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a checkpoint directory or a shape name (qwen2-0.5b); default: the "
                         "built-in tiny model")
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 1, 5, 10],
                    help="ms added on every host's link; the first is the baseline")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    reason = unavailable()
    if reason:
        ap.error(f"cannot build hosts here: {reason}")
    cleanup_leftovers()
    model = shaped_or_dir(args.model) if args.model else builtin_model_dir()
    result = run(model, args.delays, args.reps, args.prompt_len, args.new_tokens)
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    print(f"{result['prompt_tokens']}-token prompt, {args.new_tokens} new tokens, model "
          f"{result['model']}; median (min-max) of {args.reps} requests per cell, 3 hosts "
          f"(network namespaces) on one machine of {result['cores']} cores")
    print(f"{'added RTT':>10} | {'disaggregated TTFT':>26} | {'colocated TTFT':>26} | "
          f"{'disagg/coloc':>12}")
    for row in result["rows"]:
        cells = [f"{row[t]['median_ms']:7.1f} ms ({row[t]['min_ms']:.0f}-{row[t]['max_ms']:.0f})"
                 f" {row[t]['added_ms']:+6.1f}" for t in TARGETS]
        print(f"{row['rtt_added_ms']:7.0f} ms | {cells[0]:>26} | {cells[1]:>26} | "
              f"{row['disaggregated_over_colocated']:12.2f}")
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
