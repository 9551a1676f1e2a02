"""Weight and activation codecs: the W4 group layout, GGUF blocks, int8/bf16 activation rounding."""
