"""numpy linear layers. Every route's Linear takes x [T, K] and returns x @ W^T [T, N] in fp32."""

from __future__ import annotations

import numpy as np

# Up to this many rows (a decode step, or a speculative verify of 1 + drafts) each row is its own
# matrix-vector product, so a row's result does not depend on how many rows came with it: a
# verify row is bit-identical to the one-row decode step it stands for, and drafts can never flip
# a greedy token on a near-tie. Longer inputs (prefill) take one matrix-matrix product.
ROWWISE_MAX = 16


class DenseLinear:
    """Unquantized weight [N, K] held in fp32 (the `bf16` route: bf16/fp16 checkpoints widened once)."""

    route = "bf16"

    def __init__(self, weight: np.ndarray):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # BLAS reads W^T through the transposed view; no copy of the weight is made.
        if x.shape[0] <= ROWWISE_MAX:
            return np.stack([row @ self.weight.T for row in x])
        return x @ self.weight.T
