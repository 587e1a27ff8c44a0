"""The state-transfer plan and the handshake's checks of state entries, pure logic.

Spans are checked against offsets worked out by hand for a small geometry (2 key heads of 4,
4 value heads of 3, a kernel of 4 in float32: q and k channels of 8 each, v channels of 12,
each channel 3 elements = 12 bytes; a recurrent head 4 * 3 * 4 = 48 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from transfer.bootstrap.handshake import ModelIdentity, plan_state_sends
from transfer.bootstrap.messages import Registration
from transfer.errors import IncompatiblePeerError
from transfer.plan.states import CONV, RECURRENT, StateCopy, StateLayout, plan_state_copy


def layout(tp: int = 1, **kw: int) -> StateLayout:
    values = {"num_k_heads": 2, "head_k_dim": 4, "num_v_heads": 4, "head_v_dim": 3,
              "conv_kernel": 4, "conv_elem_bytes": 4, **kw}
    return StateLayout(**values, tp_size=tp)


def test_entry_bytes_per_rank() -> None:
    assert layout().entry_bytes(CONV) == (8 + 8 + 12) * 12
    assert layout().entry_bytes(RECURRENT) == 4 * 48
    assert layout(2).entry_bytes(CONV) == (4 + 4 + 6) * 12
    assert layout(2).entry_bytes(RECURRENT) == 2 * 48


def test_equal_layouts_copy_whole_entries() -> None:
    for tp in (1, 2):
        for rank in range(tp):
            copy = plan_state_copy(layout(tp), layout(tp), rank, rank)
            assert copy.conv == ((0, 0, layout(tp).entry_bytes(CONV)),)
            assert copy.recurrent == ((0, 0, layout(tp).entry_bytes(RECURRENT)),)
    assert plan_state_copy(layout(2), layout(2), 0, 1).empty


def test_tp1_to_tp2_takes_each_segment_half() -> None:
    copy = plan_state_copy(layout(1), layout(2), 0, 1)
    # q channels 4..7, k channels 12..15, v channels 22..27 of the source
    assert copy.conv == ((4 * 12, 0, 48), (12 * 12, 48, 48), (22 * 12, 96, 72))
    assert copy.recurrent == ((2 * 48, 0, 96),)


def test_tp2_to_tp1_writes_each_segment_half() -> None:
    copy = plan_state_copy(layout(2), layout(1), 1, 0)
    assert copy.conv == ((0, 4 * 12, 48), (48, 12 * 12, 48), (96, 22 * 12, 72))
    assert copy.recurrent == ((0, 96, 96),)


def test_wire_forms_round_trip() -> None:
    copy = plan_state_copy(layout(1), layout(2), 0, 1)
    assert StateCopy.from_list(copy.to_list()) == copy
    assert StateLayout.from_list(layout(2).to_list()) == layout(2)
    assert StateLayout.from_list([]) is None
    with pytest.raises(IncompatiblePeerError, match="malformed"):
        StateCopy.from_list([5, 0, 0, 1])


def test_refusals_name_the_numbers() -> None:
    with pytest.raises(IncompatiblePeerError, match="value head dim: prefill has 3, decode has 5"):
        plan_state_copy(layout(), layout(head_v_dim=5), 0, 0)
    with pytest.raises(IncompatiblePeerError, match="TP 4 does not divide the 2 key heads"):
        layout(4)
    with pytest.raises(IncompatiblePeerError, match="decode rank 2 is outside its TP 2"):
        plan_state_copy(layout(), layout(2), 0, 2)


# ---- the handshake's checks ----------------------------------------------------------------

@dataclass
class FakeRank:
    """A prefill rank's registered entries as the handshake reads them."""

    kv_layer_ids: list[int] | None
    state_layer_ids: list[int]
    state_bytes_per_slot: list[int]
    kv_ptrs: list[int] = field(default_factory=list)
    kv_bytes_per_page: list[int] = field(default_factory=list)
    has_staging: bool = False
    aux: None = None


def rank(tp: int = 1, state_ids: tuple[int, ...] = (0, 2)) -> FakeRank:
    lay = layout(tp)
    sizes = [lay.entry_bytes(CONV)] * len(state_ids) + [lay.entry_bytes(RECURRENT)] * len(state_ids)
    return FakeRank([1, 3, 1, 3], [*state_ids, *state_ids], sizes)


def registration(tp: int = 1, rank_: int = 0, kv: tuple[int, ...] = (1, 3),
                 states: tuple[int, ...] = (0, 2), lay: StateLayout | None = None) -> Registration:
    lay = lay or layout(tp)
    sizes = [lay.entry_bytes(CONV)] * len(states) + [lay.entry_bytes(RECURRENT)] * len(states)
    return Registration(
        session_id="x:1", kv_ptrs=[0] * 2 * len(kv), kv_bytes_per_page=[64] * 2 * len(kv),
        kv_layer_ids=[*kv, *kv], num_pages=8, aux_ptr=0, aux_row_bytes=64, aux_num_rows=2,
        page_size=4, dtype="f32", model_fingerprint="m", tp_rank=rank_,
        state_ptrs=[0] * len(sizes), state_bytes_per_slot=sizes,
        state_layer_ids=[*states, *states], num_state_slots=4,
        state_layout=lay.to_list() if states else [])


def identity(tp: int = 1, states: bool = True) -> ModelIdentity:
    return ModelIdentity("m", 4, "f32", states=layout(tp) if states else None)


def test_plan_state_sends_pairs_ranks() -> None:
    assert [r for r, _ in plan_state_sends(identity(), [rank()], registration())] == [0]
    two = plan_state_sends(identity(2), [rank(2), rank(2)], registration())
    assert [r for r, _ in two] == [0, 1]
    assert plan_state_sends(identity(states=False), [FakeRank([1, 3], [], [])],
                            registration(states=())) == []


def test_plan_state_sends_refusals() -> None:
    with pytest.raises(IncompatiblePeerError, match="layer 1 is full attention on the prefill"):
        plan_state_sends(identity(), [rank()], registration(kv=(3,), states=(0, 1, 2)))
    with pytest.raises(IncompatiblePeerError, match=r"decode holds .* layers \[0, 2\], the "):
        plan_state_sends(identity(states=False), [FakeRank([1, 3], [], [])], registration())
    with pytest.raises(IncompatiblePeerError, match=r"prefill holds .* layers \[0, 2\], the dec"):
        plan_state_sends(identity(), [rank()], registration(states=()))
    with pytest.raises(IncompatiblePeerError, match="conv kernel: prefill has 4, decode has 3"):
        plan_state_sends(identity(), [rank()], registration(lay=layout(conv_kernel=3)))
    with pytest.raises(IncompatiblePeerError, match="lacks an entry for layer 2"):
        plan_state_sends(identity(), [rank()], registration(states=(0, 4)))
    bad = rank()
    bad.state_bytes_per_slot[0] += 4
    with pytest.raises(IncompatiblePeerError, match="prefill state entry of layer 0 has 340"):
        plan_state_sends(identity(), [bad], registration())
