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

from duet.engine.backend import MAX_ROWS


class KVCache:
    """Keys and values [kv_heads, capacity, head_dim], grown by doubling as tokens arrive."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int = 256):
        self.keys = np.zeros((kv_heads, capacity, head_dim), np.float32)
        self.values = np.zeros_like(self.keys)
        self.length = 0

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Add [kv_heads, T, head_dim] rows."""
        end = self.length + keys.shape[1]
        self.reserve(end)
        self.keys[:, self.length:end] = keys
        self.values[:, self.length:end] = values
        self.length = end

    def reserve(self, end: int) -> None:
        """Room for rows [0, end): a kernel may then write rows in place."""
        if end > self.keys.shape[1]:
            self._grow(end)

    def rows(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of rows [0, end) as a query whose last visible row is end - 1 reads them."""
        return self.keys[:, :end], self.values[:, :end]

    def rows_at(self, indices: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
        """rows(end) at the given rows alone (each < end): what a sparse (QSA) query reads."""
        return self.keys[:, indices], self.values[:, indices]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.keys.shape[1])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], capacity, old.shape[2]), np.float32)
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)


class Q4KVCache:
    """4-bit KV cache: rows rotated by a Walsh-Hadamard transform with random signs, then 4-bit
    symmetric codes with an fp16 scale per Q4_GROUP values. The first SINK_ROWS rows and the
    RECENT_ROWS rows before each query stay exact.

    Layout per row and KV head: codes uint8 [head_dim / 2] (value 2i in the low nibble, 2i + 1 in
    the high one, each stored + 8), scales fp16 [head_dim / Q4_GROUP]. The rotation spreads outlier
    channels over the whole head so one group scale fits them all; it is orthonormal, so a
    dequantized row is rotated back before attention reads it.
    """

    def __init__(self, kv_heads: int, head_dim: int, seed: int = 0):
        if head_dim & (head_dim - 1) or head_dim % Q4_GROUP:
            raise ValueError(f"q4 KV needs a power-of-two head_dim divisible by {Q4_GROUP}")
        # Symmetric and orthonormal; float32, as the rows: np.sqrt's float64 scalar made it float64, and
        # with it every dequantized row and the model's hidden state after the first q4 attention layer.
        self.hadamard = (hadamard(head_dim) / np.sqrt(head_dim)).astype(np.float32)
        self.signs = np.random.default_rng(seed).choice([-1.0, 1.0], head_dim).astype(np.float32)
        self.codes = np.zeros((kv_heads, 0, head_dim // 2, 2), np.uint8)
        self.scales = np.zeros((kv_heads, 0, head_dim // Q4_GROUP, 2), np.float16)
        # Exact rows: the sink, and a ring of the latest RECENT_ROWS + MAX_ROWS rows, enough for
        # any query of a verify pass and for a rollback of one.
        self.sink = np.zeros((kv_heads, SINK_ROWS, head_dim, 2), np.float32)
        self.ring = np.zeros((kv_heads, RECENT_ROWS + MAX_ROWS, head_dim, 2), np.float32)
        self.length = 0

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:
        rows = np.stack([keys, values], axis=-1)  # [kv, T, hd, 2]: key and value side by side
        start, end = self.length, self.length + rows.shape[1]
        codes, scales = quantize_q4((rows.transpose(0, 1, 3, 2) * self.signs) @ self.hadamard)
        self.codes = _grow_rows(self.codes, start, end)
        self.scales = _grow_rows(self.scales, start, end)
        self.codes[:, start:end] = codes.transpose(0, 1, 3, 2)
        self.scales[:, start:end] = scales.transpose(0, 1, 3, 2)
        positions = np.arange(start, end)
        latest = slice(-self.ring.shape[1], None)  # a long prefill only needs its last ring's worth
        self.ring[:, positions[latest] % self.ring.shape[1]] = rows[:, latest]
        in_sink = positions < SINK_ROWS
        self.sink[:, positions[in_sink]] = rows[:, in_sink]
        self.length = end

    def rows(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        exact_from = max(SINK_ROWS, end - RECENT_ROWS)
        sink = self.sink[:, : min(end, SINK_ROWS)]
        middle = self._dequantize(slice(SINK_ROWS, max(SINK_ROWS, exact_from)))
        recent = self.ring[:, np.arange(exact_from, end) % self.ring.shape[1]]
        both = np.concatenate([sink, middle, recent], axis=1)
        return both[..., 0], both[..., 1]

    def rows_at(self, indices: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
        """rows(end) at the given rows alone (each < end), dequantizing only those: a sparse (QSA)
        query reads a budget of rows, where rows(end) would dequantize the whole history per query."""
        indices = np.asarray(indices)
        exact_from = max(SINK_ROWS, end - RECENT_ROWS)
        sink, recent = indices < SINK_ROWS, indices >= exact_from
        coded = ~(sink | recent)
        both = np.empty((self.sink.shape[0], len(indices), *self.sink.shape[2:]), np.float32)
        both[:, sink] = self.sink[:, indices[sink]]
        both[:, recent] = self.ring[:, indices[recent] % self.ring.shape[1]]
        both[:, coded] = self._dequantize(indices[coded])
        return both[..., 0], both[..., 1]

    def _dequantize(self, rows: slice | np.ndarray) -> np.ndarray:
        """The 4-bit images of cache rows `rows` (a slice or indices), [kv, n, head_dim, 2]."""
        codes = self.codes[:, rows].transpose(0, 1, 3, 2)
        if not codes.shape[1]:
            return np.zeros((self.codes.shape[0], 0, self.sink.shape[2], 2), np.float32)
        scales = self.scales[:, rows].transpose(0, 1, 3, 2)
        rotated = dequantize_q4(codes, scales)
        return ((rotated @ self.hadamard) * self.signs).transpose(0, 1, 3, 2)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


SINK_ROWS = 4  # the first tokens draw attention far beyond their content; keep them exact
RECENT_ROWS = 128  # the latest rows carry most of the attention mass; keep them exact
Q4_GROUP = 32  # values per fp16 scale along head_dim


def hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order n (a power of two), entries +-1."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def quantize_q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., hd] -> codes uint8 [..., hd / 2] (pairs of nibbles, +8) and fp16 scales [..., hd / Q4_GROUP]."""
    groups = x.reshape(*x.shape[:-1], -1, Q4_GROUP)
    scales = (np.abs(groups).max(axis=-1) / 7.0).astype(np.float16)
    safe = np.where(scales == 0, 1.0, scales.astype(np.float32))[..., None]
    levels = np.clip(np.rint(groups / safe), -7, 7).astype(np.int8).reshape(x.shape) + 8
    codes = (levels[..., 0::2] | (levels[..., 1::2] << 4)).astype(np.uint8)
    return codes, scales


def dequantize_q4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    levels = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1).astype(np.float32) - 8
    groups = levels.reshape(*levels.shape[:-1], -1, Q4_GROUP) * scales.astype(np.float32)[..., None]
    return groups.reshape(levels.shape)


def _grow_rows(array: np.ndarray, start: int, end: int) -> np.ndarray:
    """Keep rows [0, start) and make room up to `end` (capacity doubles)."""
    if end <= array.shape[1]:
        return array
    grown = np.zeros((array.shape[0], max(end, 2 * array.shape[1]), *array.shape[2:]), array.dtype)
    grown[:, :start] = array[:, :start]
    return grown


class DeltaNetState:
    """Causal-conv history [kernel - 1, channels] and recurrent state [Hv, dk, dv].

    A row-by-row call (a decode step or a verify pass) leaves what a rollback needs: its conv inputs,
    the recurrent state before it (`prior`) and each row's inputs to the rule (`row_inputs`: k, v,
    beta and e^g of every row), which `replay` (the rule the call ran) applies to `prior` again. A
    copy of the state after every row was T states written a call: at the 0.8B geometry's 1 MB a
    layer, 4 MB a layer for a 4-row verify pass; this writes one."""

    def __init__(self, channels: int, kernel: int, value_heads: int, key_dim: int, value_dim: int):
        self.conv = np.zeros((kernel - 1, channels), np.float32)
        self.recurrent = np.zeros((value_heads, key_dim, value_dim), np.float32)
        # From the last row-by-row call: conv inputs [kernel - 1 + T, C], S before it, each row's inputs.
        self.window: np.ndarray | None = None
        self.prior: np.ndarray | None = None
        self.row_inputs: tuple = ()
        self.replay = None

    def ran_rows(self, prior: np.ndarray, row_inputs: tuple, replay) -> None:
        """Note what a row-by-row call started from and fed the rule: prior [Hv, dk, dv]; row_inputs
        (k [T, Hv, dk], v [T, Hv, dv], beta [T, Hv], decay = e^g [T, Hv]); replay(prior, row_inputs,
        rows) -> the state after the first `rows` rows, bit for bit as the call computed it. A call of
        one row keeps no prior (a rollback keeps at least a row): a decode step holds one state, not two."""
        self.prior = prior if len(row_inputs[0]) > 1 else None
        self.row_inputs, self.replay = row_inputs, replay

    def keep(self, rows: int) -> None:
        """Make the state after the first `rows` rows of the last call current."""
        kernel_minus_1 = self.conv.shape[0]
        self.conv = self.window[rows : rows + kernel_minus_1].copy()
        if rows < len(self.row_inputs[0]):
            self.recurrent = self.replay(self.prior, self.row_inputs, rows)

    def saved(self) -> tuple:
        """A copy of the state as it is now, for restore (SequenceState.checkpoint)."""
        return self.conv.copy(), self.recurrent.copy()

    def restore(self, saved: tuple) -> None:
        self.conv, self.recurrent = saved


class IndexedKVCache:
    """A QSA layer's cache (Flash-Next): its keys and values (`kv`, full or q4) and the indexer's raw keys
    [length, d]; every complete block of `ratio` raw keys is also kept pooled (mean, normed, rotated to
    the block's first position), made once, when the block completes. Buffers grow by doubling."""

    def __init__(self, kv, index_dim: int, ratio: int):
        self.kv, self.ratio = kv, ratio
        self._raw = np.zeros((256, index_dim), np.float32)
        self._blocks = np.zeros((256 // ratio + 1, index_dim), np.float32)
        self.done_blocks = 0

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def raw(self) -> np.ndarray:
        return self._raw[: self.length]

    @property
    def blocks(self) -> np.ndarray:
        """Pooled keys of the complete blocks [length // ratio, d]."""
        return self._blocks[: self.done_blocks]

    def append_index_keys(self, raw: np.ndarray, pool) -> None:
        """Raw index keys [T, d] of the rows just appended to kv; pool(first_block, raw_blocks
        [n, ratio, d]) -> pooled keys [n, d] for the blocks they complete."""
        end = self.length
        self._raw = _grow_to(self._raw, end)
        self._raw[end - raw.shape[0] : end] = raw
        complete = end // self.ratio
        if complete > self.done_blocks:
            done = self.done_blocks
            new = self._raw[done * self.ratio : complete * self.ratio].reshape(complete - done, self.ratio, -1)
            self._blocks = _grow_to(self._blocks, complete)
            self._blocks[done:complete] = pool(done, new)
            self.done_blocks = complete

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)
        self.done_blocks = min(self.done_blocks, self.kv.length // self.ratio)


def _grow_to(array: np.ndarray, rows: int) -> np.ndarray:
    """array with room for `rows` rows along axis 0 (capacity doubles), its rows kept."""
    if rows <= array.shape[0]:
        return array
    grown = np.zeros((max(rows, 2 * array.shape[0]), *array.shape[1:]), array.dtype)
    grown[: array.shape[0]] = array
    return grown


class PLEState:
    """A PLE layer's history (Flash-Next): the last ngram_size - 1 token ids (EOS before the first) and the
    last (kernel - 1) * dilation inputs of its dilated conv. A short call keeps its whole windows so
    keep(n) can make the state after its first n rows current. The ids stay on the host (the n-gram rows
    are gathered there); the conv inputs live where the op set computes (numpy, or the GPU's device)."""

    def __init__(self, context: int, eos: int, conv_rows: int, channels: int, zeros=np.zeros):
        self.tokens = np.full(context, eos, np.int64)
        self.conv = zeros((conv_rows, channels), np.float32)  # zeros: numpy's, or the GPU op set's (cupy.zeros)
        self.token_window: np.ndarray | None = None  # [context + T] ids of the last short call
        self.conv_window: np.ndarray | None = None  # [conv_rows + T, channels]

    def keep(self, rows: int) -> None:
        self.tokens = self.token_window[rows : rows + len(self.tokens)].copy()
        self.conv = self.conv_window[rows : rows + self.conv.shape[0]].copy()

    def saved(self) -> tuple:
        return self.tokens.copy(), self.conv.copy()

    def restore(self, saved: tuple) -> None:
        self.tokens, self.conv = saved


class WithPLE:
    """A DeltaNet layer's state and its PLE's, rolled back together."""

    def __init__(self, mixer: DeltaNetState, ple: PLEState):
        self.mixer, self.ple = mixer, ple

    def keep(self, rows: int) -> None:
        self.mixer.keep(rows)
        self.ple.keep(rows)

    def saved(self) -> tuple:
        return self.mixer.saved(), self.ple.saved()

    def restore(self, saved: tuple) -> None:
        self.mixer.restore(saved[0])
        self.ple.restore(saved[1])


ATTENTION = (KVCache, Q4KVCache, IndexedKVCache)  # caches a rollback cuts back by their length


class SequenceState:
    """Everything one sequence needs to continue: a cache per layer and the token count."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
        self.length_before_last_call = 0

    def advance(self, T: int) -> None:
        """T more tokens were run (their rows are in the caches)."""
        self.length_before_last_call = self.length
        self.length += T

    def keep(self, rows: int) -> None:
        """Roll back the last (row-by-row) call to its first `rows` rows."""
        end = self.length_before_last_call + rows
        for cache in self.layers:
            if isinstance(cache, ATTENTION):
                cache.truncate(end)
            else:
                cache.keep(rows)
        self.length = end

    def rewind(self, length: int) -> None:
        """Cut an attention-only state (the MTP head's) back to `length` tokens."""
        assert all(isinstance(cache, ATTENTION) for cache in self.layers)
        for cache in self.layers:
            cache.truncate(length)
        self.length = length

    def checkpoint(self) -> tuple:
        """What restore needs to bring this state back to now, however far it runs on: the length
        (attention caches are cut back to it) and a copy of every other layer's state."""
        return self.length, [None if isinstance(cache, ATTENTION) else cache.saved() for cache in self.layers]

    def restore(self, checkpoint: tuple) -> None:
        """Make the state a checkpoint of this state saw current again (once: the copies are taken over)."""
        self.length, saved = checkpoint
        for cache, copy in zip(self.layers, saved):
            if copy is None:
                cache.truncate(self.length)
            else:
                cache.restore(copy)
        self.length_before_last_call = self.length
