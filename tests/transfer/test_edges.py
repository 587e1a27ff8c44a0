"""Clear errors at the edges of the transfer layer.

- The Mooncake engine failing to import: not installed, a system library missing, the CUDA build
  without the CUDA runtime; each error names its own remedy (the import is made to fail by a
  finder placed first on ``sys.meta_path``).
- A decode with an EAGLE draft and a prefill without one (or the reverse) is refused at the
  handshake with a message naming both sides; the room fails on both sides, nothing is held.
  A pipeline stage checks the decode against the draft of the pipeline's last stage.
- ``send_kvcache`` takes the keywords of callers written for SGLang and refuses any other one;
  bytes that land are compared with the source pages, refusals move none.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from engine.kv.pool import KVPool
from tests.transfer.xfer_peer import FreeList, Node, Spec
from transfer.aux import AuxRow
from transfer.backends.engine_import import SYSTEM_LIBRARIES_APT
from transfer.backends.mooncake import MooncakeKVManager, create_mooncake_engine
from transfer.bootstrap.decode import DecodeBootstrapClient
from transfer.bootstrap.handshake import BootstrapConfig, ModelIdentity
from transfer.bootstrap.prefill import PrefillBootstrapServer
from transfer.errors import (
    BackendUnavailableError,
    IncompatiblePeerError,
    LayerPairingError,
    TransferError,
)
from transfer.setup import make_kv_manager
from transfer.status import KVPoll

CFG = BootstrapConfig(bootstrap_timeout_s=0.5, waiting_timeout_s=1.0, heartbeat_interval_s=0.2,
                      heartbeat_misses=5, quarantine_s=1.0, connect_timeout_s=1.0, tick_s=0.02)
ROOM = 0xED6E_0000_0000_0001
ROW = AuxRow(room=0, first_token=5, logprob=-0.5, mrope_delta=0,
             hidden=tuple(float(i) for i in range(8)))
TARGET_LAYERS = 4
PLAIN, EAGLE = Spec(), Spec(draft_ids=(TARGET_LAYERS,))


def wait_for(pred: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"condition not met within {timeout}s"
        time.sleep(0.01)


# ---- the engine import ---------------------------------------------------------------------


class _FailingImport(importlib.abc.MetaPathFinder):
    """Raises ``exc`` for any import of the mooncake package or its engine."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> None:
        if name in ("mooncake", "mooncake.engine"):
            raise self.exc


@pytest.fixture
def fail_import(monkeypatch: pytest.MonkeyPatch) -> Callable[[BaseException], None]:
    def arm(exc: BaseException) -> None:
        for name in ("mooncake", "mooncake.engine"):
            monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.setattr(sys, "meta_path", [_FailingImport(exc), *sys.meta_path])

    return arm


NOT_INSTALLED = ModuleNotFoundError("No module named 'mooncake'", name="mooncake")


@pytest.mark.parametrize(("kv_device", "extra"), [
    ("cpu", "mooncake"), ("cuda:0", "cuda"), ("npu:1", "ascend"), ("", "mooncake"),
])
def test_engine_not_installed_names_the_extra_for_the_kv_memory(
    fail_import: Callable[[BaseException], None], kv_device: str, extra: str
) -> None:
    fail_import(NOT_INSTALLED)
    with pytest.raises(BackendUnavailableError) as err:
        MooncakeKVManager(kv_device=kv_device)
    msg = str(err.value)
    assert "not installed" in msg and f"pip install 'pdserve[{extra}]'" in msg
    assert "apt-get" not in msg and err.value.__cause__ is NOT_INSTALLED


def test_make_kv_manager_passes_where_the_kv_lives(
    fail_import: Callable[[BaseException], None]
) -> None:
    fail_import(NOT_INSTALLED)
    pool = KVPool(2, 4, 1, 8, layer_ids=[0])
    with pytest.raises(BackendUnavailableError, match=r"pdserve\[mooncake\]' \(host memory\)"):
        make_kv_manager("mooncake", pool.buffer_infos(), hidden_size=8, aux_rows=1,
                        hostname="127.0.0.1")


@pytest.mark.parametrize("exc", [
    ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
    OSError("librdmacm.so.1: cannot open shared object file: No such file or directory"),
], ids=["import-error", "os-error"])
def test_a_missing_system_library_is_named_with_the_apt_line(
    fail_import: Callable[[BaseException], None], exc: BaseException
) -> None:
    fail_import(exc)
    library = str(exc).split(":")[0]
    with pytest.raises(BackendUnavailableError) as err:
        create_mooncake_engine("127.0.0.1", kv_device="cpu")
    msg = str(err.value)
    assert f"system library {library}" in msg and SYSTEM_LIBRARIES_APT in msg
    assert "is installed" in msg and "pip install" not in msg and err.value.__cause__ is exc


def test_the_cuda_build_without_the_cuda_runtime_points_to_the_host_build(
    fail_import: Callable[[BaseException], None]
) -> None:
    fail_import(ImportError("libcudart.so.12: cannot open shared object file: No such file"))
    with pytest.raises(BackendUnavailableError) as err:
        MooncakeKVManager(kv_device="cpu")
    msg = str(err.value)
    assert "CUDA build" in msg and "libcudart.so.12" in msg
    assert "pip install 'pdserve[mooncake]'" in msg and "apt-get" not in msg


def test_the_real_engine_still_loads() -> None:
    """The finder is gone after each test: the installed engine imports as before."""
    engine = create_mooncake_engine("127.0.0.1")
    assert engine.get_rpc_port() > 0


# ---- an EAGLE draft on one side only -------------------------------------------------------


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Node]]:
    """Prefill and decode nodes with and without a draft band (ids 0..3, draft band 4)."""
    yield {"prefill": Node(PLAIN, fill_seed=7), "prefill+draft": Node(EAGLE, fill_seed=8),
           "decode": Node(PLAIN), "decode+draft": Node(EAGLE)}


def _identity(spec: Spec) -> ModelIdentity:
    return dataclasses.replace(spec.identity, num_hidden_layers=TARGET_LAYERS)


@pytest.mark.parametrize(("p", "d", "named"), [
    ("prefill", "decode+draft", "prefill has no draft, decode has a draft (KV layer ids [4])"),
    ("prefill+draft", "decode", "prefill has a draft (KV layer ids [4]), decode has no draft"),
])
def test_a_draft_on_one_side_only_is_refused_at_the_handshake(
    nodes: dict[str, Node], p: str, d: str, named: str
) -> None:
    prefill, decode = nodes[p], nodes[d]
    server = PrefillBootstrapServer(prefill.manager, _identity(prefill.spec), config=CFG)
    pages = FreeList(decode.spec.num_pages)
    try:
        server.add_room(ROOM)  # the router opened the room on the prefill
        with pytest.raises(IncompatiblePeerError, match="EAGLE drafts differ") as err:
            DecodeBootstrapClient(decode.manager, _identity(decode.spec), server.address,
                                  pages.give, config=CFG)
        assert named in str(err.value)
        assert pages.held == 0 and decode.aux.num_free == decode.aux.num_rows
        wait_for(lambda: server.poll(ROOM) is KVPoll.Failed, 3)
        reason = server.failure_reason(ROOM)
        assert "bootstrap timeout" in reason and named in reason
        server.release(ROOM)
        assert server.num_rooms == 0 and prefill.aux.num_free == prefill.aux.num_rows
    finally:
        server.close()


def test_drafts_on_both_sides_deliver_the_draft_band(nodes: dict[str, Node]) -> None:
    """The control: the same check lets an EAGLE pair through, and the draft KV lands."""
    prefill, decode = nodes["prefill+draft"], nodes["decode+draft"]
    server = PrefillBootstrapServer(prefill.manager, _identity(EAGLE), config=CFG)
    pages = FreeList(EAGLE.num_pages)
    client = DecodeBootstrapClient(decode.manager, _identity(EAGLE), server.address, pages.give,
                                   config=CFG)
    try:
        server.add_room(ROOM)
        client.add_room(ROOM)
        dst = pages.take(2)
        client.send_destination(ROOM, dst)
        wait_for(lambda: server.poll(ROOM) is KVPoll.WaitingForInput, 3)
        assert server.send_chunk(ROOM, [3, 4], last=ROW) is KVPoll.Success
        wait_for(lambda: client.poll(ROOM) is KVPoll.Success, 3)
        assert client.commit(ROOM).room == ROOM
        server.release(ROOM)
        draft_src, draft_dst = prefill.entries()[-1], decode.entries()[-1]
        assert torch.equal(draft_dst[dst], draft_src[[3, 4]])
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(("band", "refusal"), [
    ((4,), None),
    ((), "pipeline prefill has no draft, decode has a draft (KV layer ids [4]); start the "
         "pipeline's last stage and the decode with the same --draft"),
])
def test_a_pipeline_stage_checks_the_decode_against_the_pipelines_draft(
    nodes: dict[str, Node], band: tuple[int, ...], refusal: str | None
) -> None:
    """A stage before the last holds no draft buffers: it accepts a decode with a draft when the
    pipeline's last stage runs the same one, and refuses it, naming the fix, when none does."""
    stage, decode = nodes["prefill"], nodes["decode+draft"]
    identity = dataclasses.replace(_identity(stage.spec), pipeline_draft_band=band)
    server = PrefillBootstrapServer(stage.manager, identity, config=CFG)
    pages = FreeList(decode.spec.num_pages)
    try:
        if refusal is None:
            DecodeBootstrapClient(decode.manager, _identity(decode.spec), server.address,
                                  pages.give, config=CFG).close()
        else:
            with pytest.raises(IncompatiblePeerError, match="EAGLE drafts differ") as err:
                DecodeBootstrapClient(decode.manager, _identity(decode.spec), server.address,
                                      pages.give, config=CFG)
            assert refusal in str(err.value)
    finally:
        server.close()


# ---- send_kvcache keywords -----------------------------------------------------------------


def _send(nodes: dict[str, Node], **kw: Any) -> None:
    src, dst = nodes["prefill+draft"], nodes["decode+draft"]
    reg = dst.registration()
    executor = kw.pop("executor", None)
    src.manager.send_kvcache(reg.session_id, [1, 2], reg.kv_ptrs, [5, 6], executor,
                             dst_layer_ids=reg.kv_layer_ids, **kw)


def _landed(nodes: dict[str, Node]) -> bool:
    src, dst = nodes["prefill+draft"], nodes["decode+draft"]
    return all(torch.equal(d[[5, 6]], s[[1, 2]])
               for s, d in zip(src.entries(), dst.entries(), strict=True))


def test_sglang_keywords_are_accepted(nodes: dict[str, Node]) -> None:
    nodes["decode+draft"].zero()
    bpp = nodes["decode+draft"].registration().kv_bytes_per_page[0]
    with ThreadPoolExecutor(1) as pool:
        _send(nodes, executor=pool, dst_kv_item_len=bpp, dst_device_kv_indices=None,
              dst_attn_tp_size=1)
    assert _landed(nodes)


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"dst_layer_id": [0]}, TypeError, "dst_layer_id"),
    ({"dst_bytes_per_pages": [1]}, TypeError, "dst_bytes_per_pages"),
    ({"executor": "not an executor"}, TypeError, "executor must be None or"),
    ({"dst_kv_item_len": 3}, LayerPairingError, "bytes per page differ"),
    ({"dst_attn_tp_size": 2}, TransferError, "dst_attn_tp_size=2"),
])
def test_a_wrong_keyword_is_refused_and_moves_nothing(
    nodes: dict[str, Node], kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    nodes["decode+draft"].zero()
    with pytest.raises(error, match=match):
        _send(nodes, **kw)
    assert not any(e.any() for e in nodes["decode+draft"].entries())
