"""The scheduler core: the request model, the scheduler, the page allocator and the prefix cache,
in pure Python (no torch; from the rest of the engine only errors and config)."""
