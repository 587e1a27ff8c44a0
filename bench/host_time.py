"""Host time per decode step: the step's wall time minus the time spent in the model itself.

"The model itself" is the decoder forward (every layer's projections, attention and MLP) and the
LM head; everything else a step does (schedule, build ids/positions/slots/page tables, attention
metadata, sampling, bookkeeping) is host time: the part that a GPU cannot hide and that a CUDA
graph does not capture. Timers wrap the model's ``forward`` and ``logits`` on the instance, so
the measurement needs no hook in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.request import SamplingParams
from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class HostTime:
    batch: int
    steps: int
    step_ms: float  # mean wall time of one decode step
    model_ms: float  # of which inside the model's forward and LM head
    host_ms: float  # the rest

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "steps": self.steps, "step_ms": round(self.step_ms, 3),
                "model_ms": round(self.model_ms, 3), "host_ms": round(self.host_ms, 3)}


def _timed(
    fn: Callable[..., Any], acc: list[float], sync: Callable[[], None]
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        acc[0] += time.perf_counter() - start
        return out

    return wrapper


def measure_host_time(engine: LLMEngine, prompts: list[list[int]], steps: int) -> HostTime:
    """Prefill ``prompts`` together, then time ``steps`` decode steps of the whole batch."""
    params = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    reqs = [engine.add_request(p, sampling=params) for p in prompts]
    while any(r.num_output_tokens == 0 for r in reqs):  # prefill (and its first token)
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    device = engine.pool.k[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    acc = [0.0]
    model = engine.model
    model.forward = _timed(model.forward, acc, sync)  # type: ignore[method-assign]
    model.logits = _timed(model.logits, acc, sync)  # type: ignore[method-assign]
    try:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    finally:
        del model.forward, model.logits  # back to the class's methods
    for r in reqs:
        engine.abort(r.request_id)
    step_ms, model_ms = 1e3 * wall / steps, 1e3 * acc[0] / steps
    return HostTime(len(prompts), steps, step_ms, model_ms, step_ms - model_ms)


def main() -> None:
    """``python -m bench.host_time [--model DIR] [--batch-sizes 1,32] [--steps 50] [--repeat 2]``:
    host ms per decode step of 128-token prompts, one JSON line per measurement."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from bench.random_prompts import prompts
    from engine.builtin.tiny_model import write_tiny_model
    from engine.config import EngineConfig

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", help="checkpoint directory (default: a fresh tiny model)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else write_tiny_model(Path(tmp) / "tiny")
        vocab = json.loads((model_dir / "config.json").read_text())
        vocab = (vocab.get("text_config") or vocab)["vocab_size"]
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            engine = LLMEngine(model_dir, EngineConfig(num_pages=2048, page_size=16,
                                                       max_num_seqs=256,
                                                       max_num_batched_tokens=4096))
            for _ in range(args.repeat):
                print(json.dumps(measure_host_time(engine, prompts(bs, 128, vocab), args.steps)
                                 .as_dict()))


if __name__ == "__main__":
    main()
