"""EAGLE drafts: the EAGLE-1/2 head and its config (``draft``), the EAGLE-3 head (``eagle3``),
the checkpoint layouts they are read from (``layouts``, ``eagle3_layout``, ``sglang_layout``)
and the loader that picks one (``loader``)."""
