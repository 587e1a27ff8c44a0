"""Benchmarks: a library that ``pdserve bench`` and the scripts here share, and the scripts.

Library: :mod:`bench.loadgen` (workloads, arrivals, traces, the report), :mod:`bench.clusters`
(starting clusters on loopback), :mod:`bench.compare` (the ``--compare`` runner),
:mod:`bench.hf_baseline` (transformers' ``generate`` on the same requests), :mod:`bench.plot`.

Scripts, run from the repository root as ``python -m bench.NAME``: ``engine`` (engine vs
transformers), ``transfer`` (``send_kvcache`` vs the raw engine vs memcpy), ``serving``
(disaggregated vs colocated), ``spec`` (EAGLE on vs off), ``hf_generate`` (the baseline alone),
``qwen3_5_generate`` (Qwen3.5 vs transformers), ``hybrid_transfer`` (one request's bytes and
transfer time, a hybrid model vs a full-attention model of the same shape),
``hybrid_prefix_cache`` (a hybrid model's prefix cache on vs off), ``mtp_verify`` (a hybrid
verify keeping every row's linear-attention state vs replaying the accepted rows).
Each prints ratios against a baseline measured in the same run.
"""
