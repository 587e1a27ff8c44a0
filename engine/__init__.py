"""Everything that turns tokens (and images and videos) into KV and logits, shared by every node
kind, in sub-rooms by job: :mod:`engine.core` (scheduler core), :mod:`engine.kv` (KV pool),
:mod:`engine.attention`, :mod:`engine.runner`, :mod:`engine.sampling`, :mod:`engine.multimodal`,
:mod:`engine.text`, :mod:`engine.parallel` (tensor parallelism), :mod:`engine.models` and
:mod:`engine.builtin` (the tiny model). At the top only what every sub-room shares (config,
device, errors, checkpoint reading) and the in-process :class:`engine.llm_engine.LLMEngine`.
Imports no networking and no other package of the repository."""
