"""The sampler's draw (:func:`engine.sampling.sampler.inverse_cdf`): one uniform per row placed
on the row's cumulative weights. Frequencies match the distribution (against
``torch.multinomial``'s own, on the same rows), zero-weight tokens are never drawn, rows need
not be normalised, the extreme uniforms land on the first and last drawable tokens, and rows
past one float64 block (``CDF_ROWS``) are drawn like the first."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.sampler import CDF_ROWS, inverse_cdf

VOCAB = 151_936  # Qwen's vocabulary


def test_frequencies_follow_the_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.1, 0.0, 0.6, 0.25, 0.05]) * 3  # unnormalised on purpose
    n = 200_000
    u = torch.rand(n, dtype=torch.float64, generator=gen)
    drawn = inverse_cdf(weights.expand(n, -1), u)
    freq = torch.bincount(drawn, minlength=5).double() / n
    expected = (weights / weights.sum()).double()
    sigma = (expected * (1 - expected) / n).sqrt()
    assert freq[1] == 0  # weight 0: never
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-12), (freq, expected)
    # the same rows through torch.multinomial land within the same bounds
    ref = torch.multinomial(weights, n, replacement=True, generator=gen)
    ref_freq = torch.bincount(ref, minlength=5).double() / n
    assert torch.all((ref_freq - freq).abs() <= 7 * sigma + 1e-12)


def test_a_vocabulary_sized_row_draws_its_rare_tail() -> None:
    """A row of 151,936 tokens whose last 1,000 hold 1% of the mass: drawn about 1% of the
    time."""
    probs = torch.full((VOCAB,), 0.99 / (VOCAB - 1000))
    probs[-1000:] = 0.01 / 1000
    n = 20_000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    drawn = torch.cat([inverse_cdf(probs.expand(1000, -1), chunk) for chunk in u.split(1000)])
    tail = float((drawn >= VOCAB - 1000).double().mean())
    assert abs(tail - 0.01) <= 5 * (0.01 * 0.99 / n) ** 0.5


@pytest.mark.parametrize("rows", [1, CDF_ROWS, CDF_ROWS + 3])
def test_extreme_uniforms_and_rows_past_one_block(rows: int) -> None:
    probs = torch.zeros(rows, 6)
    probs[:, 2] = 0.5
    probs[:, 4] = 0.5  # tokens 0, 1, 3 and 5 weigh nothing
    low = inverse_cdf(probs, torch.zeros(rows, dtype=torch.float64))
    high = inverse_cdf(probs, torch.full((rows,), 1 - 2**-53, dtype=torch.float64))
    assert low.tolist() == [2] * rows and high.tolist() == [4] * rows
    per_row = torch.linspace(0, 0.999, rows, dtype=torch.float64)
    assert inverse_cdf(probs, per_row).tolist() == [2 if x < 0.5 else 4 for x in per_row]
