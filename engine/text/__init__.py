"""Text: the tokenizer (on the ``tokenizers`` library), the built-in ChatML format and the
checkpoint's chat template, compiled in a sandbox."""
