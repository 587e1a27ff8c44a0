"""The model families, one sub-package each (``qwen2_vl/``: Qwen2-VL and Qwen2.5-VL, decoder and
vision towers; ``eagle/``: the EAGLE-1/2/3 drafts and their checkpoint layouts), and the small
layers they share (``layers``). No model imports the runner."""
