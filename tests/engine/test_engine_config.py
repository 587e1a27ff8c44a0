"""``EngineConfig`` refuses settings no engine can run, naming the field: before, a page size of
0 divided by zero at start-up, ``num_pages=0`` silently meant "from the budget" and a negative
one reached the KV pool as one page more."""

from __future__ import annotations

from typing import Any

import pytest

from cli.engine_args import engine_config
from cli.main import build_parser
from engine.config import REPLAY, VERIFY_STATES, EngineConfig
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


def test_verify_states_are_one_of_the_modes() -> None:
    assert all(EngineConfig(verify_states=mode).verify_states == mode for mode in VERIFY_STATES)
    with pytest.raises(ConfigError, match=r"^EngineConfig\.verify_states must be one of rows, "
                                          r"replay, got 'all'$"):
        EngineConfig(verify_states="all")  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [["generate", "hi"], ["prefill"], ["decode"]])
def test_the_verify_states_flag_reaches_the_config(command: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``--verify-states`` on every command that builds an engine: the default is the
    config's, a mode reaches it, any other value is refused by the parser."""
    parser = build_parser()
    default = parser.parse_args([*command, "--device", "cpu"])
    assert engine_config(default).verify_states == EngineConfig().verify_states
    chosen = parser.parse_args([*command, "--device", "cpu", "--verify-states", REPLAY])
    assert engine_config(chosen).verify_states == REPLAY
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--verify-states", "all"])
    assert "argument --verify-states: invalid choice: 'all'" in capsys.readouterr().err
