"""KV buffers that live on a device: where each range is registered, and which build may do it.

Nothing here touches a GPU or an NPU: a buffer "on cuda:0" or "on npu:0" is a BufferInfo naming
that device over the address of a real host buffer, and the engine build is chosen by replacing
``installed_mooncake_builds``. The engines are the real non-CUDA engine (wrapped to record its
calls) or recording fakes of the CUDA and Ascend engines' registration calls.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.kv.pool import BufferInfo, KVPool
from transfer.aux import AuxBuffer
from transfer.backends import memory
from transfer.backends.ascend import ASCEND_ALIGN, AscendKVManager, merge_aligned_ranges
from transfer.backends.memory import MemoryRange, check_registrable, installed_mooncake_builds
from transfer.backends.mooncake import MooncakeKVManager, create_mooncake_engine
from transfer.errors import TransferError

GEOMETRY = (16, 4, 2, 8)  # pages, page size, kv heads, head dim


def _pool() -> KVPool:
    return KVPool(*GEOMETRY, layer_ids=[0, 1])


def _on(infos: list[BufferInfo], device: str) -> list[BufferInfo]:
    """The same host buffers, described as living on ``device``."""
    return [dataclasses.replace(b, device=device) for b in infos]


def _builds(monkeypatch: pytest.MonkeyPatch, *builds: str) -> None:
    monkeypatch.setattr(memory, "installed_mooncake_builds", lambda: frozenset(builds))


class _Spy:
    """Forwards every call to ``engine`` and records the method names."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.engine, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


class _FakeEngine:
    """Records the registration calls of a Mooncake engine (single and batch) with locations."""

    def __init__(self) -> None:
        self.single: list[tuple[int, int, str]] = []
        self.batches: list[tuple[list[int], list[int], str]] = []

    def register_memory(self, ptr: int, nbytes: int, location: str) -> int:
        self.single.append((ptr, nbytes, location))
        return 0

    def batch_register_memory(self, ptrs: list[int], lens: list[int], location: str) -> int:
        self.batches.append((ptrs, lens, location))
        return 0

    def get_rpc_port(self) -> int:
        return 1


def test_buffer_info_device_comes_from_the_tensor() -> None:
    pool = _pool()
    infos = pool.buffer_infos()
    assert [b.device for b in infos] == [str(t.device) for t in pool.entries()]
    assert {b.device for b in infos} == {"cpu"} and str(pool.device) == "cpu"
    assert BufferInfo(1, 2, 1, 0).device == "cpu"  # older constructors keep working
    meta = KVPool(*GEOMETRY, layer_ids=[0], device="meta")  # filled from the tensor, not fixed
    assert [b.device for b in meta.buffer_infos()] == ["meta", "meta"]


def test_installed_builds_follow_the_package_metadata() -> None:
    expected = set()
    for dist, build in memory.MOONCAKE_DISTRIBUTIONS.items():
        try:
            importlib.metadata.distribution(dist)
            expected.add(build)
        except importlib.metadata.PackageNotFoundError:
            pass
    assert installed_mooncake_builds() == expected


def test_non_cuda_build_refuses_gpu_buffers_before_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("mooncake.engine")
    _builds(monkeypatch, "non-cuda")
    spy = _Spy(create_mooncake_engine("127.0.0.1"))
    mgr = MooncakeKVManager(engine=spy)
    pool = _pool()
    with pytest.raises(TransferError, match=r"cuda:0.*mooncake-transfer-engine\b.*pdserve\[cuda\]"):
        mgr.register(_on(pool.buffer_infos(), "cuda:0"), AuxBuffer(2, 8))
    assert spy.calls == [] and mgr.kv_ptrs == [] and mgr.kv_devices == []
    # nothing was recorded, so the same manager still registers the host pool
    mgr.register(pool.buffer_infos(), AuxBuffer(2, 8))
    assert spy.calls == ["register_memory"] * (len(pool.entries()) + 1)
    assert mgr.kv_devices == ["cpu"] * len(pool.entries())
    mgr.close()


def test_cuda_build_registers_gpu_memory_at_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _builds(monkeypatch, "cuda")
    engine = _FakeEngine()
    mgr = MooncakeKVManager(engine=engine)
    infos = _on(_pool().buffer_infos(), "cuda:0")
    aux = AuxBuffer(2, 8)
    mgr.register(infos, aux)
    expected = [(b.ptr, b.nbytes, "cuda:0") for b in infos] + [(aux.ptr, aux.nbytes, "*")]
    assert engine.single == expected
    assert mgr.kv_devices == ["cuda:0"] * len(infos)


@pytest.mark.parametrize(
    ("builds", "device", "message"),
    [
        (("non-cuda",), "cuda:1", r"installed: mooncake-transfer-engine-non-cuda.*pdserve\[cuda\]"),
        ((), "cuda:0", r"installed: none.*pdserve\[cuda\]"),
        (("cuda", "non-cuda"), "cuda:0", r"several builds.*pdserve\[cuda\]"),
        (("cuda",), "npu:0", r"mooncake-transfer-engine-npu.*pdserve\[ascend\]"),
        (("npu",), "cuda:0", r"pdserve\[cuda\]"),
    ],
)
def test_the_gate(
    monkeypatch: pytest.MonkeyPatch, builds: tuple[str, ...], device: str, message: str
) -> None:
    _builds(monkeypatch, *builds)
    ranges = [MemoryRange(4096, 64), MemoryRange(8192, 64, device)]
    with pytest.raises(TransferError, match=message):
        check_registrable(ranges)
    _builds(monkeypatch, {"cuda": "cuda", "npu": "npu"}[device.partition(":")[0]])
    check_registrable(ranges)


def test_host_memory_needs_no_build_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> frozenset[str]:
        raise AssertionError("looked up the engine build for host memory")

    monkeypatch.setattr(memory, "installed_mooncake_builds", fail)
    check_registrable([MemoryRange(b.ptr, b.nbytes, b.device) for b in _pool().buffer_infos()])


@pytest.mark.parametrize("device", ["meta", "mps", "cuda:x", "npu:", ""])
def test_unknown_devices_are_refused_before_the_engine(device: str) -> None:
    engine = _FakeEngine()
    mgr = MooncakeKVManager(engine=engine)
    with pytest.raises(TransferError, match="cannot register KV memory on device"):
        mgr.register(_on(_pool().buffer_infos(), device))
    assert engine.single == []


def test_ascend_registers_npu_buffers_at_their_location(monkeypatch: pytest.MonkeyPatch) -> None:
    _builds(monkeypatch, "npu")
    engine = _FakeEngine()
    mgr = AscendKVManager(engine=engine, protocol="tcp")
    infos = _on(_pool().buffer_infos(), "npu:0")
    aux = AuxBuffer(2, 8)
    mgr.register(infos, aux)
    host, npu = engine.batches
    # host: the aux buffer, widened to 2 MiB granules; NPU: every KV buffer exactly, by address
    [(start, length)] = merge_aligned_ranges([(aux.ptr, aux.nbytes)])
    assert host == ([start], [length], "*") and start % ASCEND_ALIGN == 0
    exact = sorted((b.ptr, b.nbytes) for b in infos)
    assert npu == ([p for p, _ in exact], [n for _, n in exact], "npu:0")
    assert mgr.kv_devices == ["npu:0"] * len(infos)


def test_ascend_refuses_npu_buffers_without_the_npu_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _builds(monkeypatch, "non-cuda")
    engine = _FakeEngine()
    mgr = AscendKVManager(engine=engine, protocol="tcp")
    with pytest.raises(TransferError, match=r"npu:0.*pdserve\[ascend\]"):
        mgr.register(_on(_pool().buffer_infos(), "npu:0"), AuxBuffer(2, 8))
    assert engine.batches == []


def test_ascend_refuses_overlapping_npu_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    _builds(monkeypatch, "npu")
    engine = _FakeEngine()
    buf = torch.zeros(1024, dtype=torch.uint8)
    infos = [BufferInfo(buf.data_ptr(), 512, 64, 0, "npu:0"),
             BufferInfo(buf.data_ptr() + 256, 512, 64, 1, "npu:0")]
    with pytest.raises(TransferError, match="npu:0 buffers overlap"):
        AscendKVManager(engine=engine, protocol="tcp").register(infos)
    assert engine.batches == []
