"""An EAGLE draft that does not fit its target is refused at load, naming every field that differs.

The draft mirrors the target's KV pool (KV heads, head size) and rotates by the target's mrope
sections. The oracle is the draft module itself, built on the meta device: a draft the check
accepts has the KV width and rotary axis split of the target, and each refused one really has a
different KV width or split.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.builtin.tiny_model import tiny_config_dict
from engine.config import ModelConfig, TextConfig
from engine.errors import ConfigError
from engine.models.eagle.draft import DraftConfig, EagleDraft, draft_config_dict
from engine.models.eagle.loader import load_draft

TARGET_RAW = tiny_config_dict()
TARGET = ModelConfig.from_dict(TARGET_RAW).text
LAYERS = TARGET.num_hidden_layers


def _draft_raw(**text_changes: Any) -> dict[str, Any]:
    raw = draft_config_dict(copy.deepcopy(TARGET_RAW["text_config"]), LAYERS)
    for key, value in text_changes.items():
        if key == "mrope_section":
            raw["text_config"]["rope_parameters"]["mrope_section"] = value
        else:
            raw["text_config"][key] = value
    return raw


def _kv_width_and_axes(text: TextConfig) -> tuple[int, list[int]]:
    """What a model of ``text``'s shape writes per token into its KV pool, and the axis each
    rotary frequency takes its position from (a draft layer built on the meta device)."""
    with torch.device("meta"):
        draft = EagleDraft(DraftConfig(text, LAYERS))
    axes = draft.rotary.axis_of.on(torch.device("cpu")).tolist()
    return draft.layer.self_attn.k_proj.out_features, axes


def test_a_fitting_draft_matches_the_target_pool_and_rotary() -> None:
    cfg = DraftConfig.from_dict(_draft_raw())
    cfg.check_target(TARGET)  # no error
    assert _kv_width_and_axes(cfg.text) == _kv_width_and_axes(TARGET)


MISFITS = [
    ({"num_key_value_heads": 1}, ["num_key_value_heads is 1 in the draft, 2 in the target"]),
    ({"num_attention_heads": 8, "mrope_section": [1, 1, 2]},
     ["head_dim is 8 in the draft, 16 in the target",
      "mrope_section is [1, 1, 2] in the draft, [2, 3, 3] in the target"]),
    ({"mrope_section": [3, 3, 2]},
     ["mrope_section is [3, 3, 2] in the draft, [2, 3, 3] in the target"]),
]


@pytest.mark.parametrize(("changes", "named"), MISFITS, ids=["kv_heads", "head_dim", "mrope"])
def test_a_misfit_draft_is_refused_at_load_naming_what_differs(
    tmp_path: Path, changes: dict[str, Any], named: list[str]
) -> None:
    raw = _draft_raw(**changes)
    cfg = DraftConfig.from_dict(raw)
    assert _kv_width_and_axes(cfg.text) != _kv_width_and_axes(TARGET)  # a real misfit
    (tmp_path / "config.json").write_text(json.dumps(raw))  # no weights: refused before them
    with pytest.raises(ConfigError, match="does not fit the target") as err:
        load_draft(tmp_path, TARGET, torch.float32)
    for part in named:
        assert part in str(err.value)
    assert str(err.value).count(" in the draft, ") == len(named)  # only what differs


def test_a_draft_for_another_target_depth_is_refused() -> None:
    raw = draft_config_dict(copy.deepcopy(TARGET_RAW["text_config"]), LAYERS + 1)
    with pytest.raises(ConfigError, match=f"target_num_hidden_layers\\) is {LAYERS + 1}"):
        DraftConfig.from_dict(raw).check_target(TARGET)
