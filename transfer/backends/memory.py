"""Where registered memory lives, and which transfer engine build can register it.

Every range a manager registers is a :class:`MemoryRange`: address, length and the device that
holds the bytes (``"cpu"``, ``"cuda:N"``, ``"npu:N"``, as torch names it). Host memory works
with every build of the Mooncake transfer engine. Device memory needs the build made for that
device, and :func:`check_registrable` refuses anything else before the engine is called:

- ``mooncake-transfer-engine-non-cuda`` (extra ``mooncake``): host memory only;
- ``mooncake-transfer-engine`` (extra ``cuda``): host and CUDA GPU memory;
- ``mooncake-transfer-engine-npu`` (extra ``ascend``): host and Ascend NPU memory.

The builds all install the same ``mooncake`` package, so :func:`installed_mooncake_builds`
asks the package metadata which distribution is installed; with several installed their files
overwrite each other and the build that answers is unknown, so device memory is refused then.

Mixed placement: both sides must speak the same protocol (``tcp``, ``rdma`` or ``ascend``), but
each side needs the build for its own memory only. The engine moves bytes between any two
registered memories and, over TCP, stages GPU memory through host buffers on the side that owns
it, so a prefill on a GPU (cuda build) can push into a decode on the CPU (either build) and the
reverse; neither side tells the other where its memory lives, so the bootstrap messages carry no
device. RDMA into GPU memory also needs GPUDirect RDMA on that machine.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.errors import TransferError

HOST = "cpu"
WILDCARD_LOCATION = "*"  # the engine works out the location itself (host memory: its NUMA node)

# distribution name -> build name
MOONCAKE_DISTRIBUTIONS = {
    "mooncake-transfer-engine-non-cuda": "non-cuda",
    "mooncake-transfer-engine": "cuda",
    "mooncake-transfer-engine-npu": "npu",
}
_BUILD_FOR_DEVICE = {"cuda": "cuda", "npu": "npu"}  # device kind -> the build that registers it
_EXTRA_OF_BUILD = {"cuda": "cuda", "npu": "ascend"}
_DISTRIBUTION_OF_BUILD = {build: dist for dist, build in MOONCAKE_DISTRIBUTIONS.items()}


@dataclass(frozen=True)
class MemoryRange:
    """``nbytes`` bytes at ``ptr`` on ``device`` ("cpu", "cuda:N" or "npu:N")."""

    ptr: int
    nbytes: int
    device: str = HOST

    def __post_init__(self) -> None:
        device_kind(self.device)  # refuse a device no engine can register, before any call

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"cuda"`` or ``"npu"``."""
        return device_kind(self.device)

    @property
    def location(self) -> str:
        """The engine's location argument: the device for accelerator memory; for host memory
        the wildcard, so that the engine finds the NUMA node itself."""
        return WILDCARD_LOCATION if self.kind == HOST else self.device


def device_kind(device: str) -> str:
    """``"cpu"``, ``"cuda"`` or ``"npu"`` for a torch device name; anything else is refused."""
    kind, sep, index = device.partition(":")
    if kind in (HOST, *_BUILD_FOR_DEVICE) and (not sep or index.isdigit()):
        return kind
    raise TransferError(
        f"cannot register KV memory on device {device!r}: the transfer engines take host "
        "memory ('cpu'), CUDA GPU memory ('cuda:N') and Ascend NPU memory ('npu:N')"
    )


def installed_mooncake_builds() -> frozenset[str]:
    """The Mooncake transfer engine builds installed (``"non-cuda"``, ``"cuda"``, ``"npu"``)."""
    found = set()
    for dist, build in MOONCAKE_DISTRIBUTIONS.items():
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.add(build)
    return frozenset(found)


def check_registrable(ranges: Sequence[MemoryRange]) -> None:
    """Raise :class:`TransferError` unless the installed engine build can register every range.

    Host ranges pass with any build and need no look-up; a device range needs exactly the
    build for its device. Runs before any engine call, so a refusal registers nothing.
    """
    devices = sorted({r.device for r in ranges if r.kind != HOST})
    if not devices:
        return
    builds = installed_mooncake_builds()
    for device in devices:
        need = _BUILD_FOR_DEVICE[device_kind(device)]
        if builds == {need}:
            continue
        dist, extra = _DISTRIBUTION_OF_BUILD[need], _EXTRA_OF_BUILD[need]
        installed = ", ".join(sorted(_DISTRIBUTION_OF_BUILD[b] for b in builds)) or "none"
        if need in builds:
            raise TransferError(
                f"KV buffers on {device} need the {need} build of the Mooncake transfer engine "
                f"alone, but several builds are installed ({installed}) and their files "
                f"overwrite each other: uninstall all of them, then pip install 'pdserve[{extra}]'"
            )
        raise TransferError(
            f"KV buffers on {device} need the {need} build of the Mooncake transfer engine "
            f"({dist}), which registers {device.partition(':')[0]} memory; installed: "
            f"{installed}. Install it with pip install 'pdserve[{extra}]' (in place of the "
            "other builds), or keep the KV cache on the host (--device cpu)"
        )
