"""EAGLE speculative decoding on decode nodes: draft, verify, accept, draft-extend.

``graph_buffers`` holds the persistent static buffers of the verify / draft-extend forwards, and
``fill`` refreshes them before every replay (Triton on CUDA, native PyTorch on CPU and NPU).
"""
