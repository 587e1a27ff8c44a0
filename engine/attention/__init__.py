"""Attention over the paged KV pool: the backend interface and its torch reference
(``backend``), the Triton backend and its kernels (``kernels/``), and which backend a pool gets
(``select``)."""
