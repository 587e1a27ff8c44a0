"""``EngineConfig`` refuses settings no engine can run, naming the field: before, a page size of
0 divided by zero at start-up, ``num_pages=0`` silently meant "from the budget" and a negative
one reached the KV pool as one page more."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError


@pytest.mark.parametrize("kw", [
    {"page_size": 0}, {"num_pages": 0}, {"num_pages": -5}, {"kv_budget_bytes": -1},
    {"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_model_len": 0}, {"tp_size": 0},
    {"max_num_seqs": True}, {"page_size": 16.0},
])
def test_non_positive_sizes_are_refused(kw: dict[str, Any]) -> None:
    ((name, value),) = kw.items()
    with pytest.raises(ConfigError, match=rf"^EngineConfig\.{name} must be a positive int, "
                                          rf"got {value!r}$"):
        EngineConfig(**kw)


def test_lookahead_may_be_zero_not_negative() -> None:
    assert EngineConfig(lookahead_tokens=0).lookahead_tokens == 0
    with pytest.raises(ConfigError, match="lookahead_tokens must be at least 0, got -1"):
        EngineConfig(lookahead_tokens=-1)


def test_unset_optional_sizes_are_fine() -> None:
    config = EngineConfig(num_pages=None, max_model_len=None)
    assert config.num_pages is None and config.max_model_len is None
