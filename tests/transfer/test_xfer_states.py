"""Linear-attention states through ``send_kvcache``, between processes with real Mooncake
engines over loopback TCP, compared byte for byte with slices taken here by torch.

A hybrid node holds KV entries for its full-attention layers and state entries (a conv state
``[slots, C, K - 1]`` and a recurrent state ``[slots, Hv, Dk, Dv]`` per linear-attention layer)
for the others; one send moves pages and a slot together, paired by global layer id: a whole
model, a pipeline stage holding part of the layers, TP 1 -> TP 2 (each decode rank gets its
key heads' q and k channels, its value heads' v channels and recurrent states) and TP 2 -> TP 1
(two prefill ranks fill one slot). Refusals come before a byte moves.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.transfer.xfer_peer import Node, Peer, Spec, StateSpec
from transfer.errors import LayerPairingError, PageListError
from transfer.plan.heads import HeadLayout, plan_head_copies
from transfer.plan.states import plan_state_copy

pytestmark = pytest.mark.slow

KV_LAYERS, STATE_LAYERS = (1, 3), (0, 2)


def _spec(kv: tuple[int, ...] = KV_LAYERS, states: StateSpec | None = None) -> Spec:
    return Spec(layer_ids=kv, extra={"states": states or StateSpec(STATE_LAYERS)})


def _states(peer: Peer, like: Node, rank: int | None = None) -> list[torch.Tensor]:
    """The peer's state entries (rank ``rank`` of a ``ranks`` peer), shaped like ``like``'s."""
    raw = peer.call("dump_states") if rank is None else peer.call("dump_states", rank)
    return [torch.frombuffer(bytearray(b), dtype=torch.float32).view(e.shape)
            for b, e in zip(raw, like.state_entries(), strict=True)]


def _state_kw(reg, src_slot: int, dst_slot: int, **kw: object) -> dict[str, object]:  # noqa: ANN001
    return {"src_state_slot": src_slot, "dst_state_ptrs": reg.state_ptrs,
            "dst_state_slot": dst_slot, "dst_state_layer_ids": reg.state_layer_ids,
            "dst_state_bytes_per_slot": reg.state_bytes_per_slot, **kw}


@pytest.fixture(scope="module")
def hybrid_peer() -> Iterator[Peer]:
    peer = Peer("node", _spec())
    yield peer
    peer.stop()


def test_pages_and_a_slot_in_one_send(hybrid_peer: Peer) -> None:
    node = Node(_spec(), fill_seed=3)
    reg = hybrid_peer.ready
    hybrid_peer.call("zero")
    result = node.manager.send_kvcache(
        reg.session_id, [1, 2], reg.kv_ptrs, [5, 6], dst_layer_ids=reg.kv_layer_ids,
        dst_bytes_per_page=reg.kv_bytes_per_page, **_state_kw(reg, 3, 6))
    assert result.batches == 1  # pages and states in one engine call
    got = _states(hybrid_peer, node)
    for mine, theirs in zip(node.state_entries(), got, strict=True):
        expect = torch.zeros_like(theirs)
        expect[6] = mine[3]
        assert torch.equal(theirs, expect)
    pages = [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in hybrid_peer.call("dump")]
    src = node.entries()[0]
    assert torch.equal(pages[0].view(src.shape)[5:7], src[1:3])


def test_a_pipeline_stage_writes_its_layers_only(hybrid_peer: Peer) -> None:
    """A stage holding full-attention layer 3 and linear layer 2 fills those entries by id."""
    stage = Node(_spec(kv=(3,), states=StateSpec((2,))), fill_seed=4)
    whole = Node(_spec())  # the decode's shapes
    reg = hybrid_peer.ready
    hybrid_peer.call("zero")
    stage.manager.send_kvcache(reg.session_id, [0], reg.kv_ptrs, [2],
                               dst_layer_ids=reg.kv_layer_ids,
                               dst_bytes_per_page=reg.kv_bytes_per_page, **_state_kw(reg, 1, 4))
    got = _states(hybrid_peer, whole)
    conv2, rec2 = stage.state_entries()
    # decode entries: conv 0, conv 2, recurrent 0, recurrent 2
    assert torch.equal(got[1][4], conv2[1]) and torch.equal(got[3][4], rec2[1])
    assert not got[0].any() and not got[2].any()  # layer 0 is another stage's
    assert not got[1][torch.arange(8) != 4].any()


def test_tp1_to_tp2_each_rank_gets_its_heads() -> None:
    specs = [_spec(states=StateSpec(STATE_LAYERS, tp=2, rank=r)) for r in range(2)]
    peer = Peer("ranks", specs[0], specs)
    try:
        src_spec = StateSpec(STATE_LAYERS)
        node = Node(_spec(states=src_spec), fill_seed=5)
        for rank, reg in enumerate(peer.ready):
            copy = plan_state_copy(src_spec.layout, specs[rank].extra["states"].layout, 0, rank)
            node.manager.send_kvcache(reg.session_id, [], reg.kv_ptrs, [],
                                      dst_layer_ids=reg.kv_layer_ids,
                                      **_state_kw(reg, 2, 7, dst_state_copy=copy))
        like = Node(specs[0])
        for rank in range(2):
            got = _states(peer, like, rank)
            for k, (mine, theirs) in enumerate(zip(node.state_entries(), got, strict=True)):
                expect = torch.zeros_like(theirs)
                expect[7] = _share(mine[2], src_spec, rank, conv=k < len(STATE_LAYERS))
                assert torch.equal(theirs, expect), (rank, k)
    finally:
        peer.stop()


def test_tp2_to_tp1_two_ranks_fill_one_slot(hybrid_peer: Peer) -> None:
    whole = StateSpec(STATE_LAYERS)
    ranks = [Node(_spec(states=StateSpec(STATE_LAYERS, tp=2, rank=r)), fill_seed=6 + r)
             for r in range(2)]
    reg = hybrid_peer.ready
    hybrid_peer.call("zero")
    for rank, node in enumerate(ranks):
        copy = plan_state_copy(node.spec.extra["states"].layout, whole.layout, rank, 0)
        node.manager.send_kvcache(reg.session_id, [], reg.kv_ptrs, [],
                                  dst_layer_ids=reg.kv_layer_ids,
                                  **_state_kw(reg, 1, 0, dst_state_copy=copy))
    got = _states(hybrid_peer, Node(_spec()))
    for k, theirs in enumerate(got):
        conv = k < len(STATE_LAYERS)
        for rank, node in enumerate(ranks):
            assert torch.equal(_share(theirs[0], whole, rank, conv=conv),
                               node.state_entries()[k][1]), (rank, k)
        assert not theirs[1:].any()


def _heads(tp: int) -> HeadLayout:
    """The KV heads of ``Spec()``'s two heads over ``tp`` ranks."""
    spec = Spec()
    return HeadLayout.tensor_parallel(spec.heads, tp, head_dim=spec.head_dim,
                                      dtype="torch.float32", page_size=spec.page_size)


@pytest.mark.parametrize("src_tp", [2, 1])
def test_a_head_sliced_send_with_states_is_one_send(hybrid_peer: Peer, src_tp: int) -> None:
    """KV head slices and a state slot in one ``send_kvcache``: ``on_send`` hears of it once,
    with all its bytes, whether the slices go one block per token (TP 2 -> TP 1) or through
    the staging buffer (TP 1 -> TP 2)."""
    dst_tp = 3 - src_tp
    dst_states = [StateSpec(STATE_LAYERS, tp=dst_tp, rank=r) for r in range(dst_tp)]
    dst_specs = [Spec(layer_ids=KV_LAYERS, heads=2 // dst_tp, extra={"states": st})
                 for st in dst_states]
    peer = hybrid_peer if dst_tp == 1 else Peer("ranks", dst_specs[0], dst_specs)
    try:
        regs = [peer.ready] if dst_tp == 1 else peer.ready
        src_states = StateSpec(STATE_LAYERS, tp=src_tp, rank=0)
        node = Node(Spec(layer_ids=KV_LAYERS, heads=2 // src_tp,
                         extra={"states": src_states, "staging_bytes": 1 << 16}), fill_seed=8)
        calls: list[tuple[int, bool]] = []
        node.manager.on_send = lambda nbytes, seconds, ok: calls.append((nbytes, ok))
        sent = []
        for copy in plan_head_copies(_heads(src_tp), _heads(dst_tp), 0):
            reg = regs[copy.dst_rank]
            state = plan_state_copy(src_states.layout, dst_states[copy.dst_rank].layout, 0,
                                    copy.dst_rank)
            assert not copy.whole
            sent.append(node.manager.send_kvcache(
                reg.session_id, [1, 2], reg.kv_ptrs, [5, 6], dst_layer_ids=reg.kv_layer_ids,
                dst_bytes_per_page=reg.kv_bytes_per_page, dst_heads=copy,
                **_state_kw(reg, 2, 4, dst_state_copy=state)))
        assert calls == [(result.nbytes, True) for result in sent]
        assert all(result.nbytes > 0 for result in sent)
    finally:
        if peer is not hybrid_peer:
            peer.stop()


def _share(state: torch.Tensor, spec: StateSpec, rank: int, *, conv: bool) -> torch.Tensor:
    """Rank ``rank`` of 2's part of one slot's whole-layer state: its q, k and v channels of
    the conv state, or its value heads of the recurrent state."""
    if not conv:
        per = spec.num_v_heads // 2
        return state[rank * per : (rank + 1) * per]
    keys = spec.num_k_heads * spec.head_k_dim
    q, k, v = state[:keys], state[keys : 2 * keys], state[2 * keys :]
    return torch.cat([part[rank * len(part) // 2 : (rank + 1) * len(part) // 2]
                      for part in (q, k, v)])


def test_bad_state_arguments_move_nothing(hybrid_peer: Peer) -> None:
    node = Node(_spec(), fill_seed=9)
    reg = hybrid_peer.ready
    hybrid_peer.call("zero")
    base = {"dst_layer_ids": reg.kv_layer_ids}
    with pytest.raises(TypeError, match="without src_state_slot"):
        node.manager.send_kvcache(reg.session_id, [0], reg.kv_ptrs, [0],
                                  dst_state_ptrs=reg.state_ptrs, **base)
    with pytest.raises(PageListError, match="source state slot 8"):
        node.manager.send_kvcache(reg.session_id, [0], reg.kv_ptrs, [0], **base,
                                  **_state_kw(reg, 8, 0))
    with pytest.raises(LayerPairingError, match="layer 2"):
        node.manager.send_kvcache(reg.session_id, [0], reg.kv_ptrs, [0], **base,
                                  **_state_kw(reg, 0, 0, dst_state_layer_ids=[0, 4, 0, 4]))
    with pytest.raises(LayerPairingError, match="bytes per state slot"):
        node.manager.send_kvcache(reg.session_id, [0], reg.kv_ptrs, [0], **base,
                                  **_state_kw(reg, 0, 0, dst_state_bytes_per_slot=[1, 1, 1, 1]))
    assert not any(b.strip(b"\0") for b in hybrid_peer.call("dump"))  # no page moved
    assert not any(t.any() for t in _states(hybrid_peer, node))
