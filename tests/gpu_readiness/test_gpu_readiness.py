"""GPU readiness without a GPU: every Triton kernel of the project, in every configuration its
launcher can pick (:mod:`tests.gpu_readiness.kernel_table`), compiles ahead of time for sm_90
and sm_80 with no register spill and no more shared memory than one block may have there.

Compiling happens in subprocesses started without ``TRITON_INTERPRET`` (``compile_kernels.py``),
so this module works whatever other test modules set in this process, in any order. What this
shows: the kernels compile and fit their registers and shared memory on both architectures; it
does not run them (the interpreter tests check what they compute).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.gpu_readiness.kernel_table import (
    ROOT,
    SHARED_LIMIT,
    Job,
    all_jobs,
    covered,
    missing,
    triton_functions,
)

if sys.platform != "linux":
    pytest.skip("Triton's ptxas ships for Linux only", allow_module_level=True)
if importlib.util.find_spec("triton") is None:  # never import it here: see the docstring
    pytest.skip("triton is not installed", allow_module_level=True)

WORKERS = max(1, min(4, os.cpu_count() or 1))


def compile_jobs(jobs: list[Job]) -> list[dict[str, Any]]:
    """Compile ``jobs`` in up to ``WORKERS`` subprocesses; one result dict per job."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    chunks = [jobs[i::WORKERS] for i in range(WORKERS)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, chunk in enumerate(chunks):
            if not chunk:
                continue
            out = Path(tmp) / f"out{i}.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gpu_readiness.compile_kernels", str(out)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=ROOT, env={**env, "TRITON_CACHE_DIR": str(Path(tmp) / f"cache{i}")},
                text=True)
            procs.append((proc, chunk, out))
            assert proc.stdin is not None
            proc.stdin.write(json.dumps([j.as_json() for j in chunk]))
            proc.stdin.close()
        by_id: dict[str, dict[str, Any]] = {}
        for proc, chunk, out in procs:
            log = proc.stdout.read() if proc.stdout else ""
            assert proc.wait() == 0 and out.exists(), f"compile_kernels failed:\n{log[-4000:]}"
            for job, res in zip(chunk, json.loads(out.read_text()), strict=True):
                by_id[job.id] = res
    return [by_id[j.id] for j in jobs]


def problems(job: Job, res: dict[str, Any]) -> list[str]:
    """Why a compiled kernel is not ready for its target (empty when it is)."""
    if "error" in res:
        return [f"{job.id}: does not compile: {res['error']}"]
    out = []
    if res["spill_stores"] or res["spill_loads"]:
        out.append(f"{job.id}: spills {res['spill_stores']} B stores / {res['spill_loads']} B "
                   f"loads ({res['n_regs']} registers, {res['stack']} B stack)")
    shared = res["shared"] + res["static_smem"]
    if shared > SHARED_LIMIT[job.arch]:
        out.append(f"{job.id}: {shared} B shared memory, over sm_{job.arch}'s "
                   f"{SHARED_LIMIT[job.arch]} B per block")
    return out


def report(jobs: list[Job], results: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{j.id}: {r.get('n_regs')} regs, {r.get('spill_stores')} B spill, "
        f"{r.get('shared')} B smem, {r.get('seconds')} s"
        for j, r in zip(jobs, results, strict=True))


# -- the table against the source tree ------------------------------------------------------------

def test_every_triton_function_is_in_the_table() -> None:
    found = triton_functions()
    assert found, "no Triton function found: the scan is broken"
    assert missing(found) == [], "add these to tests/gpu_readiness/kernel_table.py"
    # and the table names nothing that is gone
    assert set(covered()) <= set(found)


def test_a_new_kernel_missing_from_the_table_is_reported(tmp_path: Path) -> None:
    pkg = tmp_path / "engine" / "attention" / "kernels"
    pkg.mkdir(parents=True)
    (pkg / "new_kernels.py").write_text(
        "import triton\n\n\n@triton.jit\ndef _new_kernel(x):\n    pass\n\n\n"
        "def _plain(y):\n    pass\n\n\nK = triton.jit(_plain, do_not_specialize=['y'])\n")
    found = triton_functions(tmp_path, ("engine",))
    assert missing(found) == ["engine.attention.kernels.new_kernels:_new_kernel",
                              "engine.attention.kernels.new_kernels:_plain"]


def test_every_kernel_has_configurations() -> None:
    jobs = all_jobs()
    kernels = {j.kernel for j in jobs}
    assert len(kernels) == 4 and len({j.id for j in jobs}) == len(jobs)


# -- compiling ----------------------------------------------------------------------------------

_SPILLER = Job("tests.gpu_readiness.spilling_kernel:spilling_kernel", "f32-64x128",
               {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"M": 64, "K": 128}, ("x_ptr", "y_ptr"))


def _smoke_jobs() -> list[Job]:
    """One configuration per kernel on each target: the 16-bit tree extend and the float32
    extend (the two tiles that spilled before the retile), decode, merge and the widest fill."""
    want = {"_extend_kernel[bfloat16-D128-tree-g1-rows64]",
            "_extend_kernel[float32-D128-tree-g1-rows32]", "_decode_kernel[bfloat16-D128-g1-s2]",
            "_merge_kernel[bfloat16-D128-s16]", "_fill_rows[bfloat16-N16-H8192]"}
    jobs = [j for j in all_jobs() if j.id.split("@")[0] in want]
    assert len(jobs) == 2 * len(want), sorted(j.id for j in jobs)
    return jobs


def test_smoke_kernels_compile_without_spills_and_the_check_catches_a_spill() -> None:
    jobs = [*_smoke_jobs(), _SPILLER]
    results = compile_jobs(jobs)
    found = [p for j, r in zip(jobs[:-1], results[:-1], strict=True) for p in problems(j, r)]
    assert found == [], "\n".join(found) + "\n" + report(jobs, results)
    # the spill check is not vacuous: a kernel known to spill fails it
    spilled = problems(_SPILLER, results[-1])
    assert spilled and "spills" in spilled[0], report(jobs[-1:], results[-1:])


def test_shared_memory_check_catches_an_oversized_kernel() -> None:
    job = _smoke_jobs()[0]
    res = {"n_regs": 100, "spill_stores": 0, "spill_loads": 0, "stack": 0, "static_smem": 0,
           "shared": SHARED_LIMIT[job.arch] + 1}
    assert problems(job, res) and "shared memory" in problems(job, res)[0]


@pytest.mark.slow
def test_every_configuration_compiles_without_spills_for_sm90_and_sm80() -> None:
    jobs = all_jobs()
    results = compile_jobs(jobs)
    found = [p for j, r in zip(jobs, results, strict=True) for p in problems(j, r)]
    assert found == [], "\n".join(found)
