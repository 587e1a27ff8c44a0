"""Times vLLM's offline ``LLM.generate`` on token-id prompts; runs inside vLLM's own environment.

    <vllm-venv>/bin/python bench/peers/vllm_generate.py REQUEST.json

``REQUEST.json``: ``{"model": dir, "warmup": [[ids]...], "prompts": [[ids]...], "new": n,
"dtype": "float32", "batch_sizes": [1, 8]}``: per batch size ``b``, a warm-up call over the
first ``b`` of ``warmup``, then the timed call over the first ``b`` of ``prompts`` (other
prompts: its prefill is timed too, not served from the prefix cache). With
``"prefill_prompts"`` (others again), each row also has ``prefill_s``: a call over the first ``b``
of them that makes one token (the prefill and the first sample).
Prints one JSON line: ``{"rows": [{"batch": b, "tok_s": ..., "seconds": ...}], "tokens": [ids]}``
(``tokens``: the greedy output of the first prompt, for the caller to compare with its own).
Imports nothing of pdserve: it runs under another interpreter, with vLLM's torch.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    req = json.loads(open(sys.argv[1]).read())
    prompts = req["prompts"]
    longest = max(len(p) for p in prompts) + req["new"] + 16
    llm = LLM(model=req["model"], dtype=req["dtype"], skip_tokenizer_init=True,
              max_model_len=longest, max_num_seqs=max(req["batch_sizes"]), seed=0)
    params = SamplingParams(max_tokens=req["new"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    rows = []
    tokens: list[int] = []
    for b in req["batch_sizes"]:
        warm = [TokensPrompt(prompt_token_ids=p) for p in req["warmup"][:b]]
        llm.generate(warm, params, use_tqdm=False)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts[:b]]
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == req["new"] for o in outs)
        tokens = list(outs[0].outputs[0].token_ids)
        row = {"batch": b, "tok_s": b * req["new"] / seconds, "seconds": seconds}
        if req.get("prefill_prompts"):
            once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                  detokenize=False)
            batch = [TokensPrompt(prompt_token_ids=p) for p in req["prefill_prompts"][:b]]
            start = time.perf_counter()
            llm.generate(batch, once, use_tqdm=False)
            row["prefill_s"] = time.perf_counter() - start
        rows.append(row)
    print("PEER-RESULT " + json.dumps({"rows": rows, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
