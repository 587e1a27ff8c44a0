"""The native one-token step of the gated delta rule (``engine.attention.linear.native``): built
here from C, equal to its torch twin (``delta_rule._one_token_torch``) within float32 rounding
in every form the rule calls it (over the pool by slot, into a new state, with and without an
output), and, where it cannot be built, a reason and the torch ops instead. Its agreement with
transformers' recurrent step is in ``test_linear_kernels`` (decode rows, both steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.linear import native
from engine.attention.linear.delta_rule import _one_token_torch, gated_delta_rule

ATOL = 1e-5


def _inputs(n: int, h: int, dk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1)
    return {"q": torch.randn(n, h, dk, generator=gen), "k": k,
            "v": torch.randn(n, h, dv, generator=gen), "g": -torch.rand(n, h, generator=gen),
            "beta": torch.rand(n, h, generator=gen)}


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No kernel loaded yet in this process, and an empty kernel cache of the test's own."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reason", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    return tmp_path


def test_the_kernel_builds_once_into_the_cache(fresh: Path) -> None:
    kernel = native.one_token_kernel()
    assert kernel is not None and native.unavailable_reason() is None
    [built] = fresh.glob("gdn_one_token-*.so")
    stamp = built.stat().st_mtime_ns
    native._loaded.clear()  # a new process: loads the cached library, builds nothing
    assert native.one_token_kernel() is not None
    assert list(fresh.iterdir()) == [built] and built.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("shape", [(1, 16, 128, 128), (5, 3, 16, 8), (32, 4, 8, 24)])
def test_over_the_pool_by_slot_it_equals_the_torch_step(shape: tuple[int, ...]) -> None:
    """Slots out of order and apart, stepped in place; the other slots keep their bits."""
    n, h, dk, dv = shape
    kernel = native.one_token_kernel()
    assert kernel is not None, native.unavailable_reason()
    x = _inputs(n, h, dk, dv, seed=n)
    slots = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(1))[:n]
    pool = torch.randn(2 * n + 1, h, dk, dv, generator=torch.Generator().manual_seed(2))
    twin = pool.clone()
    out = native.one_token(kernel, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, pool, slots)
    want = _one_token_torch(x["q"], x["k"], x["v"], x["g"], x["beta"], twin, twin, slots)
    assert out is not None and want is not None
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool, twin, atol=ATOL, rtol=0)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(pool[others], twin[others])


@pytest.mark.parametrize("with_output", [True, False])
def test_into_a_new_state_it_leaves_the_old_one(with_output: bool) -> None:
    """The verify window's and replay's form: rows 0..N-1 of ``src`` into ``dst``."""
    kernel = native.one_token_kernel()
    assert kernel is not None
    x = _inputs(6, 4, 32, 16, seed=3)
    src = torch.randn(6, 4, 32, 16)
    before = src.clone()
    dst, twin = torch.full_like(src, float("nan")), torch.empty_like(src)
    q = x["q"] if with_output else None
    out = native.one_token(kernel, q, x["k"], x["v"], x["g"], x["beta"], src, dst, None)
    want = _one_token_torch(q, x["k"], x["v"], x["g"], x["beta"], src, twin, None)
    assert torch.equal(src, before)
    torch.testing.assert_close(dst, twin, atol=ATOL, rtol=0)
    if with_output:
        assert out is not None and want is not None
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    else:
        assert out is None and want is None


def test_it_refuses_states_it_cannot_step() -> None:
    kernel = native.one_token_kernel()
    assert kernel is not None
    x = _inputs(2, 2, 8, 8, seed=4)
    for bad in (torch.zeros(2, 2, 8, 8, dtype=torch.float64),
                torch.zeros(2, 2, 8, 16)[..., :8]):
        with pytest.raises(ValueError, match="native delta rule step"):
            native.one_token(kernel, x["q"], x["k"], x["v"], x["g"], x["beta"], bad, bad, None)


@pytest.mark.parametrize(("env", "reason"), [
    ({native.DISABLE_ENV: "0"}, "PDSERVE_NATIVE_KERNELS=0"),
    ({"CC": "/nonexistent/cc"}, "no C compiler"),
    ({"CC": "false"}, "the build failed"),
])
def test_without_the_kernel_the_rule_runs_the_torch_ops(
        fresh: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], reason: str) -> None:
    """No kernel, a reason why, nothing half-built left in the cache, and decode rows still
    stepped (by the torch ops: the native step's results within rounding)."""
    x = _inputs(3, 4, 16, 16, seed=5)
    pool = torch.randn(4, 4, 16, 16)
    twin = pool.clone()
    slots = torch.tensor([3, 0, 1])
    assert native.one_token_kernel() is not None  # built by the real compiler first
    want = gated_delta_rule(**x, q_starts=[0, 1, 2, 3], state=twin, slots=slots)
    [built] = fresh.iterdir()
    monkeypatch.setattr(native, "_loaded", {})  # a new process, in the environment below
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert native.one_token_kernel() is None
    assert reason in (native.unavailable_reason() or "")
    assert list(fresh.iterdir()) == [built]
    got = gated_delta_rule(**x, q_starts=[0, 1, 2, 3], state=pool, slots=slots)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool, twin, atol=ATOL, rtol=0)


def test_it_refuses_shapes_and_slots_that_do_not_fit() -> None:
    """The kernel indexes raw memory: what would read or write past a tensor is an error."""
    kernel = native.one_token_kernel()
    assert kernel is not None
    x = _inputs(2, 2, 8, 8, seed=6)
    pool = torch.zeros(4, 2, 8, 8)
    for states, slots in ((torch.zeros(4, 2, 8, 16), torch.tensor([0, 1])),  # other Dv
                          (pool, torch.tensor([1, 4])),  # a slot past the pool
                          (pool, torch.tensor([-1, 0])),
                          (pool, torch.tensor([0, 1, 2])),  # a slot per row, no more
                          (torch.zeros(1, 2, 8, 8), None)):  # fewer states than rows
        with pytest.raises(ValueError, match="mismatched shapes or slots"):
            native.one_token(kernel, x["q"], x["k"], x["v"], x["g"], x["beta"], states, states,
                             slots)
