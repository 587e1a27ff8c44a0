"""Multimodal inputs: the prompt state the runner consumes (``inputs``), the image and video
processors (numpy only), mrope and the rope index, and the visual content digests of the prefix
cache's keys."""
