"""Tensor parallelism: the group and its collectives (``group``), which slice of the model a rank
holds (``shard``), rank 0's driver of the other ranks (``driver``), their processes (``rank``)
and what they say to each other (``messages``)."""
