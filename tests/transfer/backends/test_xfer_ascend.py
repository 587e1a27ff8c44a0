"""AscendKVManager's own logic, run over the TCP engine with host buffers (no NPU here)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from engine.kv.pool import KVPool
from tests.transfer.xfer_peer import Node, Peer, Spec
from transfer.aux import AuxBuffer
from transfer.backends.ascend import ASCEND_ALIGN, AscendKVManager, merge_aligned_ranges
from transfer.errors import BackendUnavailableError, LayerPairingError

MiB = 1 << 20


def test_merge_aligned_ranges() -> None:
    a = 10 * ASCEND_ALIGN
    ranges = [(a + 100, 1000), (a + 5000, 10), (a + ASCEND_ALIGN + 1, 10), (a + 9 * MiB, 4 * MiB)]
    # the first three share or touch aligned granules; the last is apart
    assert merge_aligned_ranges(ranges) == [(a, 2 * ASCEND_ALIGN), (a + 8 * MiB, 6 * MiB)]
    assert merge_aligned_ranges([]) == []
    out = merge_aligned_ranges([(7, 3 * MiB), (3 * MiB, 1)], align=MiB)
    assert out == [(0, 4 * MiB)]


class _RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []
        self.locations: list[str] = []

    def batch_register_memory(self, ptrs: list[int], lens: list[int], location: str) -> int:
        self.calls.append((ptrs, lens))
        self.locations.append(location)
        return 0

    def get_rpc_port(self) -> int:
        return 1


def test_registration_is_one_batch_of_merged_ranges() -> None:
    engine = _RecordingEngine()
    mgr = AscendKVManager(engine=engine, protocol="tcp")
    pool = KVPool(64, 4, 2, 8, [0, 1, 2, 3])
    aux = AuxBuffer(4, 8)
    mgr.register(pool.buffer_infos(), aux)
    assert len(engine.calls) == 1
    assert engine.locations == ["*"]  # host memory: the engine probes the pointer
    ptrs, lens = engine.calls[0]
    spans = list(zip(ptrs, lens, strict=True))
    assert all(p % ASCEND_ALIGN == 0 and n % ASCEND_ALIGN == 0 for p, n in spans)
    for (p0, n0), (p1, _) in pairwise(spans):
        assert p0 + n0 < p1  # disjoint and not touching: merged
    for b in [*pool.buffer_infos()]:
        assert any(p <= b.ptr and b.ptr + b.nbytes <= p + n for p, n in spans)
    assert any(p <= aux.ptr and aux.ptr + aux.nbytes <= p + n for p, n in spans)


def test_missing_npu_runtime_is_a_clear_error() -> None:
    pytest.importorskip("mooncake.engine")
    try:
        import torch_npu  # noqa: F401

        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        AscendKVManager()


@pytest.mark.slow
def test_ascend_manager_transfers_and_remaps_over_tcp(decode_peer: Peer) -> None:
    """Same transfer and remapping checks as the Mooncake manager, through the Ascend subclass."""
    stage1 = Node(Spec(layer_ids=(2, 3), backend="ascend"), fill_seed=21)
    reg = decode_peer.ready
    src, dst = [0, 1, 2, 9, 33], [4, 5, 6, 60, 7]
    decode_peer.call("zero")
    stage1.manager.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst,
                                dst_layer_ids=reg.kv_layer_ids,
                                dst_bytes_per_page=reg.kv_bytes_per_page, executor=None)
    shape = stage1.entries()[0].shape
    got = [torch.frombuffer(bytearray(b), dtype=torch.float32).view(shape)
           for b in decode_peer.call("dump")]
    k2, k3, v2, v3 = stage1.entries()
    for entry, j in ((k2, 2), (k3, 3), (v2, 6), (v3, 7)):
        assert torch.equal(got[j][dst], entry[src])
    assert not any(got[j].any() for j in (0, 1, 4, 5, 8, 9))
    decode_peer.call("zero")
    with pytest.raises(LayerPairingError):
        stage1.manager.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst, dst_layer_ids=None)
    assert not any(any(b) for b in decode_peer.call("dump"))


@pytest.mark.slow
def test_ascend_decode_side_receives() -> None:
    """An Ascend-managed decode (merged registration) accepts writes into every entry."""
    decode = Peer("node", Spec(layer_ids=(0, 1), backend="ascend"))
    try:
        prefill = Node(Spec(layer_ids=(0, 1)), fill_seed=22)
        reg = decode.ready
        src, dst = list(range(10)), list(range(50, 60))
        prefill.manager.send_kvcache(reg.session_id, src, reg.kv_ptrs, dst,
                                     dst_layer_ids=reg.kv_layer_ids)
        shape = prefill.entries()[0].shape
        got = [torch.frombuffer(bytearray(b), dtype=torch.float32).view(shape)
               for b in decode.call("dump")]
        for entry, g in zip(prefill.entries(), got, strict=True):
            assert torch.equal(g[dst], entry[src])
    finally:
        decode.stop()
