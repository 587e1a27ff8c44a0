"""Pairing plans of a transfer, pure logic: layer ids (``layers``), head slices between sides of
different TP size (``heads``), contiguous runs and blocks of pages (``blocks``, ``head_blocks``)."""
