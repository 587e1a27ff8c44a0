"""The prepared GPU check (``scripts/device_check.sh``) dry-runs on the CPU: every section runs at
tiny sizes and leaves a valid JSON report; our engine equals transformers (float32) and EAGLE
equals plain decoding here already, so sections (a) and (d) must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("0_kernels", "a_fp32_vs_transformers", "b_bf16_vs_transformers", "c_graphs_on_off",
            "d_eagle_vs_plain", "f_hybrid", "g_warm_up", "e_speed")


def run_check(out: Path, *args: str, script: str = "device_check.py",
              ) -> subprocess.CompletedProcess[str]:
    """The check on the CPU at tiny sizes, through the Python script or the shell wrapper."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(out)}
    cmd = (["bash", str(ROOT / "scripts" / script)] if script.endswith(".sh")
           else [sys.executable, str(ROOT / "scripts" / script)])
    return subprocess.run([*cmd, "--device", "cpu", "--quick", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def report(out: Path) -> dict[str, Any]:
    data = json.loads((out / "device_check.json").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("device_check")
    proc = run_check(out, "--out", str(out))
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.returncode


@pytest.mark.slow
def test_quick_run_reports_every_section(quick_run: tuple[Path, int]) -> None:
    out, rc = quick_run
    data = report(out)
    assert data["device"] == "cpu" and data["quick"] is True
    assert tuple(data["sections"]) == SECTIONS
    for key, res in data["sections"].items():
        assert isinstance(res["ok"], bool), key
        assert res.get("error") != "skipped: budget", key
        assert isinstance(res["elapsed_s"], float)
    assert rc == (0 if all(r["ok"] for r in data["sections"].values()) else 1)
    lines = (out / "device_check_summary.txt").read_text().splitlines()
    assert [line.split()[1].rstrip(":") for line in lines] == list(SECTIONS)


@pytest.mark.slow
def test_engine_equals_transformers_and_eagle_equals_plain_on_cpu(
        quick_run: tuple[Path, int]) -> None:
    sections = report(quick_run[0])["sections"]
    fp32, eagle = sections["a_fp32_vs_transformers"], sections["d_eagle_vs_plain"]
    assert fp32["ok"], fp32
    assert {p["name"] for p in fp32["prompts"]} >= {"text_23", "image_first"}
    for p in fp32["prompts"]:
        assert p["equal"] and p["ours"] == p["ref"] and len(p["ours"]) > 0
    assert eagle["ok"], eagle
    assert 1.0 <= eagle["acceptance_length"] <= eagle["k"] + 1
    for run in eagle["runs"].values():
        assert run["rounds"] > 0
        assert all(p["equal"] and len(p["ours"]) > 0 for p in run["prompts"])


@pytest.mark.slow
def test_hybrid_section_on_cpu(quick_run: tuple[Path, int]) -> None:
    """Off CUDA the linear-attention kernels are the torch reference (a skip, which is ok);
    Qwen3.5 and Qwen3-VL equal transformers, and MTP drafting equals plain decoding with drafts
    both accepted and rejected."""
    hybrid = report(quick_run[0])["sections"]["f_hybrid"]
    assert hybrid["ok"], hybrid
    kernels = hybrid["kernels"]
    assert kernels["ok"] and kernels["skipped"] == "torch reference on cpu"
    assert kernels["conv_from"] == kernels["delta_rule_from"] == "torch"
    archs = hybrid["vs_transformers"]["archs"]
    assert set(archs) == {"qwen3_5", "qwen3_vl"} and archs["qwen3_5"]["hybrid"]
    for arch in archs.values():
        assert {p["name"] for p in arch["prompts"]} >= {"text_23", "image"}
        assert all(p["equal"] and len(p["ours"]) > 0 for p in arch["prompts"])
    for run in hybrid["mtp"]["runs"].values():
        assert run["ok"] and 0 < run["accepted"] < run["drafted"]
        assert all(p["equal"] for p in run["prompts"])


@pytest.mark.slow
def test_speed_section_measures_both_sides(quick_run: tuple[Path, int]) -> None:
    speed = report(quick_run[0])["sections"]["e_speed"]
    for side in ("ours", "transformers"):
        for batch in speed["plan"]["batches"]:
            run = speed[side][str(batch)]
            assert run["output_tokens"] == batch * speed["plan"]["new_tokens"], (side, batch)
    assert speed["bound_ms"] > 0 and speed["b1_decode_step_ms"] > 0


def test_shell_wrapper_skips_sections_past_the_budget(tmp_path: Path) -> None:
    proc = run_check(tmp_path, "--budget-s", "0", script="device_check.sh")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"report {tmp_path}/device_check.json" in proc.stdout
    sections = report(tmp_path)["sections"]
    assert tuple(sections) == SECTIONS
    assert all(r["error"] == "skipped: budget" and not r["ok"] for r in sections.values())
    assert (tmp_path / "device_check.log").is_file()


def test_sections_runs_only_the_ones_asked_for(tmp_path: Path) -> None:
    """``--sections`` reruns part of the check (a short lease after a failure): only those run,
    in running order; an unknown key is a usage error naming the sections."""
    proc = run_check(tmp_path, "--out", str(tmp_path), "--sections", "e_speed,0_kernels")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = report(tmp_path)
    assert tuple(data["sections"]) == ("0_kernels", "e_speed")
    assert data["sections_asked"] == "e_speed,0_kernels"
    bad = run_check(tmp_path, "--sections", "0_kernels,nope")
    assert bad.returncode == 2
    assert f"--sections: unknown nope; the sections are {', '.join(SECTIONS)}" in bad.stderr
