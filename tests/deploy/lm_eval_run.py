"""lm-evaluation-harness against a pdserve OpenAI door: two local JSONL tasks (a multiple-choice
log-likelihood task and a generation task; no dataset download), run with ``lm_eval --model
local-completions`` and its remote tokenizer (the door's ``/tokenize``), samples read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LM_EVAL = str(Path(sys.executable).parent / "lm_eval")

MC_TASK = """task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_TASK = """task: pdserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_tokens}
metric_list:
  - metric: exact_match
"""


def write_tasks(root: Path, mc: list[dict[str, Any]], gen: list[dict[str, Any]],
                max_tokens: int) -> Path:
    """The two task YAMLs and their JSONL data in ``root``; returns the include path."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", mc), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "pdserve_mc.yaml").write_text(MC_TASK.format(data=root / "mc.jsonl"))
    (root / "pdserve_gen.yaml").write_text(GEN_TASK.format(data=root / "gen.jsonl",
                                                           max_tokens=max_tokens))
    return root


def run(base_url: str, model: str, tasks: Path, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Run both tasks against ``base_url`` (``http://HOST:PORT/v1``); the logged samples of
    each task by name."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    args = (f"base_url={base_url}/completions,model={model},num_concurrent=1,max_retries=1,"
            "tokenized_requests=True")
    done = subprocess.run([LM_EVAL, "--model", "local-completions", "--model_args", args,
                           "--tasks", "pdserve_mc,pdserve_gen", "--include_path", str(tasks),
                           "--output_path", str(out), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples = {}
    for task in ("pdserve_mc", "pdserve_gen"):
        [path] = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples
