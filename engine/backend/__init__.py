"""Op sets that run the model's matrix products; `cpu` is numpy and the numerics reference."""

# The most token rows a short call carries: a decode step, or a speculative verify of the last
# token and up to 15 drafts. Up to this many rows the CPU computes each row as its own
# matrix-vector product, so a verify row is bit-identical to the one-row decode step it stands for
# and drafts can never flip a greedy token on a near-tie; the GPU's GEMV kernels take this many
# rows per weight read. Longer calls (prefill) take matrix-matrix products (CPU) or run in slices
# of this many rows (GPU).
MAX_ROWS = 16
