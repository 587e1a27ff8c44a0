"""KV manager for Ascend NPUs, differing from Mooncake's only where Ascend differs.

- Engine: the Ascend build of the transfer engine (``mooncake-transfer-engine-npu``) with the
  ``ascend`` protocol and an NPU device name; ``torch_npu`` is imported lazily, the device is
  selected and HCCL initialized (when a process group exists) before the engine starts.
- Registration: every buffer (KV and aux) in ONE ``batch_register_memory`` call. The Ascend
  engine aligns registrations to 2 MiB, so ranges are widened to that alignment and overlapping
  or touching ranges merged first (:func:`merge_aligned_ranges`).
- Layout: NPU KV pools use the same ``[num_pages, page_size, kv_heads, head_dim]`` entries, so
  pairing and grouping are inherited unchanged.

Pass ``engine`` to run this manager's logic over any engine object (tests use the TCP engine with
host buffers on machines without NPUs).
"""

from __future__ import annotations

import importlib
from typing import Any

from transfer.errors import BackendUnavailableError, EngineCallError
from transfer.mooncake import P2P_HANDSHAKE, MooncakeKVManager, create_mooncake_engine

ASCEND_ALIGN = 2 << 20  # the Ascend engine registers memory in 2 MiB granules


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
        self, hostname: str, protocol: str, device_name: str, metadata_server: str
    ) -> Any:
        _init_npu(_load_npu_runtime(), self.device_id)
        return create_mooncake_engine(
            hostname, protocol=protocol, device_name=device_name, metadata_server=metadata_server
        )

    def _register_ranges(self, ranges: list[tuple[int, int]]) -> None:
        merged = merge_aligned_ranges(ranges)
        ret = self.engine.batch_register_memory([p for p, _ in merged], [n for _, n in merged])
        if ret != 0:
            raise EngineCallError(f"batch_register_memory of {len(merged)} ranges returned {ret}")
        self._ranges.extend(merged)
