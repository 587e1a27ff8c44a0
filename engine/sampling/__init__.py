"""Sampling: the sampler (greedy, temperature, top-k, top-p, min-p), the penalties on raw logits,
and a checkpoint's ``generation_config.json`` defaults."""
