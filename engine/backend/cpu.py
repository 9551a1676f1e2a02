"""numpy linear layers. Every route's Linear takes x [T, K] and returns x @ W^T [T, N] in fp32."""

from __future__ import annotations

import numpy as np


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
        return x @ self.weight.T
