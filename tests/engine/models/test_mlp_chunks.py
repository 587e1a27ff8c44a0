"""The decoder MLP over long prefill chunks (engine/models/qwen2_vl/model.py: ``Mlp``), which it
runs a few hundred rows at a time, against the MLP's formula in plain torch over all rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.builtin.tiny_model import tiny_config_dict
from engine.config import ModelConfig
from engine.models.qwen2_vl.model import MLP_CHUNK_ROWS, MLP_WHOLE_ROWS, Mlp
from engine.parallel.group import SINGLE
from engine.parallel.shard import TextShard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, MLP_WHOLE_ROWS, MLP_WHOLE_ROWS + 1, 3 * MLP_CHUNK_ROWS + 7])
def test_mlp_equals_the_formula_at_every_length(dtype: torch.dtype, rows: int) -> None:
    cfg = ModelConfig.from_dict(tiny_config_dict()).text
    torch.manual_seed(rows)
    mlp = Mlp(cfg, TextShard.of(cfg), SINGLE).to(dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    gate, up, down = (p.weight.detach().clone() for p in (mlp.gate_proj, mlp.up_proj,
                                                          mlp.down_proj))
    mlp.fuse()
    x = torch.randn(rows, cfg.hidden_size).to(dtype)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    got = mlp.forward(x)
    assert got.shape == want.shape and got.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    # a chunked forward gives each row what the whole product gives it
    torch.testing.assert_close(got, mlp._rows(x), **tol)
