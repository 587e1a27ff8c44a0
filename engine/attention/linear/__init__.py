"""Linear-attention kernels: the causal depthwise conv and the gated delta rule over flat varlen
batches, a torch reference and the CUDA libraries (flash-linear-attention, causal-conv1d) behind
one interface (``select``).

Every kernel reads a forward's tokens concatenated (sequence ``b`` owns rows
``q_starts[b]:q_starts[b + 1]``) and keeps each sequence's state in its slot of a state pool
(``engine.kv.state_pool``), updated in place, so a prompt may come in chunks and decode rows may
share a forward with them. Modules: ``varlen`` (sorting a batch into one-token rows and longer
sequences), ``conv`` and ``delta_rule`` (the torch reference), ``norm`` (the gated RMS norm after
the rule), ``libraries`` (the CUDA libraries behind the same interface), ``select`` (which
implementation a device gets), ``states`` (one forward's view of the state pool).
"""
