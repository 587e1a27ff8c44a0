"""EAGLE drafts in the original EAGLE (EAGLE-1/EAGLE-2) layout load into pdserve's draft.

The oracle is pdserve's own layout: the same tensors written there with the matching variant
flags (``fc`` bias, no input norm, no final norm; zero q/k/v biases where a Llama-style draft has
none) must give the same config, the same weights and the same forward outputs bit for bit, and
EAGLE decoding with the original-layout draft must equal plain greedy decoding. Drafts that do not
fit the target, of an unknown layout or with EAGLE-3 tensors under an EAGLE-1/2 config are
refused, naming what is wrong.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from decode_node.spec.eagle_engine import EagleEngine
from engine.attention.backend import AttentionBatch, TorchPagedAttention
from engine.builtin.tiny_model import tiny_config_dict, write_tiny_model
from engine.config import EngineConfig, ModelConfig
from engine.core.request import SamplingParams
from engine.errors import CheckpointError, ConfigError
from engine.kv.pool import KVPool
from engine.llm_engine import LLMEngine, Prompt
from engine.models.eagle.draft import (
    VARIANT_DEFAULTS,
    DraftConfig,
    EagleDraft,
    draft_config_dict,
)
from engine.models.eagle.loader import load_draft
from engine.multimodal.inputs import ImageInput

TARGET_RAW = tiny_config_dict()
TEXT = TARGET_RAW["text_config"]
TARGET = ModelConfig.from_dict(TARGET_RAW).text
LAYERS = TARGET.num_hidden_layers

# config.json of an original-layout draft for the tiny target, keys as EAGLE's training writes
BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 4096, "num_attention_heads": 4, "num_hidden_layers": 1,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 512,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qkv_bias": True,
              "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
    "no_fc_bias": {"bias": False},
}


def eagle_config(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE_CONFIG), **changes}


def eagle_tensors(config: dict[str, Any], seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors under the original layout's names, ``embed_tokens.weight`` included."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, h), "fc.weight": (h, 2 * h),
        f"{attn}q_proj.weight": (q, h), f"{attn}k_proj.weight": (kv, h),
        f"{attn}v_proj.weight": (kv, h), f"{attn}o_proj.weight": (h, q),
        f"{mlp}gate_proj.weight": (inter, h), f"{mlp}up_proj.weight": (inter, h),
        f"{mlp}down_proj.weight": (h, inter), "layers.0.post_attention_layernorm.weight": (h,),
    }
    if config.get("bias", True):
        shapes["fc.bias"] = (h,)
    if config.get("qkv_bias", False):
        shapes.update({f"{attn}q_proj.bias": (q,), f"{attn}k_proj.bias": (kv,),
                       f"{attn}v_proj.bias": (kv,)})
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        scale = 0.1 if len(shape) == 1 else 0.02
        base = 1.0 if name.endswith("layernorm.weight") else 0.0
        out[name] = base + scale * torch.randn(shape, generator=gen)
    return out


def write_eagle_draft(path: Path, config: dict[str, Any],
                      tensors: dict[str, torch.Tensor] | None = None,
                      bin_file: bool = False) -> Path:
    """An original-layout draft: ``config``, and ``tensors`` (random ones by default) in
    ``model.safetensors`` or, with ``bin_file``, ``pytorch_model.bin``."""
    path.mkdir(parents=True, exist_ok=True)
    tensors = eagle_tensors(config) if tensors is None else tensors
    if bin_file:
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_pdserve_twin(path: Path, config: dict[str, Any],
                       tensors: dict[str, torch.Tensor]) -> Path:
    """The same draft in pdserve's own layout: variant flags, the layer's q/k/v biases (zero for
    a Llama-style draft), no embedding."""
    raw = draft_config_dict(copy.deepcopy(TEXT), LAYERS, fc_bias=config.get("bias", True),
                            layer_input_norm=False, final_norm=False)
    state = {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}
    for proj in ("q_proj", "k_proj", "v_proj"):
        rows = state[f"layers.0.self_attn.{proj}.weight"].shape[0]
        state.setdefault(f"layers.0.self_attn.{proj}.bias", torch.zeros(rows))
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


def realigned(draft: EagleDraft) -> EagleDraft:
    """``draft`` with every parameter copied into fresh memory. A loaded draft's weights stay in
    the safetensors file's mapping, at offsets the file's layout sets, and on the CPU a one-row
    matmul may round differently at another alignment; fresh (64-byte aligned) copies leave only
    the values to compare. The fused q/k/v and gate/up weights are fresh copies already."""
    for module in draft.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().clone(), requires_grad=False))
    return draft


def forward_twice(draft: EagleDraft) -> torch.Tensor:
    """A 5-row prefill and one more row over its KV, at 3-D positions whose axes differ."""
    gen = torch.Generator().manual_seed(11)
    pool = KVPool(2, 8, TARGET.num_key_value_heads, TARGET.head_dim, [draft.cfg.layer_id])
    attn = TorchPagedAttention(pool)
    embeds = torch.randn(6, TARGET.hidden_size, generator=gen)
    feats = torch.randn(6, TARGET.hidden_size, generator=gen)
    pos = torch.arange(6)
    mrope = torch.stack((pos, pos // 2, pos % 3))  # [3, 6]
    outs = []
    for start, stop in ((0, 5), (5, 6)):
        attn.prepare(AttentionBatch.from_lists([stop - start], [stop], [[0]],
                                               torch.arange(start, stop)))
        outs.append(draft(embeds[start:stop], feats[start:stop], mrope[:, start:stop], attn))
    return torch.cat(outs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_original_layout_loads_as_its_pdserve_twin(tmp_path: Path, variant: str) -> None:
    config = eagle_config(**VARIANTS[variant])
    tensors = eagle_tensors(config)
    eagle = load_draft(write_eagle_draft(tmp_path / "eagle", config, tensors), TARGET,
                       torch.float32)
    twin = load_draft(write_pdserve_twin(tmp_path / "twin", config, tensors), TARGET,
                      torch.float32)
    assert eagle.cfg == twin.cfg
    assert (eagle.cfg.fc_bias, eagle.cfg.layer_input_norm, eagle.cfg.final_norm) == (
        config["bias"], False, False)
    mine, theirs = eagle.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(forward_twice(realigned(eagle)), forward_twice(realigned(twin)))


def test_a_pytorch_model_bin_loads_the_same(tmp_path: Path) -> None:
    config = eagle_config(**VARIANTS["qwen2"])
    tensors = eagle_tensors(config)
    from_bin = load_draft(write_eagle_draft(tmp_path / "bin", config, tensors, bin_file=True),
                          TARGET, torch.float32)
    from_st = load_draft(write_eagle_draft(tmp_path / "st", config, tensors), TARGET,
                         torch.float32)
    mine, theirs = from_bin.state_dict(), from_st.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


class NotATensor:
    """An object a ``weights_only`` load must refuse to build."""


def test_a_bin_holding_more_than_tensors_is_refused(tmp_path: Path) -> None:
    config = eagle_config()
    path = tmp_path / "bad"
    path.mkdir()
    torch.save({**eagle_tensors(config), "extra": NotATensor()}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="holds more than plain tensors"):
        load_draft(path, TARGET, torch.float32)


def test_greedy_eagle_with_an_original_layout_draft_equals_plain_decoding(
        tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "model")
    draft_dir = write_eagle_draft(tmp_path / "eagle", eagle_config(**VARIANTS["qwen2"]))
    grid = (1, 4, 4)
    image = ImageInput(torch.randn(16, 1176, generator=torch.Generator().manual_seed(2)), grid)
    img, vs, ve = (TARGET_RAW[k] for k in ("image_token_id", "vision_start_token_id",
                                           "vision_end_token_id"))
    prompts = [Prompt(token_ids=list(range(1, 30))),
               Prompt(token_ids=[3, vs, *[img] * 4, ve, 5, 6], images=[image])]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    plain = LLMEngine(model_dir, EngineConfig(num_pages=128, page_size=8)).generate(prompts,
                                                                                   params)
    engine = LLMEngine(model_dir, EngineConfig(num_pages=128, page_size=8, lookahead_tokens=3,
                                               max_num_batched_tokens=24))
    spec = EagleEngine(engine, load_draft(draft_dir, engine.model_config.text, torch.float32), 3)
    got = spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert spec.stats.rounds > 0
    spec.engine.scheduler.check_no_leaks()


MISFITS = [
    ({"hidden_size": 32}, ["hidden_size is 32 in the draft, 64 in the target",
                           "head_dim is 8 in the draft, 16 in the target"]),
    ({"num_key_value_heads": 1}, ["num_key_value_heads is 1 in the draft, 2 in the target"]),
    ({"vocab_size": 1000}, ["vocab_size is 1000 in the draft, 512 in the target"]),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [3, 3, 2]}},
     ["mrope_section is [3, 3, 2] in the draft, [2, 3, 3] in the target"]),
]


@pytest.mark.parametrize(("changes", "named"), MISFITS,
                         ids=["hidden", "kv_heads", "vocab", "mrope"])
def test_a_misfit_original_layout_draft_is_refused_naming_what_differs(
        tmp_path: Path, changes: dict[str, Any], named: list[str]) -> None:
    tmp_path.joinpath("config.json").write_text(json.dumps(eagle_config(**changes)))
    with pytest.raises(ConfigError, match="does not fit the target") as err:
        load_draft(tmp_path, TARGET, torch.float32)  # no weights: refused before them
    for part in named:
        assert part in str(err.value)
    assert str(err.value).count(" in the draft, ") == len(named)


BAD_CONFIGS = [
    (TARGET_RAW, "unknown draft layout \\(model_type 'qwen2_vl'"),
    (eagle_config(model_type="mistral"), "unknown draft layout"),
    (eagle_config(num_hidden_layers=2), "num_hidden_layers is 2 in the draft"),
    (eagle_config(rope_scaling={"type": "linear", "factor": 2.0}), "rope type 'linear'"),
    (eagle_config(head_dim=32), "head_dim is 32 in the draft"),
    (eagle_config(bias="yes"), "bias must be true or false"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS,
                         ids=["target", "mistral", "layers", "scaled_rope", "head_dim", "bias"])
def test_an_unreadable_config_is_refused_saying_why(
        tmp_path: Path, config: dict[str, Any], message: str) -> None:
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_draft(tmp_path, TARGET, torch.float32)


def test_eagle3_tensors_under_an_unmarked_config_are_refused(tmp_path: Path) -> None:
    """EAGLE-3 drafts load (tests/engine/models/test_eagle3_layout.py) when their config says so."""
    config = eagle_config()
    tensors = {**eagle_tensors(config), "d2t": torch.zeros(8, dtype=torch.int64)}
    with pytest.raises(ConfigError, match="EAGLE-3 tensors \\(tensor 'd2t'\\) in a draft whose "
                                          "config.json is not marked EAGLE-3"):
        load_draft(write_eagle_draft(tmp_path, config, tensors), TARGET, torch.float32)


def _drop_up_add_norm(t: dict[str, torch.Tensor]) -> None:
    del t["layers.0.mlp.up_proj.weight"]
    t["norm.weight"] = torch.ones(64)


def _qkv_biases_unannounced(t: dict[str, torch.Tensor]) -> None:
    t["layers.0.self_attn.q_proj.bias"] = torch.zeros(64)


def _wrong_embedding(t: dict[str, torch.Tensor]) -> None:
    t["embed_tokens.weight"] = torch.zeros(500, 64)


BAD_TENSORS = [
    (_drop_up_add_norm, "missing \\['layers.0.mlp.up_proj.weight'\\], "
                        "unexpected \\['norm.weight'\\]"),
    (_qkv_biases_unannounced, "q/k/v biases False \\(config 'qkv_bias'\\).*"
                              "unexpected \\['layers.0.self_attn.q_proj.bias'\\]"),
    (_wrong_embedding, "embed_tokens.weight has shape \\[500, 64\\], not the target "
                       "embedding's \\[512, 64\\]"),
]


@pytest.mark.parametrize(("change", "message"), BAD_TENSORS,
                         ids=["missing_unexpected", "qkv_bias", "embedding"])
def test_wrong_tensors_are_refused_naming_them(
        tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None], message: str) -> None:
    config = eagle_config()
    tensors = eagle_tensors(config)
    change(tensors)
    with pytest.raises(CheckpointError, match=message):
        load_draft(write_eagle_draft(tmp_path, config, tensors), TARGET, torch.float32)


def test_variant_flags_at_their_defaults_stay_out_of_the_config() -> None:
    raw = draft_config_dict(copy.deepcopy(TEXT), LAYERS)
    assert not set(VARIANT_DEFAULTS) & set(raw)  # a default draft's config.json as before
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.fc_bias, cfg.layer_input_norm, cfg.final_norm) == (False, True, True)
    with pytest.raises(ConfigError, match="final_norm must be true or false"):
        DraftConfig.from_dict({**raw, "final_norm": "no"})
