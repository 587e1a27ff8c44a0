"""Transfers of tensor-parallel nodes: the staging and landing buffers of head-sliced sends and
their pipelined send (``staging``, ``staged_send``), and the agents that let rank 0 drive the
other ranks' sends (``local_agent``, ``rank_agent``)."""
