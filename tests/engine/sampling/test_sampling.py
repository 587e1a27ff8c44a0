"""Sampler: greedy, filters, seeds, empirical distribution, logprobs; SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import SamplingParams
from engine.errors import InvalidRequestError
from engine.sampling import sampler as sampling
from engine.sampling.sampler import Sampler, make_generator

V = 64


def _logits(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=gen) * 3.0  # [n, V]


def test_greedy_equals_argmax_and_logprobs_are_log_softmax() -> None:
    logits = _logits(8)
    tokens, lps = Sampler().sample(logits, [SamplingParams()] * 8, [None] * 8)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)[torch.arange(8), torch.tensor(tokens)]
    assert lps == pytest.approx(expected.tolist(), abs=1e-6)


def test_all_greedy_batch_draws_nothing_and_loops_no_row(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"argmax": 0, "multinomial": 0}
    real_argmax, real_multi = torch.argmax, torch.multinomial

    def argmax(*a, **k):  # type: ignore[no-untyped-def]
        calls["argmax"] += 1
        return real_argmax(*a, **k)

    def multinomial(*a, **k):  # type: ignore[no-untyped-def]
        calls["multinomial"] += 1
        return real_multi(*a, **k)

    monkeypatch.setattr(torch, "argmax", argmax)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    Sampler().sample(_logits(32), [SamplingParams()] * 32, [None] * 32)
    assert calls["multinomial"] == 0 and calls["argmax"] <= 1  # CPU: the argmax is numpy's


def _bits(values: list[float]) -> list[int]:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


@pytest.mark.parametrize("ties", [False, True])
def test_host_pick_equals_device_pick_bit_for_bit(ties: bool) -> None:
    """The CPU path (numpy argmax and log-probability pick) returns exactly what the one-copy
    path every other device takes returns, ties and NaN rows included."""
    logits = _logits(12, seed=4)
    if ties:
        logits = logits.round()  # many equal maxima: both must take the first
        logits[3, 7] = math.nan
        logits[5, :] = math.nan
        logits[6, 9] = math.inf
    logprobs = torch.log_softmax(logits, -1)
    rows = torch.tensor([1, 4, 10])
    for picked in (None, (rows, torch.tensor([0, V - 1, 5]))):
        host = sampling._pick_on_host(logits, logprobs, picked)
        device = sampling._pick_on_device(logits, logprobs, picked)
        assert host[0] == device[0]
        assert _bits(host[1]) == _bits(device[1])


def test_empty_batch_and_length_mismatch() -> None:
    assert Sampler().sample(torch.empty(0, V), [], []) == ([], [])
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), [SamplingParams()], [None, None])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6),
     SamplingParams(temperature=0.7, top_k=5, top_p=1e-9)],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(16, seed=3)
    gens = [make_generator(i) for i in range(16)]
    tokens, lps = Sampler().sample(logits, [params] * 16, gens)
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert lps == pytest.approx(expected.tolist(), abs=1e-6)


def test_top_k_only_picks_from_k_largest() -> None:
    logits = _logits(1, seed=5).expand(500, V).contiguous()
    top5 = set(logits[0].topk(5).indices.tolist())
    torch.manual_seed(0)
    tokens, _ = Sampler().sample(logits, [SamplingParams(temperature=5.0, top_k=5)] * 500,
                                 [None] * 500)
    assert set(tokens) <= top5 and len(set(tokens)) > 1


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4).contiguous()
    torch.manual_seed(0)
    # 0.5 + 0.3 = 0.8 >= 0.8: the nucleus is exactly {0, 1}
    tokens, _ = Sampler().sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 2000,
                                 [None] * 2000)
    assert set(tokens) == {0, 1}
    freq0 = tokens.count(0) / len(tokens)
    assert abs(freq0 - 0.5 / 0.8) < 0.05


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    logits = _logits(6, seed=11)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=s) for s in range(6)]
    sampler = Sampler()
    first, _ = sampler.sample(logits, params, [make_generator(p.seed) for p in params])
    again, _ = sampler.sample(logits, params, [make_generator(p.seed) for p in params])
    assert first == again
    # row 3 alone, and row 3 inside a different batch (other rows greedy / unseeded)
    alone, _ = sampler.sample(logits[3:4], [params[3]], [make_generator(3)])
    mixed_logits = torch.cat([_logits(2, seed=99), logits[3:4], _logits(2, seed=7)])
    mixed_params = [SamplingParams(), SamplingParams(temperature=0.5), params[3],
                    SamplingParams(temperature=2.0, top_k=3), SamplingParams()]
    mixed, _ = sampler.sample(mixed_logits, mixed_params,
                              [None, None, make_generator(3), None, None])
    assert alone == [first[3]] and mixed[2] == first[3]


def test_make_generator() -> None:
    assert make_generator(None) is None
    a, b = make_generator(123), make_generator(123)
    assert a is not None and b is not None
    assert torch.rand(3, generator=a).tolist() == torch.rand(3, generator=b).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20_000
    torch.manual_seed(1234)
    params = [SamplingParams(temperature=temperature)] * n
    tokens, _ = Sampler().sample(base.expand(n, 5).contiguous(), params, [None] * n)
    expected = torch.softmax(base / temperature, -1) * n
    observed = torch.bincount(torch.tensor(tokens), minlength=5).float()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 4 degrees of freedom: p ~ 0.0004


def test_seeded_single_row_distribution_matches_softmax() -> None:
    base = torch.tensor([[1.0, 0.0, -0.5]])
    gen = make_generator(7)
    counts = [0, 0, 0]
    for _ in range(3000):
        (tok,), _ = Sampler().sample(base, [SamplingParams(temperature=1.0)], [gen])
        counts[tok] += 1
    expected = (torch.softmax(base[0], -1) * 3000).tolist()
    chi2 = sum((o - e) ** 2 / e for o, e in zip(counts, expected, strict=True))
    assert chi2 < 16.0  # 2 degrees of freedom


@settings(max_examples=40, deadline=None)
@given(
    temperature=st.floats(0.05, 5.0), top_k=st.integers(0, 80), top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**63 - 1),
)
def test_logprob_is_of_chosen_token_under_raw_logits(
    temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    logits = _logits(3, seed=seed % 1000)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)] * 3
    tokens, lps = Sampler().sample(logits, params, [make_generator(seed)] * 3)
    full = torch.log_softmax(logits, -1)
    for row, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert 0 <= tok < V
        assert lp == pytest.approx(full[row, tok].item(), abs=1e-5)
        if top_k:
            assert tok in logits[row].topk(min(top_k, V)).indices.tolist()


# ---- SamplingParams.validate ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1_000_001}, "max_new_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (100,)}, "vocabulary"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs).validate(vocab_size=100)  # type: ignore[arg-type]


def test_valid_sampling_params() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=100.0, top_p=1.0, top_k=5, max_new_tokens=1_000_000,
                   stop_token_ids=(0, 99), seed=2**63 - 1).validate(vocab_size=100)
