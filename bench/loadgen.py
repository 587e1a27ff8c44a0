"""Load generation against a running router: workloads, arrivals, per-request traces, statistics.

Used by ``pdserve bench`` and ``bench.serving``. A request's trace is the arrival time and
token count of every stream message; TTFT is the first message carrying tokens, TPOT the mean
time per output token after the first, ITL one sample per token after the first message (its
message's gap divided by the tokens the message carried). A load is a list of independent
:class:`Workload` requests or a :class:`MultiTurn` set of conversations, whose turns are built
from the answers the server gave to the turns before.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine.builtin.stdlib_corpus import heldout_prompts
from proto.pdserve.v1 import generate_pb2 as gpb
from proto.pdserve.v1 import generate_pb2_grpc


@dataclass(frozen=True)
class Workload:
    """One request to send: a prompt (token ids or text) and how many tokens to ask for."""

    new_tokens: int
    token_ids: list[int] | None = None
    text: str | None = None
    images: list[bytes] = field(default_factory=list)

    def request(self) -> gpb.GenerateRequest:
        sampling = gpb.SamplingParams(max_new_tokens=self.new_tokens, ignore_eos=True)
        images = [gpb.Image(encoded=b) for b in self.images]
        if self.text is not None:
            return gpb.GenerateRequest(text=self.text, images=images, sampling=sampling)
        return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=self.token_ids or []),
                                   images=images, sampling=sampling)


@dataclass
class Trace:
    """One request as the client saw it (``time.perf_counter`` seconds)."""

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per message
    token_ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache (``usage``)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and any(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float:
        return next(t for t, n in self.arrivals if n) - self.start

    @property
    def e2e(self) -> float:
        return self.arrivals[-1][0] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (None for one-token answers)."""
        n = len(self.token_ids)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def itl(self) -> list[float]:
        out: list[float] = []
        for (prev, _), (now, n) in zip(self.arrivals, self.arrivals[1:], strict=False):
            out.extend([(now - prev) / n] * n)
        return out


# ---- workloads -----------------------------------------------------------------------------


def random_workloads(count: int, input_mean: int, output_mean: int, vocab: int,
                     seed: int = 0, spread: float = 0.5) -> list[Workload]:
    """Random token-id prompts; lengths uniform in ``mean * (1 +- spread)``."""
    rng = random.Random(seed)
    top = min(vocab, 500) - 1  # stay below the special tokens at the top of small vocabularies
    return [Workload(_length(rng, output_mean, spread),
                     [rng.randint(0, top) for _ in range(_length(rng, input_mean, spread))])
            for _ in range(count)]


def _length(rng: random.Random, mean: int, spread: float) -> int:
    """A length uniform in ``mean * (1 +- spread)``, at least 1."""
    return max(1, round(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def code_workloads(count: int, input_len: int, output_mean: int,
                   encode: Callable[[str], list[int]], seed: int = 0,
                   spread: float = 0.5) -> list[Workload]:
    """Real-text prompts of up to ``input_len`` token ids cut from the standard-library files the
    built-in model held out of training (:mod:`engine.builtin.stdlib_corpus`); new-token counts
    uniform in ``output_mean * (1 +- spread)``."""
    rng = random.Random(seed)
    return [Workload(_length(rng, output_mean, spread), ids)
            for ids in heldout_prompts(encode, count, input_len)]


def shared_prefix_workloads(count: int, prefix_len: int, suffix_len: int, output: int,
                            vocab: int, seed: int = 0) -> list[Workload]:
    """Prompts that share one random prefix and differ in a random suffix."""
    rng = random.Random(seed)
    top = min(vocab, 500) - 1
    prefix = [rng.randint(0, top) for _ in range(prefix_len)]
    return [Workload(output, prefix + [rng.randint(0, top) for _ in range(suffix_len)])
            for _ in range(count)]


@dataclass(frozen=True)
class MultiTurn:
    """Conversations that run concurrently, each turn after the answer to the one before.

    ``messages[c][t]`` is the new user message (token ids) of turn ``t`` in conversation ``c``.
    Turn ``t``'s prompt is the conversation so far: every earlier message followed by the
    token ids the server actually answered it with, then message ``t``
    (:meth:`prompt`). Every turn asks for ``new_tokens``."""

    messages: list[list[list[int]]]
    new_tokens: int

    def __len__(self) -> int:
        """The number of requests: turns over all conversations."""
        return sum(len(turns) for turns in self.messages)

    def prompt(self, conversation: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """The prompt of the turn after ``answers`` (one per earlier turn) in ``conversation``."""
        out: list[int] = []
        for message, answer in zip(self.messages[conversation], answers, strict=False):
            out += message
            out += answer
        return out + self.messages[conversation][len(answers)]


def multi_turn_workloads(conversations: int, turns: int, message_len: int, output: int,
                         vocab: int, seed: int = 0) -> MultiTurn:
    """``conversations`` chats of ``turns`` user messages of ``message_len`` random token ids."""
    rng = random.Random(seed)
    top = min(vocab, 500) - 1
    return MultiTurn([[[rng.randint(0, top) for _ in range(message_len)] for _ in range(turns)]
                      for _ in range(conversations)], output)


def image_workloads(count: int, output: int, seed: int = 0) -> list[Workload]:
    """Text prompts with one small random PNG each."""
    import io

    from PIL import Image

    rng = random.Random(seed)
    out = []
    for i in range(count):
        w, h = rng.choice([(56, 56), (84, 56), (112, 84)])
        img = Image.frombytes("RGB", (w, h), bytes(rng.getrandbits(8) for _ in range(w * h * 3)))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(Workload(output, text=f"describe picture {i}", images=[buf.getvalue()]))
    return out


def jsonl_workloads(path: Path, output: int) -> list[Workload]:
    """One prompt per line: ``{"prompt": "...", "max_new_tokens": N}`` or ``{"token_ids": []}``."""
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            new = int(row.get("max_new_tokens", output))
            if "token_ids" in row:
                out.append(Workload(new, token_ids=[int(t) for t in row["token_ids"]]))
            else:
                out.append(Workload(new, text=str(row["prompt"])))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad prompt line: {exc}") from exc
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


# ---- sending -----------------------------------------------------------------------------------


async def one_request(stub: generate_pb2_grpc.GenerationStub, work: Workload,
                      timeout_s: float | None = None) -> Trace:
    trace = Trace(time.perf_counter())
    try:
        async for msg in stub.Generate(work.request(), timeout=timeout_s):
            trace.arrivals.append((time.perf_counter(), len(msg.token_ids)))
            trace.token_ids.extend(msg.token_ids)
            if msg.finished:
                trace.drafted, trace.accepted = msg.usage.drafted_tokens, msg.usage.accepted_tokens
                trace.prompt_tokens = msg.usage.prompt_tokens
                trace.cached_tokens = msg.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        trace.error = f"{exc.code().name}: {exc.details()}"
    return trace


def arrival_offsets(count: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``count`` requests arrives: Poisson arrivals
    at ``request_rate`` per second (``inf``: all at once). The same seed gives every target
    (and the transformers baseline) the same schedule."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(count):
        out.append(t)
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
    return out


Load = Sequence[Workload] | MultiTurn
# the bench's warm-up request: token ids no dataset draws in this order, so it leaves nothing in
# a prefix cache that a measured run could find
WARMUP = Workload(2, token_ids=list(range(3, 35)))


async def run(address: str, works: Load, *, max_concurrency: int,
              request_rate: float = math.inf, seed: int = 0,
              on_done: Callable[[Trace], None] | None = None) -> tuple[list[Trace], float]:
    """Send ``works`` with Poisson arrivals at ``request_rate`` per second (``inf``: all at
    once) and at most ``max_concurrency`` requests in flight; returns the traces and the wall
    time. A :class:`MultiTurn` load arrives a conversation at a time (``request_rate`` counts
    conversations), each sending its next turn when the answer to the last one has ended; its
    traces are in conversation order, turns in order within each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        gate = asyncio.Semaphore(max_concurrency)

        async def send(work: Workload | None) -> Trace:
            if work is None:  # a turn after a failed one: no answer to build its prompt from
                trace = Trace(time.perf_counter(), error="an earlier turn failed")
            else:
                async with gate:
                    trace = await one_request(stub, work)
            if on_done is not None:
                on_done(trace)
            return trace

        async def converse(c: int) -> list[Trace]:
            assert isinstance(works, MultiTurn)
            traces: list[Trace] = []
            for _ in works.messages[c]:
                ok = all(t.ok for t in traces)
                prompt = works.prompt(c, [t.token_ids for t in traces])
                traces.append(await send(Workload(works.new_tokens, prompt) if ok else None))
            return traces

        units = len(works.messages) if isinstance(works, MultiTurn) else len(works)
        offsets = arrival_offsets(units, request_rate, seed)
        start = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(
                converse(i) if isinstance(works, MultiTurn) else _one(send(works[i]))))
        done = await asyncio.gather(*tasks)
        return [t for traces in done for t in traces], time.perf_counter() - start


async def _one(trace: Awaitable[Trace]) -> list[Trace]:
    return [await trace]


# ---- statistics --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90 and p99 of seconds, in milliseconds."""
    mean = sum(values) / len(values) if values else float("nan")
    out = {"mean": mean, **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}
    return {k: round(v * 1000.0, 3) for k, v in out.items()}


def report(traces: Sequence[Trace], wall_s: float, num_draft_tokens: int = 0,
           slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict[str, object]:
    """The benchmark's JSON: throughput, latency summaries, failures, goodput, acceptance."""
    done = [t for t in traces if t.ok]
    tokens = sum(len(t.token_ids) for t in done)
    tpots = [x for t in done if (x := t.tpot) is not None]
    n = max(1, len(done))
    out: dict[str, object] = {
        "completed": len(done),
        "failed": len(traces) - len(done),
        "errors": sorted({t.error for t in traces if t.error})[:5],
        "wall_s": round(wall_s, 3),
        "request_throughput": round(len(done) / wall_s, 3) if wall_s else 0.0,
        "output_tokens_per_s": round(tokens / wall_s, 1) if wall_s else 0.0,
        "total_output_tokens": tokens,
        "prompt_tokens_per_request": round(sum(t.prompt_tokens for t in done) / n, 1),
        "cached_tokens_per_request": round(sum(t.cached_tokens for t in done) / n, 1),
        "ttft_ms": summary_ms([t.ttft for t in done]),
        "tpot_ms": summary_ms(tpots),
        "itl_ms": summary_ms([x for t in done for x in t.itl()]),
        "e2e_ms": summary_ms([t.e2e for t in done]),
    }
    drafted = sum(t.drafted for t in done)
    if drafted:
        accepted = sum(t.accepted for t in done)
        out["draft_acceptance_rate"] = round(accepted / drafted, 4)
        if num_draft_tokens:  # tokens per verify round: accepted drafts per round + the bonus
            out["acceptance_length"] = round(1 + num_draft_tokens * accepted / drafted, 3)
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = [t for t in done
                if (slo_ttft_ms is None or t.ttft * 1000 <= slo_ttft_ms)
                and (slo_tpot_ms is None or (t.tpot or 0.0) * 1000 <= slo_tpot_ms)]
        out["goodput"] = round(len(good) / len(traces), 4) if traces else 0.0
    return out
