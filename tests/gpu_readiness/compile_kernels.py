"""Compile Triton kernels ahead of time for a GPU target, with no GPU: reads a JSON list of
:class:`~tests.gpu_readiness.kernel_table.Job` dicts on stdin, writes one JSON result per job
to the file named by its argument.

Run as ``python -m tests.gpu_readiness.compile_kernels`` in a process started without
``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``, and a kernel module keeps the
mode it was imported in), so the kernels here are real ``JITFunction`` objects. Registers and
spills come from ptxas' own report (``-v``, which Triton passes; ``dump_ptxas_log`` prints
it): the register count in ``CompiledKernel.n_regs`` is read from the driver, which a CPU
machine lacks. Every job is compiled afresh (``always_compile``) so the report is never missed
on a cache hit.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
import time
from typing import Any


def _kernel(ref: str) -> Any:
    import triton

    module, name = ref.split(":")
    obj = getattr(importlib.import_module(module), name)
    if not isinstance(obj, triton.runtime.JITFunction):
        obj = triton.jit(obj)  # a function the module wraps lazily (fill_triton)
    return obj


def parse_ptxas(log: str) -> dict[str, int]:
    """Registers, spill bytes, stack and static shared memory from ptxas' ``-v`` report
    (summed or maxed over the functions it lists)."""
    def ints(pattern: str) -> list[int]:
        return [int(x) for x in re.findall(pattern, log)]

    regs = ints(r"Used (\d+) registers")
    if not regs:
        raise RuntimeError(f"no register count in the ptxas report:\n{log}")
    return {
        "n_regs": max(regs),
        "spill_stores": sum(ints(r"(\d+) bytes spill stores")),
        "spill_loads": sum(ints(r"(\d+) bytes spill loads")),
        "stack": max(ints(r"(\d+) bytes stack frame") or [0]),
        "static_smem": max(ints(r"(\d+) bytes smem") or [0]),
    }


def compile_job(job: dict[str, Any]) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget

    fn = _kernel(job["kernel"])
    sig = {**job["signature"], **dict.fromkeys(job["constexprs"], "constexpr")}
    missing = set(fn.arg_names) - set(sig)
    if missing or len(sig) != len(fn.arg_names):
        raise ValueError(f"{job['kernel']}: signature does not match the arguments {missing}")
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in job["aligned"]}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=job["constexprs"],
                                    attrs=attrs)
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        compiled = triton.compile(src, target=GPUTarget("cuda", job["arch"], 32),
                                  options={"num_warps": job["num_warps"],
                                           "num_stages": job["num_stages"]})
    return {**parse_ptxas(out.getvalue()), "shared": int(compiled.metadata.shared),
            "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("compile_kernels must run without TRITON_INTERPRET")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, without a warning
    import triton

    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    results = []
    for job in json.load(sys.stdin):
        try:
            results.append(compile_job(job))
        except Exception as exc:  # reported per job: one broken config must not hide the rest
            results.append({"error": f"{type(exc).__name__}: {exc}"[:4000]})
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
