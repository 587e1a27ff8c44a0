"""A speculative verify window over the linear-attention state pool: its outputs are those of
the ordinary kernels over the same rows, it writes no slot, and :meth:`LinearStates.keep`
leaves each slot holding exactly the state of the ordinary kernels run over its first ``a``
rows only (every ``a`` of the window), whichever ``verify_states`` keeps the window; the two
modes leave the same bits in the pool."""

from __future__ import annotations

import pytest
import torch

from engine.attention.linear.select import TORCH_KERNELS
from engine.attention.linear.states import LinearStates
from engine.config import REPLAY, VERIFY_STATES, VerifyStates
from engine.kv.state_pool import StatePool

C, K = 12, 4  # conv channels and taps
HK, HV, DK, DV = 2, 4, 8, 6  # key heads, value heads, head dims
N = 4  # rows per window: the bonus token and three drafts
SLOTS = [5, 1, 7]  # the window's sequences' slots


def pool_with_history(seed: int) -> StatePool:
    """A one-layer pool whose slots hold random (non-zero) states."""
    gen = torch.Generator().manual_seed(seed)
    pool = StatePool(8, [0], C, K, HV, DK, DV)
    pool.conv(0).copy_(torch.randn(pool.conv(0).shape, generator=gen))
    pool.recurrent(0).copy_(torch.randn(pool.recurrent(0).shape, generator=gen) * 0.3)
    return pool


def layer_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, C, generator=gen), "w": torch.randn(C, K, generator=gen),
            "q": torch.randn(rows, HK, DK, generator=gen),
            "k": torch.randn(rows, HK, DK, generator=gen),
            "v": torch.randn(rows, HV, DV, generator=gen),
            "g": -torch.rand(rows, HV, generator=gen), "beta": torch.rand(rows, HV, generator=gen)}


def run(states: LinearStates, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's conv and delta rule over the prepared rows."""
    conv = states.conv(0, t["x"], t["w"], None)
    return conv, states.delta_rule(0, t["q"], t["k"], t["v"], t["g"], t["beta"])


@pytest.mark.parametrize("mode", VERIFY_STATES)
@pytest.mark.parametrize("accepted", [[1, 1, 1], [2, 4, 3], [4, 4, 4], [3, 1, 2]])
def test_keep_leaves_the_state_of_the_accepted_rows_only(accepted: list[int],
                                                         mode: VerifyStates) -> None:
    t = layer_inputs(len(SLOTS) * N, seed=1)
    slots = torch.tensor(SLOTS)
    # the window
    window = LinearStates(pool_with_history(0), TORCH_KERNELS, mode)
    before = (window.pool.conv(0).clone(), window.pool.recurrent(0).clone())
    window.prepare_window(slots, N)
    conv, out = run(window, t)
    assert torch.equal(window.pool.conv(0), before[0])  # nothing written yet
    assert torch.equal(window.pool.recurrent(0), before[1])
    # the ordinary kernels over the whole window give the same outputs
    whole = LinearStates(pool_with_history(0), TORCH_KERNELS)
    whole.prepare(list(range(0, (len(SLOTS) + 1) * N, N)), slots)
    conv_want, out_want = run(whole, t)
    torch.testing.assert_close(conv, conv_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_want, atol=1e-5, rtol=1e-5)
    window.keep(torch.tensor(accepted))
    assert window.window == 0
    # each slot: the ordinary kernels over its accepted rows only (one sequence at a time)
    for b, (slot, a) in enumerate(zip(SLOTS, accepted, strict=True)):
        alone = LinearStates(pool_with_history(0), TORCH_KERNELS)
        alone.prepare([0, a], torch.tensor([slot]))
        seq = {name: x if name == "w" else x.view(len(SLOTS), N, *x.shape[1:])[b, :a]
               for name, x in t.items()}
        run(alone, seq)
        torch.testing.assert_close(window.pool.conv(0)[slot], alone.pool.conv(0)[slot])
        torch.testing.assert_close(window.pool.recurrent(0)[slot],
                                   alone.pool.recurrent(0)[slot], atol=1e-5, rtol=1e-5)
    others = [s for s in range(8) if s not in SLOTS]
    assert torch.equal(window.pool.recurrent(0)[others], before[1][others])
    assert torch.equal(window.pool.conv(0)[others], before[0][others])


@pytest.mark.parametrize("mode", VERIFY_STATES)
def test_keep_of_the_first_sequences_only_leaves_padded_ones_alone(mode: VerifyStates) -> None:
    """A padded batch keeps its real sequences' states; the padding's slot (here the first
    request's, read twice) is written once, by its request."""
    t = layer_inputs(len(SLOTS) * N, seed=2)
    states = LinearStates(pool_with_history(3), TORCH_KERNELS, mode)
    before = states.pool.recurrent(0).clone()
    states.prepare_window(torch.tensor([SLOTS[0], SLOTS[1], SLOTS[0]]), N)
    run(states, t)
    states.keep(torch.tensor([2, 3]))
    assert not torch.equal(states.pool.recurrent(0)[SLOTS[0]], before[SLOTS[0]])
    assert torch.equal(states.pool.recurrent(0)[SLOTS[2]], before[SLOTS[2]])
    with pytest.raises(RuntimeError, match="follows a verify forward"):
        states.keep(torch.tensor([1]))


def keep_after_window(mode: VerifyStates, t: dict[str, torch.Tensor], slots: list[int],
                      accepted: list[int]) -> tuple[StatePool, torch.Tensor]:
    """A two-layer pool with history after one verify window over ``slots`` kept in ``mode``
    with ``accepted``; and the window's delta-rule outputs (the second layer's)."""
    pool = StatePool(8, [0, 1], C, K, HV, DK, DV)
    gen = torch.Generator().manual_seed(4)
    for i in range(2):
        pool.conv(i).copy_(torch.randn(pool.conv(i).shape, generator=gen))
        pool.recurrent(i).copy_(torch.randn(pool.recurrent(i).shape, generator=gen) * 0.3)
    states = LinearStates(pool, TORCH_KERNELS, mode)
    states.prepare_window(torch.tensor(slots), N)
    for i in range(2):
        states.conv(i, t["x"], t["w"], None)
        out = states.delta_rule(i, t["q"], t["k"], t["v"], t["g"], t["beta"])
    states.keep(torch.tensor(accepted))
    return pool, out


@pytest.mark.parametrize("seed", range(6))
def test_both_modes_leave_the_same_bits(seed: int) -> None:
    """Keep-rows and replay over the same window: the same outputs and byte-identical pools, for
    random accepted counts (1 and ``n`` always among them), a padded sequence included; a
    slot's rejected rows leave no trace: a window over its accepted rows alone, kept whole,
    leaves the same bits."""
    gen = torch.Generator().manual_seed(100 + seed)
    slots = [5, 1, 7, 2, 5]  # the last sequence pads (it reads the first one's slot)
    accepted = [1, N, *torch.randint(1, N + 1, (2,), generator=gen).tolist()]
    accepted = [accepted[i] for i in torch.randperm(4, generator=gen).tolist()]
    t = layer_inputs(len(slots) * N, seed=10 + seed)
    rows, out_rows = keep_after_window("rows", t, slots, accepted)
    replay, out_replay = keep_after_window(REPLAY, t, slots, accepted)
    assert torch.equal(out_rows, out_replay)
    for i in range(2):
        assert torch.equal(rows.conv(i), replay.conv(i))
        assert torch.equal(rows.recurrent(i), replay.recurrent(i))
    # the accepted rows alone, in the replay's window shape (the rest of the window's rows
    # changed to other values): the same kept states, so the rejected rows left nothing
    other = layer_inputs(len(slots) * N, seed=50 + seed)
    kept = torch.arange(N) < torch.tensor([*accepted, 0])[:, None]  # [B, n]: accepted rows
    mixed = {"w": t["w"]}
    for name in ("x", "q", "k", "v", "g", "beta"):
        x = t[name]
        mask = kept.view(-1, *([1] * (x.dim() - 1)))
        mixed[name] = torch.where(mask, x, other[name])
    changed, _ = keep_after_window(REPLAY, mixed, slots, accepted)
    for i in range(2):
        assert torch.equal(changed.conv(i), replay.conv(i))
        assert torch.equal(changed.recurrent(i), replay.recurrent(i))


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="verify_states must be one of rows, replay, got 'all'"):
        LinearStates(pool_with_history(0), TORCH_KERNELS, "all")  # type: ignore[arg-type]
