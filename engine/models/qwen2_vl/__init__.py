"""Qwen2-VL and Qwen2.5-VL: the mrope decoder and conditional-generation model (``model``) and
the two vision towers (``vision``, ``vision_qwen2_5``)."""
