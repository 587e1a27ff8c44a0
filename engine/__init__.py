"""Everything that turns tokens (and images) into KV and logits, shared by every node kind: configs,
the model, the paged KV pool and page allocator, attention, the scheduler core, sampling, the
tokenizer and image processor, checkpoints, and the in-process :class:`engine.llm_engine.LLMEngine`.
Imports no networking and no other package of the repository."""
