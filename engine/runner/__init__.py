"""The model runner: one scheduler step into one forward (``model_runner``), the persistent
input batch, static-buffer decode forwards and their CUDA graphs, and the EAGLE draft beside a
target (``draft_runner``)."""
