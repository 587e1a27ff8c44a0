"""The Qwen3-VL family: the vision tower (shared with Qwen3.5) and the decoder."""
