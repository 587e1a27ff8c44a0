"""Moving KV between prefill and decode nodes.

At the top, one job each: :mod:`~transfer.base` (the :class:`~transfer.base.KVManager`
contract), :mod:`~transfer.errors` (error types), :mod:`~transfer.status` (ordered transfer
status), :mod:`~transfer.aux` (aux rows), :mod:`~transfer.faults` (built-in fault injection, off
by default) and :mod:`~transfer.setup` (building a node's manager). The sub-rooms:
:mod:`transfer.backends` (Mooncake and Ascend managers, the engine import, registered memory),
:mod:`transfer.bootstrap` (the P/D handshake, its messages and framing), :mod:`transfer.plan`
(layer-id, head-slice and block pairing) and :mod:`transfer.tp` (tensor-parallel nodes).
"""
