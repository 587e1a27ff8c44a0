"""The one prepared accelerator check: pdserve's correctness and speed on a GPU, in one JSON report.

    PYTHONPATH=. python3 scripts/device_check.py [--device cuda] [--out DIR] [--quick]
        [--budget-s 450]

(``scripts/device_check.sh`` runs it with a hard time limit.) Sections, correctness first:

* ``0_kernels``: the Triton paged attention equals the torch backend on the device (prefill,
  mixed, decode, verify; float32 and bfloat16; Qwen2-VL-2B's head shapes);
* ``a_fp32_vs_transformers``: ``pdserve generate --device D --dtype float32`` equals
  transformers' ``generate`` on a tiny transformers-written checkpoint, text and image prompts;
* ``b_bf16_vs_transformers``: bf16 greedy tokens equal transformers bf16 on the first 16 tokens of
  at least half the prompts (the share is reported);
* ``c_graphs_on_off``: graphs on and off give the same tokens;
* ``d_eagle_vs_plain``: EAGLE equals plain decoding (and its acceptance length);
* ``f_hybrid``: the hybrid (Qwen3.5) and Qwen3-VL paths, in parts: the linear-attention kernels
  the device gets (flash-linear-attention, causal-conv1d) equal the torch reference (outputs and
  pool states; skipped where the device gets the reference itself), ``LLMEngine`` float32 equals
  transformers on tiny Qwen3.5 and Qwen3-VL checkpoints (text and image prompts), and Qwen3.5's
  MTP drafting equals plain decoding (drafted and accepted counts); runs before ``e_speed``;
* ``g_warm_up``: after a worker's start-up warm-up (and graph capture), serving prompts of many
  lengths and decode batches of every size compiles no Triton kernel (graphs on and off);
* ``e_speed``: output tok/s of our engine vs transformers on a Qwen2-VL-2B-shaped bf16 checkpoint
  at batch 1, 32, 128 and the batch-1 decode step vs the memory-bandwidth bound.

Report (``DIR/device_check.json``, rewritten after every section and every speed run, so a
timeout still leaves a partial report): a header (device, versions, budget) and per section
``{"ok": bool, "summary": str, "elapsed_s": float, ..., "error": str}``. A section that raises
records its error and the next one runs; one that no longer fits the budget is recorded as
``"error": "skipped: budget"``; SIGTERM (the wrapper's hard limit) ends the run after recording
itself as the running section's error. ``DIR/device_check_summary.txt`` holds one line per
section.
``--quick`` shrinks every section (small random speed model, batch 1 and 4, prompt 32, 8 new
tokens) so that a CPU dry run finishes in under a minute. Exit status: 0 when every section is
ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from device_check_context import Context
from device_check_correctness import check_bf16, check_eagle, check_fp32, check_graphs
from device_check_hybrid import check_hybrid
from device_check_kernels import check_kernels
from device_check_speed import check_speed
from device_check_warmup import check_warm_up

Section = Callable[[Context, dict[str, Any]], None]
# (report key, body, seconds it needs at least: full run, --quick), in running order
SECTIONS: tuple[tuple[str, Section, float, float], ...] = (
    ("0_kernels", check_kernels, 20.0, 1.0),
    ("a_fp32_vs_transformers", check_fp32, 60.0, 5.0),
    ("b_bf16_vs_transformers", check_bf16, 20.0, 3.0),
    ("c_graphs_on_off", check_graphs, 30.0, 3.0),
    ("d_eagle_vs_plain", check_eagle, 30.0, 3.0),
    ("f_hybrid", check_hybrid, 45.0, 4.0),
    ("g_warm_up", check_warm_up, 30.0, 1.0),
    ("e_speed", check_speed, 90.0, 5.0),
)
REPORT_FILE = "device_check.json"
SUMMARY_FILE = "device_check_summary.txt"


class Stopped(BaseException):
    """SIGTERM arrived (the wrapper's hard time limit): the section in progress records it."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by signal {signum} (the hard time limit?)")


class Report:
    """The JSON report, written whole (through a temporary file) on every :meth:`save`."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.path = out / REPORT_FILE
        self.data: dict[str, Any] = {**header, "sections": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def header(args: argparse.Namespace) -> dict[str, Any]:
    """Where and with what the check ran."""
    info: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": args.device, "quick": args.quick, "budget_s": args.budget_s,
        "cuda": torch.version.cuda, "sections_asked": args.sections,
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "triton": _version("triton"),
        "fla_core": _version("fla-core"), "causal_conv1d": _version("causal-conv1d"),
        "notes": ["float32 runs disable TF32 (torch flags here, NVIDIA_TF32_OVERRIDE=0 for the "
                  "pdserve generate subprocess)"],
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["driver"] = _driver()
    return info


def _driver() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _version(package: str) -> str | None:
    """An installed package's version (without importing it), None if absent."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_section(ctx: Context, report: Report, key: str, body: Section, need_s: float) -> None:
    """Run one section into ``report``; its exceptions become its ``error``."""
    res: dict[str, Any] = {"ok": False}
    report.data["sections"][key] = res
    if ctx.remaining() < need_s:
        res.update(skipped=True, error="skipped: budget",
                   summary=f"skipped: budget ({ctx.remaining():.0f}s left, needs {need_s:.0f}s)")
        report.save()
        return
    print(f"[device_check] {key} ...", flush=True)
    start = time.monotonic()
    try:
        body(ctx, res)
    except BaseException as exc:  # one failing section must leave the others' results
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        res["traceback"] = traceback.format_exc()[-3000:]
        res.setdefault("summary", f"error: {res['error'][:200]}")
        if not isinstance(exc, Exception):  # Stopped, KeyboardInterrupt: end the run
            raise
    finally:
        res["elapsed_s"] = round(time.monotonic() - start, 1)
        ctx.free()
        report.save()
    print(f"[device_check] {key}: {'OK' if res['ok'] else 'FAIL'} {res.get('summary', '')} "
          f"({res['elapsed_s']}s)", flush=True)


def summary_lines(report: Report) -> list[str]:
    return [f"{'OK  ' if r['ok'] else 'FAIL'} {key}: {r.get('summary', '')} "
            f"[{r.get('elapsed_s', 0)}s]" for key, r in report.data["sections"].items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="torch device to check (default cuda)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "device_check_out"),
                   help="report folder (default $OUT, else ./device_check_out)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU dry run)")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds for the whole check; later sections are skipped past it")
    p.add_argument("--sections", default=None, metavar="KEY,KEY",
                   help="run only these sections (comma-separated keys, in running order; "
                        "default: all), e.g. to rerun the failed ones in a short lease")
    args = p.parse_args(argv)
    keys = [key for key, *_ in SECTIONS]
    chosen = keys if args.sections is None else [k for k in args.sections.split(",") if k]
    unknown = sorted(set(chosen) - set(keys))
    if unknown or not chosen:
        p.error(f"--sections: unknown {', '.join(unknown) or 'none given'}; the sections are "
                f"{', '.join(keys)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    start = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 oracles compute in float32
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, header(args))
    report.save()
    signal.signal(signal.SIGTERM, _stop)
    try:
        with tempfile.TemporaryDirectory(prefix="device_check_") as work:
            ctx = Context(args.device, args.quick, Path(work), start + args.budget_s,
                          report.save)
            for key, body, need_full, need_quick in SECTIONS:
                if key in chosen:
                    run_section(ctx, report, key, body, need_quick if args.quick else need_full)
    except Stopped as exc:
        report.data["stopped"] = str(exc)
        for key in chosen:
            report.data["sections"].setdefault(
                key, {"ok": False, "error": "not run: stopped", "summary": "not run: stopped"})
    report.data["elapsed_s"] = round(time.monotonic() - start, 1)
    lines = summary_lines(report)
    report.data["summary"] = lines
    report.save()
    (args.out / SUMMARY_FILE).write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if all(r["ok"] for r in report.data["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
