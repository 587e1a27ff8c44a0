"""The Qwen3.5 family: a hybrid decoder of Gated DeltaNet linear-attention layers and gated
full-attention layers, over the Qwen3-VL vision tower (without DeepStack)."""
