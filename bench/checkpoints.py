"""Random-weight checkpoints of real model sizes for the speed benchmarks (``--model qwen2-0.5b``).

The tiny built-in models measure per-op overhead, not a model's step; a peer comparison needs a
checkpoint of the size users serve. :func:`write_qwen2_05b` writes a Qwen2-VL-architecture
checkpoint whose decoder has Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads over 2 KV heads,
intermediate 4864, a 151,936-token vocabulary tied to the LM head: 494M parameters, 1.98 GB in
float32) and a two-block vision tower, seeded, in the Hugging Face layout; :func:`text_only_view`
writes the same decoder as a ``Qwen2ForCausalLM`` directory, for a peer that serves Qwen2-VL's
decoder on its own. :data:`HYBRID_SHAPES` are Qwen3.5 checkpoints (written by transformers'
own class, :func:`bench.qwen3_5_generate.write_checkpoint`): ``qwen3.5-0.65b`` is the text
shape of the published small Qwen3.5 models (hidden 1024, 24 layers, every 4th gated full
attention, 18 Gated DeltaNet layers; 498M parameters in the layers, 654M with the tied
151,936-token embedding); their text-only view is a ``Qwen3_5ForCausalLM``.

Such a checkpoint gets a word-level tokenizer over its whole vocabulary (:func:`word_tokenizer`:
token ``i`` is the word ``w<i>``), so that a serving benchmark's text is real on both sides:
random prompts decode to text that encodes back to the same ids, and every token the random
model emits decodes to a word (a small tokenizer would turn most of them into nothing, and an
OpenAI-API client would see empty streams).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from engine.builtin.tiny_model import TINY_PREPROCESSOR, init_weights, tiny_config_dict
from engine.checkpoint import save_weights
from engine.config import ModelConfig
from engine.models.qwen2_vl.model import Qwen2VLModel

QWEN2_05B_TEXT: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                        "mrope_section": [8, 12, 12]},
}
# the names a checkpoint's shape is asked for by (``--model NAME`` of the benchmarks)
SHAPES = {"qwen2-0.5b": QWEN2_05B_TEXT}
HYBRID_VOCAB = 151936
# Qwen3.5 shapes: name -> (tiny: the 4-layer toy of the same layout, for tests), the vocabulary
HYBRID_SHAPES: dict[str, tuple[bool, int]] = {"qwen3.5-0.65b": (False, HYBRID_VOCAB)}
HYBRID_MARKER = ".pdserve-shape.json"  # what a cached hybrid checkpoint was written as
CACHE = Path.home() / ".cache" / "pdserve" / "bench"  # where shaped checkpoints are kept


def shape_names() -> list[str]:
    """Every shape ``--model`` takes by name."""
    return [*SHAPES, *HYBRID_SHAPES]


def shaped_or_dir(arg: str) -> Path:
    """A benchmark's ``--model``: the cached checkpoint of shape ``arg`` (written under
    :data:`CACHE` on first use), or the directory ``arg`` as given."""
    if arg in HYBRID_SHAPES:
        return write_hybrid(CACHE / arg, arg)
    return write_shaped(CACHE / arg, arg) if arg in SHAPES else Path(arg)


def config_dict(text: dict[str, Any]) -> dict[str, Any]:
    """The tiny model's ``config.json`` with its decoder reshaped by ``text``, embeddings tied."""
    raw = tiny_config_dict()
    raw["text_config"] = {**raw["text_config"], **text}
    raw["vision_config"]["hidden_size"] = text["hidden_size"]  # the tower's merger output
    raw["tie_word_embeddings"] = True
    return raw


def write_shaped(model_dir: str | Path, shape: str, seed: int = 0) -> Path:
    """Write a seeded checkpoint of the decoder shape called ``shape`` (:data:`SHAPES`) to
    ``model_dir``, unless one is there already (the weights take a minute to draw)."""
    path = Path(model_dir)
    raw = config_dict(SHAPES[shape])
    tokenizer = word_tokenizer(int(raw["text_config"]["vocab_size"]), special_tokens(raw))
    if (path / "config.json").exists() and json.loads(
            (path / "config.json").read_text()) == raw:
        _write_if_changed(path / "tokenizer.json", tokenizer.to_str())  # an older tokenizer
        return path
    path.mkdir(parents=True, exist_ok=True)
    model = Qwen2VLModel(ModelConfig.from_dict(raw))
    init_weights(model, seed)
    save_weights(model, path)
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def write_hybrid(model_dir: str | Path, shape: str, seed: int = 0) -> Path:
    """Write the seeded Qwen3.5 checkpoint called ``shape`` (:data:`HYBRID_SHAPES`) with a word
    tokenizer to ``model_dir``, unless one of the same shape and seed is there already."""
    from bench.qwen3_5_generate import write_checkpoint

    path = Path(model_dir)
    tiny, vocab = HYBRID_SHAPES[shape]
    marker = json.dumps({"shape": shape, "tiny": tiny, "vocab": vocab, "seed": seed})
    if (path / HYBRID_MARKER).exists() and (path / HYBRID_MARKER).read_text() == marker:
        return path
    write_checkpoint(path, vocab, tiny, seed)
    raw = json.loads((path / "config.json").read_text())
    (path / "tokenizer.json").write_text(word_tokenizer(vocab, special_tokens(raw)).to_str())
    (path / HYBRID_MARKER).write_text(marker)
    return path


def special_tokens(config: dict[str, Any]) -> dict[int, str]:
    """The ids a prompt's words must never become, by the names they get: every
    ``<name>_token_id`` of ``config`` (the vision placeholders and markers) as ``<|name|>``."""
    return {value: f"<|{key.removesuffix('_token_id')}|>" for key, value in config.items()
            if key.endswith("_token_id") and isinstance(value, int)}


def word_tokenizer(vocab_size: int, special: dict[int, str]) -> Tokenizer:
    """A tokenizer of ``vocab_size`` words split on whitespace: token ``i`` is the word
    ``w<i>``, or the special token ``special[i]`` (which decoding without special tokens drops,
    and which a load generator leaves out of random prompts). Ids decode to words joined by
    spaces, and that text encodes back to the same ids."""
    vocab = {special.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True) for name in special.values()])
    return tok


def tokenizer_only(model_dir: str | Path, out_dir: str | Path) -> Path:
    """``model_dir``'s ``tokenizer.json`` alone in ``out_dir``, with the
    ``tokenizer_config.json`` that has transformers load it as it is and know its special
    tokens: where a ``config.json`` sits beside it, transformers takes a Qwen2 model's own
    tokenizer class instead, which reads none of a word-level tokenizer's words (what a peer and
    its load generator are given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = (Path(model_dir) / "tokenizer.json").read_text()
    (out / "tokenizer.json").write_text(text)
    added = Tokenizer.from_str(text).get_added_tokens_decoder()
    special = [added[i].content for i in sorted(added) if added[i].special]
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
         "additional_special_tokens": special}, indent=2) + "\n")
    return out


def _write_if_changed(file: Path, text: str) -> None:
    if not file.exists() or file.read_text() != text:
        file.write_text(text)


HYBRID_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"


def text_only_view(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``model_dir``'s decoder as a ``Qwen2ForCausalLM`` checkpoint to ``out_dir``: the
    text config at the top level (plain rope: a text-only prompt's three mrope axes are equal,
    so mrope is plain rope there) and the weights without the vision tower. A Qwen3.5
    checkpoint's view is a ``Qwen3_5ForCausalLM`` (:func:`hybrid_text_view`)."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("architectures") == [HYBRID_ARCHITECTURE]:
        return hybrid_text_view(src, out, raw)
    text = dict(raw["text_config"])
    rope = dict(text.pop("rope_parameters", {}))
    rope.pop("mrope_section", None)
    text.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                rope_parameters={**rope, "rope_type": "default"}, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("visual.")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "generation_config.json"):
        if (src / name).exists():
            (out / name).write_text((src / name).read_text())
    return out



def hybrid_text_view(src: Path, out: Path, raw: dict[str, Any]) -> Path:
    """A Qwen3.5 checkpoint's decoder as a ``Qwen3_5ForCausalLM`` in ``out``: its text config
    (``raw["text_config"]``) at the top level with its rope as it is (a text prompt's
    interleaved mrope axes are equal: plain partial rope), the weights without the vision
    tower's, still under ``model.language_model.`` (that class's loaders map the prefix to
    their own ``model.``)."""
    text = dict(raw["text_config"])
    text.update(architectures=["Qwen3_5ForCausalLM"],
                tie_word_embeddings=raw.get("tie_word_embeddings", False), torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()
                          if not k.startswith("model.visual.")})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "generation_config.json"):
        if (src / name).exists():
            (out / name).write_text((src / name).read_text())
    return out
