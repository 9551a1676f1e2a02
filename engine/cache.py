"""Per-sequence state the model carries between calls.

Full-attention layers keep a KV cache; DeltaNet layers keep the last (kernel - 1) conv inputs and
the recurrent state S [Hv, dk, dv] in fp32. `length` is the number of tokens already processed,
so the next token's position.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys and values [kv_heads, capacity, head_dim], grown by doubling as tokens arrive."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256):
        self.keys = np.zeros((kv_heads, capacity, head_dim), np.float32)
        self.values = np.zeros_like(self.keys)
        self.length = 0

    def append(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add [kv_heads, T, head_dim] rows; return views of all rows so far."""
        end = self.length + keys.shape[1]
        if end > self.keys.shape[1]:
            self._grow(end)
        self.keys[:, self.length:end] = keys
        self.values[:, self.length:end] = values
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[1])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], capacity, old.shape[2]), np.float32)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)


class DeltaNetState:
    """Causal-conv history [kernel - 1, channels] and recurrent state [Hv, dk, dv]."""

    def __init__(self, channels: int, kernel: int, value_heads: int, key_dim: int, value_dim: int):
        self.conv = np.zeros((kernel - 1, channels), np.float32)
        self.recurrent = np.zeros((value_heads, key_dim, value_dim), np.float32)


class SequenceState:
    """Everything one sequence needs to continue: a cache per layer and the token count."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
