"""The linear-attention kernels' torch reference against transformers' own Qwen3.5 functions.

transformers runs one sequence at a time: ``causal_conv1d_fn`` (zero left padding) or
``causal_conv1d_update`` (a cached state) for the conv, ``torch_chunk_gated_delta_rule`` for
several tokens and ``torch_recurrent_gated_delta_rule`` for one cached token. Our kernels run a
flat batch mixing fresh prefills, continued chunks and decode rows, each on its own state slot,
so every check builds the batch, runs it once, and compares each sequence with transformers run
on that sequence alone: outputs, the slot's state afterwards, and every other slot untouched.
The CUDA libraries' adapters run here on stand-ins that do what the libraries document, so
their plumbing (rows, slots, state layouts, keywords) is checked without a GPU.
The transformers functions are called through ``__wrapped__``, their torch bodies, so an
installed fla or causal-conv1d cannot stand in for them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.attention.linear import native
from engine.attention.linear.conv import causal_conv1d
from engine.attention.linear.delta_rule import _normalised, _step, gated_delta_rule
from engine.attention.linear.libraries import FlaGatedDeltaRule, LibraryCausalConv1d
from engine.attention.linear.norm import gated_rms_norm
from engine.attention.linear.select import TORCH_KERNELS, linear_kernels


def _torch_body(fn: Callable[..., Any]) -> Callable[..., Any]:
    wrapped: Callable[..., Any] = getattr(fn, "__wrapped__", fn)
    return wrapped


HF_CONV_FN = _torch_body(hf.causal_conv1d_fn)
HF_CONV_UPDATE = _torch_body(hf.causal_conv1d_update)
HF_CHUNK = _torch_body(hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = _torch_body(hf.torch_recurrent_gated_delta_rule)

C, K = 12, 4  # conv channels and taps
HK, HV, DK, DV = 2, 4, 8, 6  # key heads, value heads (two per key head), head dims
NUM_SLOTS = 10
ATOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# ---- the conv --------------------------------------------------------------------------------


def _hf_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' conv of one sequence ``x`` ``[n, C]`` after ``state`` ``[C, K - 1]`` (None:
    a fresh sequence): the output ``[n, C]`` and the last ``K - 1`` inputs."""
    n = x.shape[0]
    seq = x.T.unsqueeze(0)  # [1, C, n]
    if state is None:
        out = HF_CONV_FN(seq, weight, bias, activation="silu")
        full = torch.cat([torch.zeros(1, C, K - 1), seq], dim=-1)
    elif n == 1:
        cache = state.unsqueeze(0).clone()
        out = HF_CONV_UPDATE(seq, cache, weight, bias, activation="silu")
        full = torch.cat([state.unsqueeze(0), seq], dim=-1)
    else:  # a continued chunk: the cached inputs are prepended, their outputs dropped
        full = torch.cat([state.unsqueeze(0), seq], dim=-1)
        out = HF_CONV_FN(full, weight, bias, activation="silu")[:, :, -n:]
    return out[0].T, full[0, :, -(K - 1):]


@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_mixed_batch_matches_transformers(with_bias: bool) -> None:
    """A fresh 70-token prefill, a continued 5-token chunk, two decode rows with old states and a
    2-token chunk (shorter than K - 1) on slots out of order; other slots stay as they were."""
    gen = _gen(0)
    lengths, slots = [70, 1, 5, 1, 2], [7, 2, 0, 9, 4]
    fresh = {7}
    x = torch.randn(sum(lengths), C, generator=gen)
    weight = torch.randn(C, K, generator=gen)
    bias = torch.randn(C, generator=gen) if with_bias else None
    conv_state = torch.randn(NUM_SLOTS, C, K - 1, generator=gen)
    conv_state[7] = 0  # a fresh slot is zeroed at admission
    before = conv_state.clone()
    starts = _offsets(lengths)
    out = causal_conv1d(x, weight, bias, starts, conv_state, torch.tensor(slots))
    for b, slot in enumerate(slots):
        rows = slice(starts[b], starts[b + 1])
        want, state = _hf_conv(x[rows], weight, bias, None if slot in fresh else before[slot])
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=0)
        torch.testing.assert_close(conv_state[slot], state, atol=0, rtol=0)
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(conv_state[others], before[others])


def test_conv_chunks_equal_one_call() -> None:
    """A prompt in chunks of 17 + 50 + 2 + 1 tokens, then a decode row, equals the whole prompt
    at once; the chunk of 2 is shorter than K - 1, so the state keeps part of the earlier one."""
    gen = _gen(1)
    x = torch.randn(71, C, generator=gen)
    weight, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    whole = torch.zeros(NUM_SLOTS, C, K - 1)
    want = causal_conv1d(x, weight, bias, [0, 71], whole, torch.tensor([3]))
    pieces = torch.zeros(NUM_SLOTS, C, K - 1)
    got, start = [], 0
    for n in (17, 50, 2, 1, 1):
        got.append(causal_conv1d(x[start:start + n], weight, bias, [0, n], pieces,
                                 torch.tensor([3])))
        start += n
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces, whole, atol=0, rtol=0)
    torch.testing.assert_close(whole[3], x[-(K - 1):].T, atol=0, rtol=0)


def test_conv_keeps_dtype_and_skips_empty_sequences() -> None:
    gen = _gen(2)
    x = torch.randn(3, C, generator=gen).to(torch.bfloat16)
    weight = torch.randn(C, K, generator=gen).to(torch.bfloat16)
    conv_state = torch.randn(NUM_SLOTS, C, K - 1, generator=gen).to(torch.bfloat16)
    before = conv_state.clone()
    out = causal_conv1d(x, weight, None, [0, 0, 3, 3], conv_state, torch.tensor([1, 5, 6]))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(conv_state[[1, 6]], before[[1, 6]])  # no tokens, no change
    want, state = _hf_conv(x, weight, None, before[5])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(conv_state[5], state, atol=0, rtol=0)


def test_conv_refuses_bad_offsets_and_activations() -> None:
    x, weight = torch.zeros(4, C), torch.zeros(C, K)
    state, slots = torch.zeros(NUM_SLOTS, C, K - 1), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="not from 0 to 4"):
        causal_conv1d(x, weight, None, [0, 1, 3], state, slots)
    with pytest.raises(ValueError, match="one more offset"):
        causal_conv1d(x, weight, None, [0, 4], state, slots)
    with pytest.raises(ValueError, match="decrease"):
        causal_conv1d(x, weight, None, [0, 5, 4], state, slots)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, None, [0, 1, 4], state, slots, activation="gelu")


# ---- the gated delta rule ----------------------------------------------------------------------


def _rule_inputs(num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    gen = _gen(seed)
    return {
        "q": torch.randn(num_tokens, HK, DK, generator=gen),
        "k": torch.randn(num_tokens, HK, DK, generator=gen),
        "v": torch.randn(num_tokens, HV, DV, generator=gen),
        # log decays as Qwen3.5 makes them: -exp(A_log) * softplus(a + dt_bias) < 0
        "g": -torch.rand(HV, generator=gen).mul(4).exp()
        * torch.nn.functional.softplus(torch.randn(num_tokens, HV, generator=gen)),
        "beta": torch.rand(num_tokens, HV, generator=gen),
    }


def _hf_rule(inputs: dict[str, torch.Tensor], rows: slice, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rule over ``rows`` of ``inputs`` from ``state`` (None: fresh), choosing the
    function as its Qwen3.5 layer does: recurrent for one cached token, chunked otherwise."""
    q, k, v, g, beta = (inputs[name][rows].unsqueeze(0) for name in ("q", "k", "v", "g", "beta"))
    fn = HF_RECURRENT if state is not None and rows.stop - rows.start == 1 else HF_CHUNK
    out, final = fn(q, k, v, g=g, beta=beta,
                    initial_state=None if state is None else state.unsqueeze(0),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def _pool(seed: int) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, HV, DK, DV, generator=_gen(seed)) * 0.3


def test_rule_mixed_batch_matches_transformers() -> None:
    """A fresh 3-token prefill, two decode rows with old states, a fresh 70-token prefill (two
    chunks of 64), a 5-token chunk and a 130-token chunk (three chunks) continuing old states, on
    slots out of order and not contiguous, with two value heads per key head; other slots stay
    as they were."""
    lengths, slots = [3, 1, 70, 1, 5, 130], [0, 1, 6, 3, 8, 9]
    fresh = {6, 0}
    inputs = _rule_inputs(sum(lengths), seed=3)
    state = _pool(4)
    state[sorted(fresh)] = 0
    before = state.clone()
    starts = _offsets(lengths)
    out = gated_delta_rule(**inputs, q_starts=starts, state=state, slots=torch.tensor(slots))
    assert out.shape == inputs["v"].shape and out.dtype == torch.float32
    for b, slot in enumerate(slots):
        rows = slice(starts[b], starts[b + 1])
        want, final = _hf_rule(inputs, rows, None if slot in fresh else before[slot])
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=0)
        torch.testing.assert_close(state[slot], final, atol=ATOL, rtol=0)
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("step", ["native", "torch"])
@pytest.mark.parametrize("slots", [
    [4, 5, 6, 7],  # one run in batch order: the pool stepped in place, nothing indexed
    [7, 2, 3, 9, 0, 8],  # runs 0 | 2-3 | 7-8-9, out of batch order
    [9, 1, 5],  # no two slots adjacent
])
def test_decode_rows_step_the_pool_in_place_as_on_gathered_states(
        slots: list[int], step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of decode rows updates its slots where they are (the native step by slot, the
    torch ops in runs of consecutive slots): the outputs and states are bit for bit the
    one-token step on gathered copies, and within the tolerance transformers' recurrent step;
    other slots stay as they were."""
    if step == "torch":
        monkeypatch.setattr(native, "one_token_kernel", lambda: None)
    else:
        assert native.one_token_kernel() is not None, native.unavailable_reason()
    n = len(slots)
    inputs = _rule_inputs(n, seed=11)
    state = _pool(12)
    before = state.clone()
    index = torch.tensor(slots)
    out = gated_delta_rule(**inputs, q_starts=list(range(n + 1)), state=state, slots=index)
    q, k = _normalised(inputs["q"], inputs["k"], HV)
    want, states = _step(q, k, inputs["v"], inputs["g"], inputs["beta"], before[index])
    assert torch.equal(out, want) and torch.equal(state[index], states)
    for b, slot in enumerate(slots):
        hf_out, final = _hf_rule(inputs, slice(b, b + 1), before[slot])
        torch.testing.assert_close(out[b:b + 1], hf_out, atol=ATOL, rtol=0)
        torch.testing.assert_close(state[slot], final, atol=ATOL, rtol=0)
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(state[others], before[others])


def test_rule_chunks_equal_one_call() -> None:
    """A prompt in chunks of 17 + 50 + 3 tokens, then two decode rows, equals the whole prompt
    and the decode rows run on one state: outputs and final states."""
    inputs = _rule_inputs(72, seed=5)
    whole = torch.zeros(NUM_SLOTS, HV, DK, DV)
    slot = torch.tensor([5])
    want = torch.cat([
        gated_delta_rule(**{n: t[:70] for n, t in inputs.items()}, q_starts=[0, 70],
                         state=whole, slots=slot),
        *(gated_delta_rule(**{n: t[i:i + 1] for n, t in inputs.items()}, q_starts=[0, 1],
                           state=whole, slots=slot) for i in (70, 71)),
    ])
    pieces = torch.zeros(NUM_SLOTS, HV, DK, DV)
    got, start = [], 0
    for n in (17, 50, 3, 1, 1):
        got.append(gated_delta_rule(**{name: t[start:start + n] for name, t in inputs.items()},
                                    q_starts=[0, n], state=pieces, slots=slot))
        start += n
    torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces, whole, atol=ATOL, rtol=0)
    hf_out, hf_state = _hf_rule(inputs, slice(0, 70), None)
    torch.testing.assert_close(want[:70], hf_out, atol=ATOL, rtol=0)
    assert not torch.equal(whole[5], hf_state)  # the two decode rows moved it on


def test_rule_in_bfloat16_keeps_the_value_dtype() -> None:
    inputs = _rule_inputs(9, seed=6)
    low = {n: (t if n == "g" else t.to(torch.bfloat16)) for n, t in inputs.items()}
    state = torch.zeros(NUM_SLOTS, HV, DK, DV)
    out = gated_delta_rule(**low, q_starts=[0, 8, 9], state=state, slots=torch.tensor([2, 4]))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    want, _ = _hf_rule(low, slice(0, 8), None)
    torch.testing.assert_close(out[:8], want, atol=1e-2, rtol=1e-2)


def test_rule_refuses_heads_that_do_not_split() -> None:
    inputs = _rule_inputs(2, seed=7)
    inputs["q"] = inputs["k"] = torch.ones(2, 3, DK)  # 3 key heads for 4 value heads
    with pytest.raises(ValueError, match="do not split"):
        gated_delta_rule(**inputs, q_starts=[0, 2], state=_pool(0), slots=torch.tensor([0]))


# ---- the gated norm and the kernels' choice ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    gen = _gen(8)
    x, gate = (torch.randn(5, 3, DV, generator=gen).to(dtype) for _ in range(2))
    norm = hf.Qwen3_5RMSNormGated(DV, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen))
        want = norm(x, gate)
    got = gated_rms_norm(x, gate, norm.weight.detach(), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_cpu_gets_the_torch_reference() -> None:
    kernels = linear_kernels(torch.device("cpu"))
    assert kernels is TORCH_KERNELS
    assert kernels.conv is causal_conv1d and kernels.delta_rule is gated_delta_rule
    assert (kernels.conv_from, kernels.delta_rule_from) == ("torch", "torch")


# ---- the CUDA libraries' adapters, on stand-ins ------------------------------------------------


def _fake_fla() -> ModuleType:
    """``fla.ops.gated_delta_rule`` as documented, on transformers' torch functions: batches of
    ``[B, T, H, ...]``, or one varlen row of sequences with ``cu_seqlens``; states
    ``[N, Hv, Dk, Dv]``."""

    def run(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, **flags: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
        assert flags == {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
        assert scale == q.shape[-1] ** -0.5 and initial_state.dtype == torch.float32
        if cu_seqlens is None:
            return fn(q, k, v, g=g, beta=beta, initial_state=initial_state, **flags)
        bounds = cu_seqlens.tolist()
        pieces = [fn(*(t[:, a:b] for t in (q, k, v)), g=g[:, a:b], beta=beta[:, a:b],
                     initial_state=initial_state[n:n + 1], **flags)
                  for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        return torch.cat([o for o, _ in pieces], 1), torch.cat([s for _, s in pieces])

    ops = ModuleType("fake_fla")
    ops.chunk_gated_delta_rule = lambda **kw: run(HF_CHUNK, **kw)  # type: ignore[attr-defined]
    ops.fused_recurrent_gated_delta_rule = (  # type: ignore[attr-defined]
        lambda **kw: run(HF_RECURRENT, **kw))
    return ops


def _fake_causal_conv1d() -> ModuleType:
    """``causal_conv1d`` as documented: ``causal_conv1d_update`` writes the states of
    ``conv_state_indices`` (int32) in place; ``causal_conv1d_fn`` takes channel-last
    ``initial_states`` and fills channel-last ``final_states_out``."""

    def conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None) -> torch.Tensor:
        y = F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0])
        return F.silu(y) if activation == "silu" else y

    def update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, activation: str | None,
               conv_state_indices: torch.Tensor) -> torch.Tensor:
        assert conv_state_indices.dtype == torch.int32 and x.dim() == 2
        index = conv_state_indices.long()
        window = torch.cat([conv_state[index], x.unsqueeze(-1)], dim=-1)
        conv_state[index] = window[:, :, 1:]
        return conv(window, weight, bias, activation)[:, :, 0]

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           initial_states: torch.Tensor, return_final_states: bool,
           final_states_out: torch.Tensor, activation: str | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.stride(1) == initial_states.stride(1) == final_states_out.stride(1) == 1
        assert return_final_states
        window = torch.cat([initial_states, x], dim=-1)
        final_states_out.copy_(window[:, :, x.shape[-1]:])
        return conv(window, weight, bias, activation), final_states_out

    lib = ModuleType("fake_causal_conv1d")
    lib.causal_conv1d_update = update  # type: ignore[attr-defined]
    lib.causal_conv1d_fn = fn  # type: ignore[attr-defined]
    return lib


def test_the_fla_adapter_matches_the_reference() -> None:
    lengths, slots = [3, 1, 70, 1, 5], [0, 1, 6, 3, 8]
    inputs = _rule_inputs(sum(lengths), seed=9)
    state, starts = _pool(10), _offsets(lengths)
    ours = state.clone()
    want = gated_delta_rule(**inputs, q_starts=starts, state=ours, slots=torch.tensor(slots))
    got = FlaGatedDeltaRule(_fake_fla())(**inputs, q_starts=starts, state=state,
                                         slots=torch.tensor(slots))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(state, ours, atol=ATOL, rtol=0)


def test_the_causal_conv1d_adapter_matches_the_reference() -> None:
    gen = _gen(11)
    lengths, slots = [70, 1, 2, 1], [7, 2, 0, 9]
    channels = 16  # the library takes channels in multiples of 8
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight, bias = torch.randn(channels, K, generator=gen), torch.randn(channels, generator=gen)
    conv_state = torch.randn(NUM_SLOTS, channels, K - 1, generator=gen)
    ours, starts = conv_state.clone(), _offsets(lengths)
    want = causal_conv1d(x, weight, bias, starts, ours, torch.tensor(slots))
    got = LibraryCausalConv1d(_fake_causal_conv1d())(x, weight, bias, starts, conv_state,
                                                     torch.tensor(slots))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(conv_state, ours, atol=0, rtol=0)
