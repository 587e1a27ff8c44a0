"""Fixtures of the cluster tests: the models the fault, cancel and failover scenarios run on."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module", params=["tiny", "hybrid"])
def fault_model(request: pytest.FixtureRequest) -> Path:
    """A scenario's model: the built-in tiny Qwen2-VL, and a transformers-written tiny Qwen3.5
    (hybrid: its leak check covers the linear-attention state slots of every node)."""
    return Path(request.getfixturevalue("tiny_dir" if request.param == "tiny" else "hf35_dir"))
