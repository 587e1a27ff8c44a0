"""EAGLE-3 drafts in the SpecForge / SGLang layout load into pdserve's EAGLE-3 draft.

The oracle is pdserve's own layout: the same tensors written there (``midlayer.`` as
``layers.0.``, zero q/k/v biases, no ``t2d`` and no embedding) must give the same config, the
same weights, the same features and the same logits bit for bit, and EAGLE decoding with the
foreign-layout draft must equal plain greedy decoding. Drafts that do not fit the target are
refused, naming what differs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_draft_layouts import forward_twice, realigned

from decode_node.spec.eagle_engine import EagleEngine
from engine.builtin.tiny_model import random_vocab_map, tiny_config_dict, write_tiny_model
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import CheckpointError, ConfigError
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.draft import Eagle3Spec, draft_config_dict
from engine.models.eagle.eagle3 import Eagle3Draft
from engine.models.eagle.eagle3_layout import eagle3_config
from engine.models.eagle.layouts import eagle_layout
from engine.models.eagle.loader import load_draft

TARGET_RAW = tiny_config_dict()
TEXT = TARGET_RAW["text_config"]
TARGET = ModelConfig.from_dict(TARGET_RAW).text
DRAFT_VOCAB = 96
LAYER_IDS = [1, 0, 1]

# config.json of a SpecForge EAGLE-3 draft for the tiny target, keys as SpecForge writes them
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
    "target_model_type": "qwen2_vl",
    "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 1,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 512, "draft_vocab_size": DRAFT_VOCAB,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS, "use_aux_hidden_state": True},
}


def spec_config(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE_CONFIG), **changes}


def spec_tensors(config: dict[str, Any], seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors under SpecForge's names, ``d2t``, ``t2d`` and ``embed_tokens`` included."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    vocab, small = config["vocab_size"], config["draft_vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, h), "fc.weight": (h, 3 * h),
        f"{attn}q_proj.weight": (q, 2 * h), f"{attn}k_proj.weight": (kv, 2 * h),
        f"{attn}v_proj.weight": (kv, 2 * h), f"{attn}o_proj.weight": (h, q),
        f"{mlp}gate_proj.weight": (inter, h), f"{mlp}up_proj.weight": (inter, h),
        f"{mlp}down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,), "lm_head.weight": (small, h),
    }
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        base = 1.0 if len(shape) == 1 else 0.0
        out[name] = base + (0.1 if len(shape) == 1 else 0.05) * torch.randn(shape, generator=gen)
    d2t = random_vocab_map(vocab, small, seed)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(small) + d2t] = True
    return {**out, "d2t": d2t, "t2d": t2d}


def write_spec_draft(path: Path, config: dict[str, Any],
                     tensors: dict[str, torch.Tensor] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tensors = spec_tensors(config) if tensors is None else tensors
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_pdserve_twin(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The same draft in pdserve's own layout."""
    raw = draft_config_dict(copy.deepcopy(TEXT), TARGET.num_hidden_layers,
                            eagle3=Eagle3Spec((1, 0, 1), DRAFT_VOCAB))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()
             if k not in ("embed_tokens.weight", "t2d")}
    for proj in ("q_proj", "k_proj", "v_proj"):
        rows = state[f"layers.0.self_attn.{proj}.weight"].shape[0]
        state[f"layers.0.self_attn.{proj}.bias"] = torch.zeros(rows)
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_the_specforge_layout_loads_as_its_pdserve_twin(tmp_path: Path) -> None:
    tensors = spec_tensors(BASE_CONFIG)
    foreign = load_draft(write_spec_draft(tmp_path / "spec", BASE_CONFIG, tensors), TARGET,
                         torch.float32)
    twin = load_draft(write_pdserve_twin(tmp_path / "twin", tensors), TARGET, torch.float32)
    assert isinstance(foreign, Eagle3Draft) and isinstance(twin, Eagle3Draft)
    assert foreign.cfg == twin.cfg
    assert foreign.cfg.eagle3 == Eagle3Spec((1, 0, 1), DRAFT_VOCAB)
    mine, theirs = foreign.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(foreign.d2t, tensors["d2t"])
    feats = forward_twice(realigned(foreign))
    assert torch.equal(feats, forward_twice(realigned(twin)))
    aux = torch.randn(4, 3 * 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(foreign.target_feature(aux[:, :64], aux), twin.target_feature(aux[:, :64],
                                                                                     aux))
    logits = foreign.logits(feats, None)  # type: ignore[arg-type]  # not read by EAGLE-3
    assert torch.equal(logits, twin.logits(feats, None))  # type: ignore[arg-type]


def test_layer_ids_at_the_top_level_and_the_default(tmp_path: Path) -> None:
    top = spec_config(eagle_aux_hidden_state_layer_ids=[0, 1, 0])
    del top["eagle_config"]
    draft = load_draft(write_spec_draft(tmp_path / "top", top), TARGET, torch.float32)
    assert draft.cfg.aux_layer_ids == (0, 1, 0)
    deep = replace(TARGET, num_hidden_layers=32)
    assert Eagle3Spec.default_layer_ids(32) == (1, 15, 28)
    bare = spec_config()
    del bare["eagle_config"]
    text = eagle_layout(bare, deep, "bare").draft.text
    assert eagle3_config(bare, text, deep, "bare").aux_layer_ids == (1, 15, 28)


def test_greedy_eagle_with_a_specforge_draft_equals_plain_decoding(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "model")
    draft_dir = write_spec_draft(tmp_path / "spec", BASE_CONFIG)
    prompts = [Prompt(token_ids=list(range(1, 30))), Prompt(token_ids=[7, 8, 9])]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=128, page_size=8)).generate(prompts,
                                                                                   params)
    for topk, steps in ((1, None), (2, 3)):
        engine = LLMEngine(model_dir, EngineConfig(num_pages=128, page_size=8,
                                                   lookahead_tokens=5,
                                                   max_num_batched_tokens=24))
        draft = load_draft(draft_dir, engine.model_config.text, torch.float32)
        spec = EagleEngine(engine, draft, 3, topk, steps)
        assert [g.token_ids for g in spec.generate(prompts, params)] == [
            p.token_ids for p in plain]
        spec.engine.scheduler.check_no_leaks()


MISFITS = [
    ({"hidden_size": 32}, ["hidden_size is 32 in the draft, 64 in the target"]),
    ({"num_key_value_heads": 1}, ["num_key_value_heads is 1 in the draft, 2 in the target"]),
    ({"vocab_size": 1000}, ["vocab_size is 1000 in the draft, 512 in the target"]),
    ({"draft_vocab_size": 600}, ["draft_vocab_size is 600 in the draft, more than the "
                                 "target's vocab_size 512"]),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
     ["eagle_aux_hidden_state_layer_ids is [0, 1, 2] in the draft, but the target's layers "
      "are 0..1"]),
]


@pytest.mark.parametrize(("changes", "named"), MISFITS,
                         ids=["hidden", "kv_heads", "vocab", "draft_vocab", "layer_ids"])
def test_a_misfit_eagle3_draft_is_refused_naming_what_differs(
        tmp_path: Path, changes: dict[str, Any], named: list[str]) -> None:
    tmp_path.joinpath("config.json").write_text(json.dumps(spec_config(**changes)))
    with pytest.raises(ConfigError, match="does not fit the target") as err:
        load_draft(tmp_path, TARGET, torch.float32)  # no weights: refused before them
    for part in named:
        assert part in str(err.value)


def test_the_default_layer_ids_of_a_shallow_target_are_refused(tmp_path: Path) -> None:
    bare = spec_config()
    del bare["eagle_config"]
    tmp_path.joinpath("config.json").write_text(json.dumps(bare))
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids is \[1, 0, -2\]"):
        load_draft(tmp_path, TARGET, torch.float32)


BAD_CONFIGS = [
    (spec_config(attention_bias=True), "attention_bias is set"),
    (spec_config(target_hidden_size=128), "target_hidden_size is 128 in the draft, 64 in the "
                                          "target"),
    (spec_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1]}),
     "must name 3 target layers"),
    ({k: v for k, v in BASE_CONFIG.items() if k != "draft_vocab_size"},
     "needs draft_vocab_size"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS,
                         ids=["attention_bias", "target_hidden", "two_layers",
                              "no_draft_vocab"])
def test_an_unreadable_eagle3_config_is_refused_saying_why(
        tmp_path: Path, config: dict[str, Any], message: str) -> None:
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_draft(tmp_path, TARGET, torch.float32)


def _no_d2t(t: dict[str, torch.Tensor]) -> None:
    del t["d2t"]


def _float_d2t(t: dict[str, torch.Tensor]) -> None:
    t["d2t"] = t["d2t"].float()


def _t2d_disagrees(t: dict[str, torch.Tensor]) -> None:
    t["t2d"] = t["t2d"].roll(1)


def _d2t_collides(t: dict[str, torch.Tensor]) -> None:
    t["d2t"] = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)
    t["d2t"][1] = -1  # draft ids 0 and 1 both onto target id 0
    del t["t2d"]


def _wrong_fc(t: dict[str, torch.Tensor]) -> None:
    t["fc.weight"] = torch.zeros(64, 128)


def _old_names(t: dict[str, torch.Tensor]) -> None:
    t["layers.0.hidden_norm.weight"] = t.pop("midlayer.hidden_norm.weight")
    t["extra.weight"] = torch.zeros(2)


BAD_TENSORS = [
    (_no_d2t, CheckpointError, r"missing \['d2t'\]"),
    (_float_d2t, CheckpointError, "d2t must be 96 integers"),
    (_t2d_disagrees, CheckpointError, "t2d does not mark exactly"),
    (_d2t_collides, CheckpointError, "several draft ids onto one target id"),
    (_wrong_fc, CheckpointError, "fc.weight"),
    (_old_names, CheckpointError, r"unexpected \['extra.weight'\]"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_TENSORS,
                         ids=["no_d2t", "float_d2t", "t2d", "collide", "fc", "names"])
def test_wrong_eagle3_tensors_are_refused_naming_them(
        tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None],
        error: type[Exception], message: str) -> None:
    tensors = spec_tensors(BASE_CONFIG)
    change(tensors)
    with pytest.raises(error, match=message):
        load_draft(write_spec_draft(tmp_path, BASE_CONFIG, tensors), TARGET, torch.float32)
