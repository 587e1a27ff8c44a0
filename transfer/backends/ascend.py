"""KV manager for Ascend NPUs, differing from Mooncake's only where Ascend differs.

- Engine: the Ascend build of the transfer engine (``mooncake-transfer-engine-npu``) with the
  ``ascend`` protocol and an NPU device name; ``torch_npu`` is imported lazily, the device is
  selected and HCCL initialized (when a process group exists) before the engine starts.
- Registration: one ``batch_register_memory`` call per memory location, so one call for a pool
  on the host and two for a pool on an NPU (the host batch, holding the aux buffer, which is
  always host memory, then the NPU batch of KV buffers). The engine takes a batch's location as
  an argument: ``"npu:N"`` registers device memory, the wildcard ``"*"`` makes the engine probe
  the pointer, which host memory is registered with.
  Host ranges: the Ascend engine aligns host registrations to 2 MiB, so they are widened to that
  alignment and overlapping or touching ranges merged first (:func:`merge_aligned_ranges`).
  NPU ranges: registered exactly as given, one per buffer (:func:`exact_ranges`). Device memory
  is registered per allocation: widening could reach device memory the process never allocated
  or that holds another tensor, and merging neighbours could join two allocations into one
  registration. A KV pool on an NPU needs the npu build (``mooncake-transfer-engine-npu``);
  :func:`transfer.backends.memory.check_registrable` refuses it otherwise before any engine call.
- Layout: NPU KV pools use the same ``[num_pages, page_size, kv_heads, head_dim]`` entries, so
  pairing and grouping are inherited unchanged.

Pass ``engine`` to run this manager's logic over any engine object (tests use the TCP engine with
host buffers on machines without NPUs).
"""

from __future__ import annotations

import importlib
from itertools import pairwise
from typing import Any

from transfer.backends.keepalive import TcpKeepalive
from transfer.backends.memory import HOST, WILDCARD_LOCATION, MemoryRange, check_registrable
from transfer.backends.mooncake import P2P_HANDSHAKE, MooncakeKVManager, create_mooncake_engine
from transfer.errors import BackendUnavailableError, EngineCallError, TransferError

ASCEND_ALIGN = 2 << 20  # the Ascend engine registers host memory in 2 MiB granules


def merge_aligned_ranges(
    ranges: list[tuple[int, int]], align: int = ASCEND_ALIGN
) -> list[tuple[int, int]]:
    """``(address, length)`` ranges widened to ``align`` and merged where they overlap or touch.

    The result is sorted, pairwise disjoint and covers every input range.
    """
    spans = sorted(
        (ptr // align * align, -(-(ptr + length) // align) * align) for ptr, length in ranges
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def exact_ranges(ranges: list[MemoryRange]) -> list[MemoryRange]:
    """Device ``ranges`` sorted by address and unchanged; overlapping ones are refused (two KV
    buffers never share bytes)."""
    out = sorted(ranges, key=lambda r: r.ptr)
    for a, b in pairwise(out):
        if b.ptr < a.ptr + a.nbytes:
            raise TransferError(
                f"{a.device} buffers overlap: [{a.ptr:#x}, +{a.nbytes}) and [{b.ptr:#x}, "
                f"+{b.nbytes}); every KV buffer entry must be its own memory"
            )
    return out


def _load_npu_runtime() -> Any:
    """``torch_npu``, or a :class:`BackendUnavailableError` naming what is missing."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise BackendUnavailableError(
            "AscendKVManager needs torch_npu and the Ascend build of the transfer engine "
            "(pip install 'pdserve[ascend]' on a machine with NPUs and CANN); "
            f"missing: {exc.name or 'torch_npu'}"
        ) from exc


def _init_npu(torch_npu: Any, device_id: int) -> None:
    """Select the NPU and, when a process group exists, let HCCL initialize before the engine."""
    import torch

    torch_npu.npu.set_device(device_id)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        probe = torch.zeros(1, device=f"npu:{device_id}")
        torch.distributed.all_reduce(probe)


class AscendKVManager(MooncakeKVManager):
    """Ascend-backed manager: NPU engine, single-batch registration of merged aligned ranges."""

    def __init__(
        self,
        *,
        hostname: str = "127.0.0.1",
        device_id: int = 0,
        protocol: str = "ascend",
        device_name: str | None = None,
        metadata_server: str = P2P_HANDSHAKE,
        engine: Any = None,
        batch_limit: int = 1024,
    ) -> None:
        self.device_id = device_id
        super().__init__(
            hostname=hostname,
            protocol=protocol,
            device_name=device_name if device_name is not None else f"npu:{device_id}",
            metadata_server=metadata_server,
            engine=engine,
            batch_limit=batch_limit,
        )

    def _create_engine(
        self, hostname: str, protocol: str, device_name: str, metadata_server: str,
        keepalive: TcpKeepalive | None,
    ) -> Any:
        """The engine on this NPU; ``keepalive`` is unused (the Ascend transport is not TCP,
        and the base manager passes one only for ``tcp``)."""
        _init_npu(_load_npu_runtime(), self.device_id)
        return create_mooncake_engine(
            hostname, protocol=protocol, device_name=device_name, metadata_server=metadata_server,
            kv_device=f"npu:{self.device_id}",
        )

    def _register_ranges(self, ranges: list[MemoryRange]) -> None:
        check_registrable(ranges)
        host = [(r.ptr, r.nbytes) for r in ranges if r.kind == HOST]
        batches = [(WILDCARD_LOCATION, [MemoryRange(p, n) for p, n in merge_aligned_ranges(host)])]
        for device in sorted({r.device for r in ranges if r.kind != HOST}):
            batches.append((device, exact_ranges([r for r in ranges if r.device == device])))
        for location, batch in batches:
            if not batch:
                continue
            ret = self.engine.batch_register_memory(
                [r.ptr for r in batch], [r.nbytes for r in batch], location=location
            )
            if ret != 0:
                raise EngineCallError(
                    f"batch_register_memory of {len(batch)} ranges at location {location!r} "
                    f"returned {ret}"
                )
            self._ranges.extend(batch)
