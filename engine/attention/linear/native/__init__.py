"""Native CPU kernels of the linear-attention layers, built from C on first use.

:func:`one_token_kernel` is the fused one-token step of the gated delta rule
(``gdn_one_token.c``): two passes over each state where the torch ops make six over the whole
batch's states, which at batch 32 of Qwen3.5's 16 x 128 x 128 states (32 MB a layer) are bound
by memory. The torch ops stay its twin (``delta_rule._one_token_torch``) and its fallback.

Built with the system's C compiler (``cc``, ``-O3 -march=native -fopenmp``) into
``~/.cache/pdserve/kernels`` (``PDSERVE_KERNEL_CACHE`` overrides), named by a hash of the
source, the flags, the compiler's version and the CPU's model and flags, so a kernel built for
another CPU is never loaded; the build writes a temporary file and renames it, so processes
building at once do not see each other's half-written library. Where there is no compiler, the
build fails or ``PDSERVE_NATIVE_KERNELS=0`` is set, :func:`one_token_kernel` returns None and
:func:`unavailable_reason` says why (logged once); callers then run the torch ops. The library
links libgomp by its soname, so it shares the OpenMP runtime torch has already loaded (one
thread pool per calling thread, as the engine's compute thread expects).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gdn_one_token.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c99"]
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"  # "0": never build or load, run the torch ops
CACHE_ENV = "PDSERVE_KERNEL_CACHE"

OneToken = Callable[..., None]
_lock = threading.Lock()
_loaded: dict[str, OneToken | None] = {}
_reason: dict[str, str] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdserve" / "kernels")


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # every core's lines are the same


def _build(compiler: str) -> Path:
    """The library for this source, flags, compiler and CPU, built if not cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, platform.machine(),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"gdn_one_token-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed: {run.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> OneToken | None:
    if os.environ.get(DISABLE_ENV) == "0":
        _reason["gdn"] = f"{DISABLE_ENV}=0"
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        _reason["gdn"] = "no C compiler (cc) on PATH"
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        _reason["gdn"] = f"the build failed: {exc}"
        return None
    fn = library.gdn_one_token
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4
    return fn


def one_token_kernel() -> OneToken | None:
    """The fused one-token step (built and loaded once per process), or None where it cannot
    be had (:func:`unavailable_reason`)."""
    with _lock:
        if "gdn" not in _loaded:
            _loaded["gdn"] = _load()
            if _loaded["gdn"] is None:
                log.warning("the native gated delta rule step is unavailable (%s): the torch "
                            "ops run instead", _reason["gdn"])
        return _loaded["gdn"]


def unavailable_reason() -> str | None:
    """Why :func:`one_token_kernel` returned None (None when it did not)."""
    one_token_kernel()
    return _reason.get("gdn")


def one_token(kernel: OneToken, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
              slots: torch.Tensor | None) -> torch.Tensor | None:
    """Run ``kernel`` (see ``gdn_one_token.c``) on CPU float32 tensors: ``q`` (None: no
    output), ``k`` ``[N, H, Dk]``, ``v`` ``[N, H, Dv]``, ``g``, ``beta`` ``[N, H]``; the
    states read from ``src`` and written to ``dst`` (``[*, H, Dk, Dv]``, contiguous; the same
    tensor for an update in place) at ``slots`` ``[N]`` int64 (None: rows ``0..N-1``). Returns
    the outputs ``[N, H, Dv]`` (None without ``q``)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("the native delta rule step takes contiguous states")
    if src.dtype != torch.float32 or dst.dtype != torch.float32:
        raise ValueError(f"the native delta rule step takes float32 states, got {src.dtype}")
    # the kernel indexes raw memory: a shape or slot that does not fit is refused here
    # (the torch ops would raise; the kernel would read and write past the tensors)
    rows = min(src.shape[0], dst.shape[0])  # states either tensor holds
    if (src.shape[1:] != (h, dk, dv) or dst.shape[1:] != (h, dk, dv)
            or v.shape != (n, h, dv) or g.shape != (n, h) or beta.shape != (n, h)
            or (q is not None and q.shape != k.shape)
            or (slots is None and rows < n)
            or (slots is not None and (slots.shape != (n,) or (n and not (
                0 <= int(slots.min()) and int(slots.max()) < rows))))):
        raise ValueError(f"the native delta rule step got mismatched shapes or slots: k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, states {tuple(src.shape)} -> "
                         f"{tuple(dst.shape)}")
    ins = [None if t is None else t.float().contiguous() for t in (q, k, v, g, beta)]
    idx = None if slots is None else slots.to(torch.int64).contiguous()
    out = None if q is None else torch.empty(n, h, dv, dtype=torch.float32)

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    kernel(*(ptr(t) for t in ins), src.data_ptr(), dst.data_ptr(), ptr(idx), ptr(out),
           n, h, dk, dv)
    return out
