"""Configs: the model's, read from a Hugging Face ``config.json`` of ``model_type`` ``qwen2_vl``
or ``qwen2_5_vl``, and the engine's runtime settings (:class:`EngineConfig`).

Both layouts are accepted: the nested one transformers 5 writes (``text_config`` /
``vision_config`` with ``rope_parameters``) and the flat one of the published Qwen2-VL and
Qwen2.5-VL checkpoints (text fields at the top level, ``rope_scaling`` with ``mrope_section``).
The two architectures share the decoder; their ``vision_config`` fields differ (see
:func:`_vision_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class TextConfig:
    """The decoder's shape and rope settings."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape. The fields after ``tokens_per_second`` are Qwen2.5-VL's and keep
    their defaults for Qwen2-VL."""

    depth: int
    embed_dim: int  # width of the blocks (Qwen2.5-VL's vision ``hidden_size``)
    hidden_size: int  # output width of the patch merger (== text hidden size; Qwen2.5-VL's
    # ``out_hidden_size``)
    num_heads: int
    mlp_ratio: float  # Qwen2-VL's MLP width over embed_dim (unused by Qwen2.5-VL)
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    hidden_act: str
    rope_theta: float
    # Qwen2.5-VL: temporal rope positions per second of video (a video's temporal grid step
    # advances tokens_per_second * second_per_grid positions); None for Qwen2-VL (one per step)
    tokens_per_second: float | None = None
    # Qwen2.5-VL: width of the gated MLP of each block
    intermediate_size: int | None = None
    # Qwen2.5-VL: side of an attention window in pixels; a window holds
    # (window_size // (patch_size * spatial_merge_size))**2 merged patches of one frame
    window_size: int | None = None
    # Qwen2.5-VL: the blocks that attend over whole frames; every other block is windowed
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def window_merged(self) -> int:
        """Side of a Qwen2.5-VL attention window in merged patches (0 for Qwen2-VL)."""
        if self.window_size is None:
            return 0
        return self.window_size // (self.patch_size * self.spatial_merge_size)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened input patch: ``C * T * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a Qwen2-VL-architecture checkpoint
    (``model_type`` ``qwen2_vl`` or ``qwen2_5_vl``)."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    model_type: str = "qwen2_vl"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (is this a model directory?)")
        raw = read_json_object(path)
        extra_eos = _read_generation_eos(Path(model_dir))
        return cls.from_dict(raw, extra_eos=extra_eos)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: pdserve serves {SUPPORTED_MODEL_TYPES}"
            )
        try:
            text_raw = dict(raw.get("text_config") or raw)
            text = text_config_from_dict(text_raw)
            vision = _vision_config(raw["vision_config"], text.hidden_size, model_type)
            eos = _as_ids(text_raw.get("eos_token_id", raw.get("eos_token_id")))
            tie = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
            cfg = cls(
                text=text,
                vision=vision,
                image_token_id=int(raw.get("image_token_id", 151655)),
                video_token_id=int(raw.get("video_token_id", 151656)),
                vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
                vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
                eos_token_ids=tuple(dict.fromkeys((*eos, *extra_eos))),
                tie_word_embeddings=tie,
                model_type=model_type,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"config.json is missing or has a bad field: {exc!r}") from exc
        _validate(cfg)
        return cfg


def text_config_from_dict(t: dict[str, Any]) -> TextConfig:
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    section = rope.get("mrope_section", [16, 24, 24])
    if not isinstance(section, list) or len(section) != 3:
        raise ValueError(f"mrope_section must be a list of 3 ints, got {section!r}")
    theta = rope.get("rope_theta", t.get("rope_theta", 1_000_000.0))
    heads = int(t["num_attention_heads"])
    return TextConfig(
        vocab_size=int(t["vocab_size"]),
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_hidden_layers=int(t["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        hidden_act=str(t.get("hidden_act", "silu")),
    )


def _vision_config(v: dict[str, Any], text_hidden: int, model_type: str) -> VisionConfig:
    """Qwen2-VL names the block width ``embed_dim`` and the merger's output ``hidden_size``;
    Qwen2.5-VL names them ``hidden_size`` and ``out_hidden_size``. Missing optional fields take
    transformers' defaults."""
    if model_type == "qwen2_5_vl":
        return _vision_config_2_5(v, text_hidden)
    rope = dict(v.get("rope_parameters") or {})
    return VisionConfig(
        depth=int(v["depth"]),
        embed_dim=int(v["embed_dim"]),
        hidden_size=int(v.get("hidden_size", text_hidden)),
        num_heads=int(v["num_heads"]),
        mlp_ratio=float(v.get("mlp_ratio", 4)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        hidden_act=str(v.get("hidden_act", "quick_gelu")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def _vision_config_2_5(v: dict[str, Any], text_hidden: int) -> VisionConfig:
    rope = dict(v.get("rope_parameters") or {})
    full = v.get("fullatt_block_indexes", (7, 15, 23, 31))
    if not isinstance(full, (list, tuple)):
        raise ValueError(f"fullatt_block_indexes must be a list of ints, got {full!r}")
    return VisionConfig(
        depth=int(v["depth"]),
        embed_dim=int(v["hidden_size"]),
        hidden_size=int(v.get("out_hidden_size", text_hidden)),
        num_heads=int(v["num_heads"]),
        mlp_ratio=0.0,
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", 14)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        hidden_act=str(v.get("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tokens_per_second=float(v.get("tokens_per_second", 4)),
        intermediate_size=int(v["intermediate_size"]),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in full),
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(x) for x in value)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ConfigError if it is unreadable, not JSON or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object, found {type(raw).__name__}")
    return raw


def _read_generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _as_ids(read_json_object(path).get("eos_token_id"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: bad eos_token_id: {exc}") from exc


def _validate(cfg: ModelConfig) -> None:
    t, v = cfg.text, cfg.vision
    if t.hidden_size % t.num_attention_heads:
        raise ConfigError("hidden_size must be divisible by num_attention_heads")
    if t.num_attention_heads % t.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if 2 * sum(t.mrope_section) != t.head_dim:
        raise ConfigError(
            f"mrope_section {t.mrope_section} must sum to head_dim/2 = {t.head_dim // 2}"
        )
    if v.embed_dim % v.num_heads or v.head_dim % 4:
        raise ConfigError("vision embed_dim/num_heads must be a multiple of 4")
    if v.hidden_size != t.hidden_size:
        out = "out_hidden_size" if cfg.model_type == "qwen2_5_vl" else "hidden_size"
        raise ConfigError(f"vision_config.{out} ({v.hidden_size}) must equal the text "
                          f"hidden_size ({t.hidden_size})")
    if cfg.model_type == "qwen2_5_vl":
        _validate_vision_2_5(v)


def _validate_vision_2_5(v: VisionConfig) -> None:
    if v.intermediate_size is None or v.intermediate_size <= 0:
        raise ConfigError(f"vision_config.intermediate_size must be positive, got "
                          f"{v.intermediate_size}")
    if v.window_merged < 1:
        raise ConfigError(
            f"vision_config.window_size ({v.window_size}) must be at least patch_size * "
            f"spatial_merge_size = {v.patch_size * v.spatial_merge_size} pixels"
        )
    bad = [i for i in v.fullatt_block_indexes if not 0 <= i < v.depth]
    if bad:
        raise ConfigError(f"vision_config.fullatt_block_indexes {list(bad)} are not blocks of a "
                          f"tower of depth {v.depth}")
    if v.tokens_per_second is None or v.tokens_per_second <= 0:
        raise ConfigError(f"vision_config.tokens_per_second must be positive, got "
                          f"{v.tokens_per_second}")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime settings of one engine (the model's own settings come from its config.json)."""

    page_size: int = 16
    kv_budget_bytes: int = 256 << 20  # memory for the KV pool; sets the page count
    num_pages: int | None = None  # overrides kv_budget_bytes when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget per step, and the prefill chunk size
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    lookahead_tokens: int = 0  # KV a request may write past its tokens (speculative decoding)
    # weights and KV pool: float32 | bfloat16 | float16, or "auto" (bfloat16 on an accelerator,
    # float32 on the CPU); the device: cpu | cuda[:N] | npu[:N], or "auto" (engine/device.py)
    dtype: str = "float32"
    device: str = "cpu"
    graphs: bool = True  # on CUDA, run decode steps through captured CUDA graphs
    # the decoder layers this engine holds (weights and KV pool): None for all; a pipeline's
    # first stage holds its share only and runs through prefill_node.pipeline.first_runner
    layers: range | None = None
    # reuse the KV of full pages of earlier prompts with the same prefix (tokens and images);
    # see engine/core/prefix_cache.py
    enable_prefix_cache: bool = True
    # tensor-parallel ranks, one process each (engine/parallel/driver.py): this one is rank 0 and
    # starts the others; 1 runs the whole model here. Each rank's KV pool holds its own key/value
    # heads in kv_budget_bytes, so the page count grows with the ranks that split the heads
    tp_size: int = 1

    def __post_init__(self) -> None:
        """Refuse settings no engine can run (a page size of 0 divided by zero at start-up; a
        ``num_pages`` of 0 silently meant "from the budget")."""
        sizes = {"page_size": self.page_size, "kv_budget_bytes": self.kv_budget_bytes,
                 "max_num_seqs": self.max_num_seqs, "tp_size": self.tp_size,
                 "max_num_batched_tokens": self.max_num_batched_tokens,
                 "num_pages": self.num_pages, "max_model_len": self.max_model_len}
        for name, value in sizes.items():
            if value is None and name in ("num_pages", "max_model_len"):
                continue  # unset: from the budget, from the model
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.lookahead_tokens < 0:
            raise ConfigError(f"EngineConfig.lookahead_tokens must be at least 0, got "
                              f"{self.lookahead_tokens}")
