"""Accelerator kernels of the engine (Triton). Nothing on the CPU path imports this package's
modules: each needs ``triton`` and runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (set before the module is imported), as the tests do."""
