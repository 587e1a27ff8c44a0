"""The compute device and dtype of an engine: what ``--device`` and ``--dtype`` name.

``--device`` is ``auto``, ``cpu``, ``cuda`` or ``npu`` (``cuda:N`` / ``npu:N`` for one device).
``auto`` takes CUDA when this torch sees a GPU, else an Ascend NPU when ``torch_npu`` imports
and sees one, else the CPU. ``--dtype`` is ``auto`` (bfloat16 on an accelerator, float32 on the
CPU) or one of :data:`DTYPES`.

A device this machine cannot run is a :class:`~engine.errors.DeviceError` with one line naming
what to install or check. ``torch_npu`` (Ascend's accelerator runtime, not networking) is
imported here and nowhere else in the engine, and only when an NPU is asked for or ``auto``
looks for one; importing it is what teaches torch the ``npu`` device type.

On the CPU the host allocator is the device's: :func:`keep_freed_memory` sets it up for an
engine's large temporaries.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
from types import ModuleType

import torch

from engine.errors import DeviceError

DEVICES = ("auto", "cpu", "cuda", "npu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
CUDA_TORCH_HINT = "pip install torch --index-url https://download.pytorch.org/whl/cu128"
NPU_HINT = ("install torch_npu (Ascend's PyTorch adapter) built for this torch, with the CANN "
            "toolkit (pip install torch-npu, or pdserve's 'ascend' extra: pip install '.[ascend]')")


def parse_device_name(name: str) -> tuple[str, int | None]:
    """``(kind, index)`` of a ``--device`` value, without looking at the machine
    (``"cuda:1"`` -> ``("cuda", 1)``); raises :class:`DeviceError` for anything else."""
    kind, sep, index = str(name).strip().partition(":")
    if kind not in DEVICES or (sep and (kind in ("auto", "cpu") or not index.isdigit())):
        raise DeviceError(f"--device {name!r} is not a device: choose one of "
                          f"{', '.join(DEVICES)} (or cuda:N / npu:N for one device)")
    return kind, int(index) if sep else None


def resolve_device(name: str) -> torch.device:
    """The device ``name`` stands for on this machine, with its index (``cuda`` -> ``cuda:0``);
    raises :class:`DeviceError` when it cannot run here."""
    kind, chosen = parse_device_name(name)
    if kind == "auto":
        if torch.cuda.is_available():
            return _cuda(None)
        npu = _torch_npu()
        if not isinstance(npu, str) and torch.npu.is_available():  # type: ignore[attr-defined]
            return _npu(None)
        return torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    return _cuda(chosen) if kind == "cuda" else _npu(chosen)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype ``name`` stands for on ``device``: ``auto`` is bfloat16 on CUDA and NPU,
    float32 on the CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise DeviceError(f"--dtype {name!r} is not a dtype: choose one of "
                          f"{', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The :data:`DTYPES` name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise DeviceError(f"unsupported dtype {dtype}: pdserve runs {', '.join(DTYPES)}")


def _cuda(index: int | None) -> torch.device:
    where = "cuda" if index is None else f"cuda:{index}"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise DeviceError(f"--device {where}: this torch ({torch.__version__}) has no CUDA; "
                          f"install a CUDA build of torch ({CUDA_TORCH_HINT})")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {where}: no CUDA device visible (torch "
                          f"{torch.__version__}, CUDA {torch.version.cuda}); check the driver "
                          "(nvidia-smi) and CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise DeviceError(f"--device {where}: only {count} CUDA device(s) visible")
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def _npu(index: int | None) -> torch.device:
    where = "npu" if index is None else f"npu:{index}"
    npu = _torch_npu()
    if isinstance(npu, str):
        raise DeviceError(f"--device {where}: torch_npu does not import ({npu}); {NPU_HINT}")
    runtime = torch.npu  # type: ignore[attr-defined]  # set by torch_npu
    if not runtime.is_available():
        raise DeviceError(f"--device {where}: no NPU visible (torch_npu "
                          f"{getattr(npu, '__version__', '?')}); check the driver "
                          "(npu-smi info) and ASCEND_RT_VISIBLE_DEVICES")
    count = int(runtime.device_count())
    if index is not None and index >= count:
        raise DeviceError(f"--device {where}: only {count} NPU(s) visible")
    return torch.device("npu", int(runtime.current_device()) if index is None else index)


def _torch_npu() -> ModuleType | str:
    """The ``torch_npu`` module, or why it does not import (one line)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises more than ImportError
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# The host allocator set up for a CPU engine's large temporaries. A forward over thousands of
# tokens makes and frees tensors of tens of megabytes every layer (the float32 copy a bfloat16
# RMSNorm normalises, the q/k/v product, the logits of a batch). By default glibc serves blocks
# that large from fresh mmap pages, or returns freed memory at the top of its heap to the
# system, so the next layer's tensor of the same size faults its pages in again: on this
# project's CPU a bfloat16 RMSNorm over 4,096 rows took 7-11 ms that way and 2 ms with the
# memory kept (docs/performance.md)
M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks up to this size come from the heap (glibc's dynamic maximum)
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this much
_applied: list[bool] = []  # the outcome, once per process


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (a CPU engine calls it), so
    blocks of up to 32 MB come from the heap and freed ones stay there for the next forward;
    whether they are in effect (not with another C library). The memory a process holds then
    stays at its peak instead of shrinking between forwards, which a serving process reaches
    again at its next large prefill anyway."""
    if not _applied:
        _applied.append(_set_thresholds())
    return _applied[0]


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
