"""Per-sequence state the model carries between calls, and how a verify pass rolls it back.

Full-attention layers keep a KV cache; DeltaNet layers keep the last (kernel - 1) conv inputs and
the recurrent state S [Hv, dk, dv] in fp32. `length` is the number of tokens already processed,
so the next token's position.

A short call (a decode step or a speculative verify of 1 + k rows) keeps the DeltaNet state after
every row, so `keep(n)` can make the state after row n current: the KV cache is cut back and the
DeltaNet/conv state is the one the first n rows produced, exactly as if only they had been run.
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

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

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
        # From the last row-by-row call: conv inputs [kernel - 1 + T, C] and S after each row.
        self.window: np.ndarray | None = None
        self.row_states: list[np.ndarray] = []

    def keep(self, rows: int) -> None:
        """Make the state after the first `rows` rows of the last call current."""
        kernel_minus_1 = self.conv.shape[0]
        self.conv = self.window[rows : rows + kernel_minus_1].copy()
        self.recurrent = self.row_states[rows - 1]


class SequenceState:
    """Everything one sequence needs to continue: a cache per layer and the token count."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
        self.length_before_last_call = 0

    def keep(self, rows: int) -> None:
        """Roll back the last (row-by-row) call to its first `rows` rows."""
        end = self.length_before_last_call + rows
        for cache in self.layers:
            if isinstance(cache, KVCache):
                cache.truncate(end)
            else:
                cache.keep(rows)
        self.length = end

    def rewind(self, length: int) -> None:
        """Cut an attention-only state (the MTP head's) back to `length` tokens."""
        assert all(isinstance(cache, KVCache) for cache in self.layers)
        for cache in self.layers:
            cache.truncate(length)
        self.length = length
