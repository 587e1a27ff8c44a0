"""Moving KV between prefill and decode nodes.

Modules, one job each: :mod:`errors` (error types), :mod:`status` (ordered transfer status),
:mod:`messages` (typed msgpack messages of the P/D boundary), :mod:`wire` (framing on a socket),
:mod:`layers` (layer-id pairing), :mod:`blocks` (contiguous runs and engine batches),
:mod:`aux` (aux rows), :mod:`memory` (where registered memory lives and which engine build
registers it), :mod:`base` (the :class:`~transfer.base.KVManager` contract), :mod:`faults`
(built-in fault injection, off by default),
:mod:`engine_import` (loading the Mooncake engine, with an error naming the fix),
:mod:`mooncake` and :mod:`ascend` (backends), :mod:`bootstrap`, :mod:`bootstrap_prefill` and
:mod:`bootstrap_decode` (the handshake).
"""
