"""The baseline peer of ``pdserve bench --compare``: transformers' ``generate`` on the same
checkpoint, the same prompt token ids and the same numbers of new tokens, greedy.

``generate`` is a static batch: it serves up to ``max_concurrency`` requests that have arrived
(the same Poisson schedule as the clusters get, :func:`bench.loadgen.arrival_offsets`) as one
left-padded batch, runs until the longest is done, then takes the next batch. Each request
becomes a :class:`~bench.loadgen.Trace` whose start is the start of its batch (as a cluster's
trace starts when the client sends it, at most ``max_concurrency`` in flight) and whose tokens
arrive at the decoding steps that made them (timed by a logits processor, called once per step),
so :func:`bench.loadgen.report` computes the same figures as for a cluster.

Run ``python -m bench.hf_baseline SPEC.json`` (what ``--compare`` does, in a process of its own
with ``OMP_NUM_THREADS=1``): the spec names the model, the workloads and the schedule; the report
is printed as one JSON line. transformers is imported lazily (the ``test`` and ``bench`` extras).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import loadgen

PAD_ID = 0


def require_transformers() -> Any:
    """The transformers module, or a ``RuntimeError`` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise RuntimeError("the transformers baseline needs transformers: "
                           "pip install 'pdserve[bench]' (or drop it from --compare-targets)"
                           ) from exc
    return transformers


class StepClock:
    """A logits processor that records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def run(model_dir: Path, works: Sequence[loadgen.Workload], *, max_concurrency: int,
        request_rate: float = math.inf, seed: int = 0) -> tuple[list[loadgen.Trace], float]:
    """Serve ``works`` with ``generate`` in static batches; the traces and the wall time."""
    if any(w.token_ids is None or w.images for w in works):
        raise ValueError("the transformers baseline needs token-id prompts without images")
    transformers = require_transformers()
    import torch

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(model_dir).eval()
    generate = _generator(model, torch, transformers)
    generate(works[:1])  # warm-up
    offsets = loadgen.arrival_offsets(len(works), request_rate, seed)
    traces: list[loadgen.Trace] = []
    start = time.perf_counter()
    i = 0
    while i < len(works):
        time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        now = time.perf_counter() - start
        j = i + 1
        while j < len(works) and j - i < max_concurrency and offsets[j] <= now:
            j += 1
        traces.extend(generate(works[i:j]))
        i = j
    return traces, time.perf_counter() - start


def _generator(model: Any, torch: Any, transformers: Any) -> Any:
    def generate(batch: Sequence[loadgen.Workload]) -> list[loadgen.Trace]:
        ids = [list(w.token_ids or []) for w in batch]
        width = max(len(p) for p in ids)
        new = max(w.new_tokens for w in batch)
        input_ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        clock = StepClock()
        begin = time.perf_counter()
        # eos_token_id=None is ``ignore_eos``: EOS may be generated and decoding goes on
        # (min_new_tokens would forbid EOS instead, and greedy paths would part ways)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new,
                                 eos_token_id=None, do_sample=False, pad_token_id=PAD_ID,
                                 logits_processor=transformers.LogitsProcessorList([clock]))
        traces = []
        for row, work in zip(out[:, width:].tolist(), batch, strict=True):
            trace = loadgen.Trace(begin, token_ids=row[:work.new_tokens],
                                  prompt_tokens=len(work.token_ids or []))
            trace.arrivals = [(t, 1) for t in clock.times[:work.new_tokens]]
            traces.append(trace)
        return traces

    return generate


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.hf_baseline SPEC.json``: print the report (and token ids) as JSON.

    SPEC: ``{"model": DIR, "max_concurrency": C, "request_rate": R or null (all at once),
    "seed": S, "slo_ttft_ms": T or null, "slo_tpot_ms": T or null,
    "works": [{"token_ids": [...], "new_tokens": N}, ...]}``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    spec = json.loads(Path(args[0]).read_text())
    works = [loadgen.Workload(w["new_tokens"], token_ids=w["token_ids"]) for w in spec["works"]]
    rate = math.inf if spec.get("request_rate") is None else float(spec["request_rate"])
    traces, wall = run(Path(spec["model"]), works, max_concurrency=spec["max_concurrency"],
                       request_rate=rate, seed=spec.get("seed", 0))
    report = loadgen.report(traces, wall, slo_ttft_ms=spec.get("slo_ttft_ms"),
                            slo_tpot_ms=spec.get("slo_tpot_ms"))
    print(json.dumps({"report": report,
                      "token_ids": [t.token_ids for t in traces]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
