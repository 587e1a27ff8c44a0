"""What determines the built-in model's trained weights (``scripts/train_tiny.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Everything that determines the trained weights (besides the Python version's stdlib)."""

    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 30
    draft_kind: str = "eagle3"  # or "eagle" (EAGLE-1/2: the target's final state as feature)
    draft_prompts: int = 2048  # greedy continuations generated for the draft's data
    draft_prompt_len: int = 32
    draft_new_tokens: int = 96
    draft_steps: int = 2000
    draft_batch: int = 16
    draft_lr: float = 3e-3
    # EAGLE-1/2 only
    feature_weight: float = 0.5  # smooth-L1 regression of draft features onto target features
    unroll_weight: float = 0.5  # loss of the second pass that sees the draft's own features
    # EAGLE-3 only (scripts/tiny_eagle3.py)
    draft_vocab_size: int = 512  # the target tokens the draft can propose
    draft_layers: tuple[int, int, int] = (1, 3, 6)  # the target layers the draft fuses
    draft_passes: int = 4  # unrolled passes per step (the draft fed its own features)
    draft_pass_decay: float = 0.8  # pass j's loss weighs decay ** j
    threads: int = 1  # the same count reproduces the same weights
    bf16_autocast: bool = False  # CPU bf16 matmuls; measured slower than float32 here


@dataclass(frozen=True)
class HybridSettings(Settings):
    """What determines the hybrid sibling's weights (``scripts/train_tiny_hybrid.py``): a
    Qwen3.5-shaped text model (Gated DeltaNet layers, a gated full-attention layer every
    ``full_attention_interval``) and its MTP head. The inherited EAGLE-only fields are unused."""

    hidden_size: int = 128
    num_layers: int = 6
    intermediate_size: int = 384
    head_dim: int = 32
    full_attention_interval: int = 3  # layers 2, 5, ... are full attention, the rest linear
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel: int = 4
    steps: int = 1000
    draft_kind: str = "mtp"
    draft_prompts: int = 1024
    draft_steps: int = 1500
    mtp_passes: int = 3  # unrolled passes per step (pass j: chain step j + 1 of a K-token draft)
    mtp_pass_decay: float = 0.8  # pass j's loss weighs decay ** j
