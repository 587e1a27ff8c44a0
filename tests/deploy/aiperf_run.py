"""AIPerf (``aiperf profile``, NVIDIA's load generator) against a pdserve OpenAI door, run as a
user runs it: synthetic prompts made with the model's tokenizer, streamed chat completions at a
fixed concurrency, and its exports read back (``profile_export_aiperf.json``, the summary, and
``profile_export.jsonl``, one record per request).

AIPerf lives in a venv of its own, ``.venv/aiperf`` (``scripts/test.sh`` installs it there): it pins
``huggingface-hub<2``, which the test extra's ``transformers`` cannot share."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AIPERF = ROOT / ".venv" / "aiperf" / "bin" / "aiperf"
# AIPerf 0.13 in offline mode looks every tokenizer up in the hub's cache, a local directory
# included (and fails); without it a local directory loads as it is, with no network access
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True)
class Profile:
    summary: dict[str, Any]  # metric name -> {"unit", "avg", "p50", ..., "count"}, and run info
    records: list[dict[str, Any]]  # per request: {"metadata", "metrics", "error"}


def profile(base_url: str, model: str, tokenizer: Path, out: Path, *, requests: int,
            concurrency: int, input_tokens: int, output_tokens: int) -> Profile:
    """``aiperf profile`` of ``requests`` streamed chat completions of ``model`` at ``base_url``
    (the door's address without ``/v1``), ``concurrency`` at a time, each a prompt of
    ``input_tokens`` tokens asking for exactly ``output_tokens`` (``ignore_eos``; token counts
    are the door's ``usage``); artifacts in ``out``."""
    cmd = [str(AIPERF), "profile", "--model", model, "--url", base_url,
           "--tokenizer", str(tokenizer), "--endpoint-type", "chat", "--streaming",
           "--use-server-token-count", "--extra-inputs", "ignore_eos:true",
           "--request-count", str(requests), "--concurrency", str(concurrency),
           "--isl", str(input_tokens), "--osl", str(output_tokens), "--random-seed", "0",
           "--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    out.mkdir(parents=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    return Profile(summary, [json.loads(line) for line in lines])
