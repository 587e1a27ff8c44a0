"""Configs: the model's, read from a Hugging Face ``config.json`` of ``model_type``
``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` or ``qwen3_5``, and the engine's runtime settings
(:class:`EngineConfig`).

Both layouts are accepted: the nested one transformers 5 writes (``text_config`` /
``vision_config`` with ``rope_parameters``) and the flat one of the published checkpoints (text
fields at the top level, ``rope_scaling`` with ``mrope_section``). Qwen2-VL and Qwen2.5-VL share
the decoder; their ``vision_config`` fields differ (see :func:`_vision_config`). Qwen3-VL and
Qwen3.5 share the vision tower (Qwen3.5 without DeepStack); their decoders add q/k norms and
interleaved mrope, and Qwen3.5's is hybrid (:class:`LinearAttentionConfig`, ``layer_types``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
QWEN3_FAMILY = ("qwen3_vl", "qwen3_5")  # the patch-16 vision tower, q/k norms, interleaved mrope
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# what a speculative verify keeps of a hybrid model's linear-attention states until the accepted
# count is known (engine/attention/linear/states.py): the state after every window row, or the
# rows' inputs, from which the accepted rows' state is replayed
VerifyStates = Literal["rows", "replay"]
KEEP_ROWS: VerifyStates = "rows"
REPLAY: VerifyStates = "replay"
VERIFY_STATES: tuple[VerifyStates, ...] = (KEEP_ROWS, REPLAY)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid decoder (Qwen3.5): ``num_k_heads`` query/key heads
    of width ``head_k_dim``, ``num_v_heads`` value heads of width ``head_v_dim`` (each key head
    serves ``num_v_heads / num_k_heads`` consecutive value heads) and a causal depthwise conv of
    width ``conv_kernel`` over the concatenated q/k/v channels."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """Channels the conv mixes: q and k (``num_k_heads * head_k_dim`` each) and v."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


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
    # Qwen3 families: an explicit head width (else hidden_size / num_attention_heads)
    explicit_head_dim: int | None = None
    attention_bias: bool = True  # q/k/v biases (Qwen2); Qwen3 decoders have none
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotation (Qwen3)
    mrope_interleaved: bool = False  # t/h/w frequencies alternate (Qwen3) instead of sections
    partial_rotary_factor: float = 1.0  # the rotated share of each head (Qwen3.5: 0.25)
    attn_output_gate: bool = False  # q_proj also makes a sigmoid gate on the output (Qwen3.5)
    zero_centered_norm: bool = False  # RMSNorm weights are offsets from 1 (Qwen3.5)
    # per layer FULL_ATTENTION or LINEAR_ATTENTION; empty: every layer is full attention
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None  # the linear layers' shape (hybrid models)
    # decoder layers of the checkpoint's MTP (NEXTN) draft module, ``mtp.*`` (Qwen3.5); 0: none
    mtp_num_hidden_layers: int = 0

    @property
    def head_dim(self) -> int:
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head the rotation turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (a per-request state beside the KV)."""
        return LINEAR_ATTENTION in self.layer_types

    def is_linear(self, layer: int) -> bool:
        """Whether global layer ``layer`` is a linear-attention layer."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    def attention_layers(self, layers: range | None = None) -> list[int]:
        """The full-attention layers among ``layers`` (all when None): those the KV pool holds."""
        ids = range(self.num_hidden_layers) if layers is None else layers
        return [i for i in ids if not self.is_linear(i)]

    def linear_layers(self, layers: range | None = None) -> list[int]:
        """The linear-attention layers among ``layers``: those the state pool holds."""
        ids = range(self.num_hidden_layers) if layers is None else layers
        return [i for i in ids if self.is_linear(i)]


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
    # Qwen3 families: learned position embeddings (a square table, interpolated to each grid)
    num_position_embeddings: int = 0
    # Qwen3-VL: the blocks whose merged outputs are added to the first decoder layers' hidden
    # states at the visual tokens (DeepStack), in this order; empty for Qwen3.5
    deepstack_visual_indexes: tuple[int, ...] = ()

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
    """Everything the engine needs to know about a checkpoint of one of
    :data:`SUPPORTED_MODEL_TYPES`."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    model_type: str = "qwen2_vl"

    @property
    def is_qwen3(self) -> bool:
        """Whether this is a Qwen3-VL or Qwen3.5 checkpoint (:data:`QWEN3_FAMILY`)."""
        return self.model_type in QWEN3_FAMILY

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
            text = text_config_from_dict(text_raw, model_type)
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


# transformers' mrope sections when a config names none
_DEFAULT_SECTIONS = {"qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10]}


def text_config_from_dict(t: dict[str, Any], model_type: str = "qwen2_vl") -> TextConfig:
    """The decoder's config from the text fields of a ``model_type`` checkpoint (a nested
    ``text_config`` or the top level of a flat one)."""
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    section = rope.get("mrope_section", _DEFAULT_SECTIONS.get(model_type, [16, 24, 24]))
    if not isinstance(section, list) or len(section) != 3:
        raise ValueError(f"mrope_section must be a list of 3 ints, got {section!r}")
    theta = rope.get("rope_theta", t.get("rope_theta", 1_000_000.0))
    heads = int(t["num_attention_heads"])
    base = TextConfig(
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
    if model_type not in QWEN3_FAMILY:
        return base
    head_dim = t.get("head_dim")
    common: dict[str, Any] = {
        "explicit_head_dim": int(head_dim) if head_dim is not None else None,
        "attention_bias": bool(t.get("attention_bias", False)), "qk_norm": True,
        # transformers' Qwen3 rotaries interleave whatever ``mrope_interleaved`` says
        "mrope_interleaved": True,
    }
    if model_type == "qwen3_vl":
        return replace(base, **common)
    factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))
    return replace(base, **common, partial_rotary_factor=float(factor), attn_output_gate=True,
                   zero_centered_norm=True, layer_types=_layer_types(t, base.num_hidden_layers),
                   mtp_num_hidden_layers=int(t.get("mtp_num_hidden_layers", 0)),
                   linear=LinearAttentionConfig(
                       num_k_heads=int(t.get("linear_num_key_heads", 16)),
                       num_v_heads=int(t.get("linear_num_value_heads", 32)),
                       head_k_dim=int(t.get("linear_key_head_dim", 128)),
                       head_v_dim=int(t.get("linear_value_head_dim", 128)),
                       conv_kernel=int(t.get("linear_conv_kernel_dim", 4))))


def _layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """A hybrid decoder's ``layer_types``, or the pattern ``full_attention_interval`` (default
    4) makes: every interval-th layer full attention, the others linear."""
    types = t.get("layer_types")
    if types is None:
        every = int(t.get("full_attention_interval", 4))
        if every < 1:
            raise ValueError(f"full_attention_interval must be positive, got {every}")
        return tuple(FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION
                     for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"layer_types must list all {num_layers} layers, got {types!r}")
    bad = sorted({x for x in types if x not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if bad:
        raise ValueError(f"unknown layer_types {bad}: pdserve runs {FULL_ATTENTION!r} and "
                         f"{LINEAR_ATTENTION!r}")
    return tuple(types)


def _vision_config(v: dict[str, Any], text_hidden: int, model_type: str) -> VisionConfig:
    """Qwen2-VL names the block width ``embed_dim`` and the merger's output ``hidden_size``;
    Qwen2.5-VL names them ``hidden_size`` and ``out_hidden_size``. Missing optional fields take
    transformers' defaults."""
    if model_type == "qwen2_5_vl":
        return _vision_config_2_5(v, text_hidden)
    if model_type in QWEN3_FAMILY:
        return _vision_config_3(v, text_hidden, model_type)
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
    full = v.get("fullatt_block_indexes", (7, 15, 23, 31))
    if not isinstance(full, (list, tuple)):
        raise ValueError(f"fullatt_block_indexes must be a list of ints, got {full!r}")
    return VisionConfig(
        **_gated_tower_fields(v, text_hidden, patch_size=14, act="silu"),
        tokens_per_second=float(v.get("tokens_per_second", 4)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in full),
    )


def _gated_tower_fields(v: dict[str, Any], text_hidden: int, *, patch_size: int, act: str
                        ) -> dict[str, Any]:
    """The fields Qwen2.5-VL's and the Qwen3 towers name alike (block width ``hidden_size``,
    merger output ``out_hidden_size``, an MLP of ``intermediate_size``); ``patch_size`` and
    ``act`` are the family's defaults."""
    rope = dict(v.get("rope_parameters") or {})
    return {
        "depth": int(v["depth"]),
        "embed_dim": int(v["hidden_size"]),
        "hidden_size": int(v.get("out_hidden_size", text_hidden)),
        "num_heads": int(v["num_heads"]),
        "mlp_ratio": 0.0,
        "in_channels": int(v.get("in_channels", v.get("in_chans", 3))),
        "patch_size": int(v.get("patch_size", patch_size)),
        "spatial_merge_size": int(v.get("spatial_merge_size", 2)),
        "temporal_patch_size": int(v.get("temporal_patch_size", 2)),
        "hidden_act": str(v.get("hidden_act", act)),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "intermediate_size": int(v["intermediate_size"]),
    }


def _vision_config_3(v: dict[str, Any], text_hidden: int, model_type: str) -> VisionConfig:
    """Qwen3-VL's tower (and Qwen3.5's, which has no ``deepstack_visual_indexes``): names as
    Qwen2.5-VL's, plus the learned position table."""
    default_stack = (8, 16, 24) if model_type == "qwen3_vl" else ()
    stack = v.get("deepstack_visual_indexes", default_stack)
    if not isinstance(stack, (list, tuple)):
        raise ValueError(f"deepstack_visual_indexes must be a list of ints, got {stack!r}")
    return VisionConfig(
        **_gated_tower_fields(v, text_hidden, patch_size=16, act="gelu_pytorch_tanh"),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(int(i) for i in stack),
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
    if t.explicit_head_dim is None and t.hidden_size % t.num_attention_heads:
        raise ConfigError("hidden_size must be divisible by num_attention_heads")
    if t.num_attention_heads % t.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if t.head_dim < 2 or t.rotary_dim % 2 or not 0 < t.rotary_dim <= t.head_dim:
        raise ConfigError(f"the rotated width {t.rotary_dim} of head_dim {t.head_dim} must be "
                          "even and positive (check partial_rotary_factor)")
    # an interleaved layout takes what it finds of its sections, as transformers' does
    if not t.mrope_interleaved and 2 * sum(t.mrope_section) != t.rotary_dim:
        raise ConfigError(
            f"mrope_section {t.mrope_section} must sum to head_dim/2 = {t.rotary_dim // 2}"
        )
    if t.linear is not None:
        _validate_linear(t.linear)
    if v.embed_dim % v.num_heads or v.head_dim % 4:
        raise ConfigError("vision embed_dim/num_heads must be a multiple of 4")
    if v.hidden_size != t.hidden_size:
        out = "hidden_size" if cfg.model_type == "qwen2_vl" else "out_hidden_size"
        raise ConfigError(f"vision_config.{out} ({v.hidden_size}) must equal the text "
                          f"hidden_size ({t.hidden_size})")
    if cfg.model_type == "qwen2_5_vl":
        _validate_vision_2_5(v)
    if cfg.is_qwen3:
        _validate_vision_3(v)


def _validate_linear(lin: LinearAttentionConfig) -> None:
    sizes = {"linear_num_key_heads": lin.num_k_heads, "linear_num_value_heads": lin.num_v_heads,
             "linear_key_head_dim": lin.head_k_dim, "linear_value_head_dim": lin.head_v_dim,
             "linear_conv_kernel_dim": lin.conv_kernel}
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{name} must be positive, got {value}")
    if lin.num_v_heads % lin.num_k_heads:
        raise ConfigError(f"linear_num_value_heads ({lin.num_v_heads}) must be a multiple of "
                          f"linear_num_key_heads ({lin.num_k_heads})")


def _validate_vision_3(v: VisionConfig) -> None:
    side = math.isqrt(v.num_position_embeddings)
    if side < 1 or side * side != v.num_position_embeddings:
        raise ConfigError(f"vision_config.num_position_embeddings ({v.num_position_embeddings}) "
                          "must be a positive square (a side x side table)")
    bad = [i for i in v.deepstack_visual_indexes if not 0 <= i < v.depth]
    if bad:
        raise ConfigError(f"vision_config.deepstack_visual_indexes {bad} are not blocks of a "
                          f"tower of depth {v.depth}")
    if v.intermediate_size is None or v.intermediate_size <= 0:
        raise ConfigError(f"vision_config.intermediate_size must be positive, got "
                          f"{v.intermediate_size}")


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
    # the padded batch sizes captured (at start-up, engine.runner.warmup); None: the defaults
    # up to max_num_seqs (engine.runner.cuda_graph.DEFAULT_CAPTURE_SIZES). max_num_seqs is
    # always one: every batch fits a captured size
    cuda_graph_sizes: tuple[int, ...] | None = None
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
    # a hybrid model's linear-attention state slots (engine/kv/state_pool.py): None for one per
    # running request (max_num_seqs); a decode node wants more, for the rooms in transfer
    state_slots: int | None = None
    # a hybrid model's prefix cache keeps the linear-attention state every
    # state_checkpoint_interval prompt tokens (a multiple of page_size), in state_checkpoints
    # slots of the state pool beside the requests' (each one slot's bytes, evicted LRU); a KV
    # hit is cut back to the last boundary with a checkpoint (engine/core/state_checkpoints.py)
    state_checkpoints: int = 16
    state_checkpoint_interval: int = 512
    # a hybrid model's speculative verify: what it keeps of the linear-attention states until
    # the accepted counts are known, one of VERIFY_STATES (the same bits in the pool either way)
    verify_states: VerifyStates = KEEP_ROWS

    @property
    def num_state_slots(self) -> int:
        """The requests' state slot count (``state_slots``, else ``max_num_seqs``)."""
        return self.state_slots if self.state_slots is not None else self.max_num_seqs

    @property
    def state_pool_slots(self) -> int:
        """The state pool's slot count: the requests', then the prefix cache's checkpoints."""
        return self.num_state_slots + (self.state_checkpoints if self.enable_prefix_cache else 0)

    def __post_init__(self) -> None:
        """Refuse settings no engine can run (a page size of 0 divided by zero at start-up; a
        ``num_pages`` of 0 silently meant "from the budget")."""
        sizes = {"page_size": self.page_size, "kv_budget_bytes": self.kv_budget_bytes,
                 "max_num_seqs": self.max_num_seqs, "tp_size": self.tp_size,
                 "max_num_batched_tokens": self.max_num_batched_tokens,
                 "num_pages": self.num_pages, "max_model_len": self.max_model_len,
                 "state_slots": self.state_slots}
        for name, value in sizes.items():
            if value is None and name in ("num_pages", "max_model_len", "state_slots"):
                continue  # unset: from the budget, from the model
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if (isinstance(self.state_checkpoints, bool) or not isinstance(self.state_checkpoints, int)
                or self.state_checkpoints < 0):
            raise ConfigError(f"EngineConfig.state_checkpoints must be an int of at least 0, got "
                              f"{self.state_checkpoints!r}")
        interval = self.state_checkpoint_interval
        if (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
                or interval % self.page_size):
            raise ConfigError(f"EngineConfig.state_checkpoint_interval must be a positive "
                              f"multiple of page_size {self.page_size}, got {interval!r}")
        if self.lookahead_tokens < 0:
            raise ConfigError(f"EngineConfig.lookahead_tokens must be at least 0, got "
                              f"{self.lookahead_tokens}")
        if self.verify_states not in VERIFY_STATES:
            raise ConfigError(f"EngineConfig.verify_states must be one of "
                              f"{', '.join(VERIFY_STATES)}, got {self.verify_states!r}")
