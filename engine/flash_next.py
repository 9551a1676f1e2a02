"""Flash-Next (`qwen4_exp`): the hybrid model with hyper-connections, hashed n-gram embeddings and
QSA indexed attention. Math: REFERENCE.md section 7; transformers' `modular_qwen4_exp.py` is the oracle.

What it adds to engine/model.py's layers, which it reuses (DeltaNet, MoE, the gated attention's
projections and norms):
- The residual is `hc` streams, [T, hc * H]. Before each token mixer and each MoE a hyper-connection
  norms every stream, mixes them into the block's input and weighs the block's output back into each
  stream; a last one, with no injection, mixes the streams for the head in place of the final norm.
- PLE (some DeltaNet layers): each token's 2..n-grams hashed into rows of a huge table (a host table,
  read a few rows a token), gated per stream, then a dilated depthwise conv, added to every stream.
- QSA: the full-attention layers read, per query, the top blocks of tokens an indexer scores (block
  keys pooled over `ratio` tokens) plus the incomplete tail: about `indexer_budget` rows, not all.
Every row of a short call (decode, verify) is computed as its own decode step would, so a verify pass
rolls back exactly (engine/cache.py: IndexedKVCache, PLEState).

One model definition for both backends: the layers below hold Linears and vectors and ask their op
set (`ops`) for Flash-Next's steps, as engine/model.py's layers ask for attention and DeltaNet cores:
silu_div, hc_mix, hc_inject, ple_gate, ple_conv, indexed_attention and the two caches.
FlashCpuOps here is the numpy op set with those steps, the numerics reference; the GPU op set
(engine/backend/cupy_model.GpuOps) runs them as CUDA kernels (engine/kernels/flash_next.cu, and
attention.cu's sparse partials). The n-gram table stays a host table on both: its rows are gathered
on the host, and only the gathered rows [T, heads * D] go to the op set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duet.engine.backend import MAX_ROWS
from duet.engine.backend.cpu_ops import CpuOps, apply_rope, attend, rope_tables, sigmoid, silu
from duet.engine.cache import IndexedKVCache, PLEState, WithPLE
from duet.engine.choices import KVCache
from duet.engine.config import ModelConfig
from duet.engine.model import Attention, DeltaNet, Model, MoE
from duet.engine.weights import ShardedRows


def stream_norm(ops, x, weight, hc: int, eps: float):
    """x [T, hc * H] normed over each stream's H values with its slice of weight [hc * H]: [T, hc * H]
    (either op set's rms_norm takes a weight row per stream)."""
    T = x.shape[0]
    return ops.rms_norm(x.reshape(T, hc, -1), weight.reshape(hc, -1), eps).reshape(T, -1)


@dataclass
class HyperConnection:
    """Streams [T, hc * H] -> the block's input [T, H] and each stream's injection logits [T, hc]."""

    norm: np.ndarray  # 1 + w, [hc * H]: an RMSNorm over each stream's H values
    down: object  # Linear [lowrank, hc * H]
    up: object  # Linear [hc * H, lowrank]
    inject: object | None  # Linear [hc, hc * H]; None in the head's mixer
    hc: int
    eps: float
    ops: object

    def __call__(self, streams):
        ops = self.ops
        normed = stream_norm(ops, streams, self.norm, self.hc, self.eps)  # [T, hc * H]
        mixed = ops.hc_mix(normed, self.up(ops.silu_div(self.down(normed), self.hc)), self.hc)  # [T, H]
        return mixed, None if self.inject is None else self.inject(normed)


@dataclass
class NGramHash:
    """One PLE layer's hashed n-gram rows. For n = 2..N, head j of that order looks up row
    offset_j + (XOR over i < n of c_i * multiplier_i) mod size_j, where c_0 is the token and c_i the
    one i back, or EOS when that is before the sequence or across an EOS (sizes are primes)."""

    table: ShardedRows  # [rows, D]: HF shards, or a GGUF file's one table (fp32 or its blocks)
    multipliers: np.ndarray  # int64 [N]
    sizes: np.ndarray  # int64 [heads], heads = (N - 1) * heads_per_ngram
    offsets: np.ndarray  # int64 [heads]
    heads_per_ngram: int
    eos: int

    def rows(self, history: np.ndarray, T: int) -> np.ndarray:
        """Row ids [T, heads] for the last T tokens of history (N - 1 earlier tokens, then the T)."""
        N = len(self.multipliers)
        context = history.shape[0] - T  # N - 1
        tokens = history[context:]
        mixed = tokens * self.multipliers[0]  # int64; a product past 2^63 wraps, as in torch
        whole = np.ones(T, bool)  # no EOS yet between the token and the one i back
        per_order = []
        for i in range(1, N):
            back = history[context - i : context - i + T]
            c = np.where(whole, back, self.eos)
            whole &= back != self.eos
            mixed = mixed ^ (c * self.multipliers[i])
            heads = slice((i - 1) * self.heads_per_ngram, i * self.heads_per_ngram)  # the (i + 1)-grams
            per_order.append(np.remainder(mixed[:, None], self.sizes[heads]) + self.offsets[heads])
        return np.concatenate(per_order, axis=1)

    def __call__(self, history: np.ndarray, T: int) -> np.ndarray:
        """The concatenated heads' rows [T, heads * D], gathered on the host where the table lives."""
        return self.table[self.rows(history, T)].reshape(T, -1)


@dataclass
class PLE:
    """Per-layer n-gram embedding: key per stream and one value from the n-gram rows; a sign-sqrt gate
    of key against the normed stream weighs the value into each stream; plus a dilated causal conv
    (dilation N) of the normed gated values, through SiLU."""

    ngrams: NGramHash
    key_proj: object  # Linear [hc * H, P]
    value_proj: object  # Linear [H, P]
    norm_key: np.ndarray  # 1 + w, [hc * H] (per stream)
    norm_query: np.ndarray
    norm_conv: np.ndarray
    conv: np.ndarray  # depthwise taps [hc * H, K], oldest first
    dilation: int
    hc: int
    eps: float
    ops: object

    def new_state(self) -> PLEState:
        context = len(self.ngrams.multipliers) - 1
        return self.ops.ple_state(context, self.ngrams.eos, (self.conv.shape[1] - 1) * self.dilation, self.conv.shape[0])

    def __call__(self, streams, ids: np.ndarray, state: PLEState):
        """What the n-grams add to every stream [T, hc * H]; ids [T] on the host."""
        T, ops = streams.shape[0], self.ops
        history = np.concatenate([state.tokens, ids])
        embedded = ops.to_device(self.ngrams(history, T))  # [T, P]
        key = stream_norm(ops, self.key_proj(embedded), self.norm_key, self.hc, self.eps)  # [T, hc * H]
        query = stream_norm(ops, streams, self.norm_query, self.hc, self.eps)
        gated = ops.ple_gate(key, query, self.value_proj(embedded), self.hc)  # [T, hc * H]
        normed = stream_norm(ops, gated, self.norm_conv, self.hc, self.eps)
        out = ops.ple_conv(gated, normed, self.conv, self.dilation, state)
        state.token_window = history if T <= MAX_ROWS else None  # a decode or verify call keeps it for a rollback
        state.tokens = history[T:].copy()
        return out


@dataclass
class Indexer:
    """QSA's token selection: indexer queries (heads) against pooled block keys (one key head)."""

    qk_proj: object  # Linear [(heads + 1) * d, H]: queries then the key
    q_norm: np.ndarray  # 1 + w, [d]
    k_norm: np.ndarray
    heads: int
    ratio: int  # tokens a block pools
    top_blocks: int  # indexer_budget / ratio
    config: ModelConfig
    ops: object


@dataclass
class IndexedAttention:
    """Gated attention (engine/model.Attention's projections and norms) over the tokens QSA selects."""

    attention: Attention
    indexer: Indexer

    def new_cache(self, kv: str = KVCache.BF16):
        return self.indexer.ops.indexed_cache(self.attention.new_cache(kv), self.indexer.q_norm.shape[0],
                                              self.indexer.ratio)

    def __call__(self, x, cache, pos, last_only: bool = False):
        a = self.attention
        first = x.shape[0] - 1 if last_only else 0  # rows [first, T) are the ones whose output is returned
        return a.o_proj(a.ops.indexed_attention(self, a.qkv_proj(x), self.indexer.qk_proj(x), cache, pos, first))


@dataclass
class FlashLayer:
    mixer: IndexedAttention | DeltaNet
    ffn: MoE
    mixer_hc: HyperConnection
    ffn_hc: HyperConnection
    ops: object
    ple: PLE | None = None

    def new_cache(self, kv: str = KVCache.BF16):
        cache = self.mixer.new_cache(kv)
        return cache if self.ple is None else WithPLE(cache, self.ple.new_state())

    def __call__(self, streams, cache, pos, ids: np.ndarray, last_only: bool = False):
        hc = self.mixer_hc.hc
        if self.ple is not None:
            streams = streams + self.ple(streams, ids, cache.ple)
            cache = cache.mixer
        mixed, inject = self.mixer_hc(streams)
        out = self.mixer(mixed, cache, pos, last_only)
        if last_only:
            streams, inject = streams[-1:], inject[-1:]
        streams = self.ops.hc_inject(streams, out, inject, hc)
        mixed, inject = self.ffn_hc(streams)
        return self.ops.hc_inject(streams, self.ffn(mixed), inject, hc)


@dataclass
class FlashMTPHead:
    """Flash-Next's multi-token prediction: from the trunk's streams at t and x_{t+1}, streams whose
    mixer and the shared head give logits for x_{t+2}. Each stream s enters the layer as
    fc_embedding(norm_e(embed(x_{t+1}))) + fc_hidden(norm_h(h_t)_s) (llama.cpp: eh_proj per stream)."""

    fc_embedding: object  # Linear [H, H]
    fc_hidden: object  # Linear [H, H]
    norm_embedding: np.ndarray  # 1 + w, [H]
    norm_hidden: np.ndarray  # 1 + w, [hc * H] (per stream)
    layer: FlashLayer  # a QSA layer with its own cache, no PLE
    mixer: HyperConnection  # no injection: the streams to the head's input


class FlashNextModel(Model):
    """engine/model.Model with Flash-Next's layers. `forward` returns the streams [T, hc * H] (what the
    MTP head reads); the head mixer (`norm` here: a HyperConnection without injection) turns them into
    the lm_head's input (`head_input`)."""

    def new_state(self, kv: str = KVCache.BF16):
        return self.ops.new_state([layer.new_cache(kv) for layer in self.layers])

    def run_layers(self, x, caches: list, pos, last_only: bool = False, ids: np.ndarray | None = None):
        streams = self.ops.concat([x] * self.config.flash.hc_count, axis=-1)  # [T, hc * H]: every stream the embedding
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            streams = layer(streams, cache, pos, ids, last_only and i == last)
        return streams

    def head_input(self, hidden):
        return self.norm(hidden)[0]

    def draft_head_input(self, hidden):
        return self.mtp.mixer(hidden)[0]

    def mtp_forward(self, state, next_tokens, hidden, last_only: bool = False):
        """The MTP head over rows t (next_tokens[t] = x_{t+1}, hidden[t] = the trunk's streams at t);
        returns its streams, which the next draft step reads as its h (last_only: Model.mtp_forward's)."""
        head, eps, ops, hc = self.mtp, self.config.rms_norm_eps, self.ops, self.config.flash.hc_count
        ids = np.asarray(next_tokens, dtype=np.int64)
        T = len(ids)
        e = head.fc_embedding(ops.rms_norm(self.embed[ids], head.norm_embedding, eps))  # [T, H]
        h = stream_norm(ops, hidden, head.norm_hidden, hc, eps).reshape(T * hc, -1)
        streams = (head.fc_hidden(h).reshape(T, hc, -1) + e[:, None, :]).reshape(T, -1)
        streams = head.layer(streams, state.layers[0], ops.mtp_position(state, T), ids, last_only and ops.LAST_ROW_ALONE)
        state.advance(T)
        return streams[-1:] if last_only else streams


# ------------------------------------------------------------------------- the CPU's steps ---

class FlashCpuOps(CpuOps):
    """The numpy op set with Flash-Next's steps: the numerics reference for them, as CpuOps is for the
    rest (the GPU op set, engine/backend/cupy_model.GpuOps, has the same methods). Positions are ints."""

    # ---- states

    def ple_state(self, context: int, eos: int, conv_rows: int, channels: int) -> PLEState:
        return PLEState(context, eos, conv_rows, channels)

    def indexed_cache(self, kv, index_dim: int, ratio: int) -> IndexedKVCache:
        return IndexedKVCache(kv, index_dim, ratio)

    # ---- hyper-connections

    def silu_div(self, x: np.ndarray, divisor: int) -> np.ndarray:
        """silu(x / divisor): the input mixer's activation between its low-rank projections."""
        return silu(x / divisor)

    def hc_mix(self, normed: np.ndarray, logits: np.ndarray, hc: int) -> np.ndarray:
        """The block's input [T, H]: the mean over streams of sigmoid(logits) * normed (both [T, hc * H])."""
        T = normed.shape[0]
        return (sigmoid(logits) * normed).reshape(T, hc, -1).mean(axis=1)

    def hc_inject(self, streams: np.ndarray, out: np.ndarray, logits: np.ndarray, hc: int) -> np.ndarray:
        """Each stream [T, hc * H] plus the block's output [T, H] times its weight 2 sigmoid(logits / hc), logits [T, hc]."""
        weight = 2 * sigmoid(logits / hc)
        T = weight.shape[0]
        return streams + (weight[:, :, None] * out[:, None, :]).reshape(T, -1)

    # ---- PLE

    def ple_gate(self, key: np.ndarray, query: np.ndarray, value: np.ndarray, hc: int) -> np.ndarray:
        """value [T, H] into each stream, weighed by sigmoid of the sign-sqrt of key . query / sqrt(H)
        over the stream (key, query [T, hc * H], normed): [T, hc * H]."""
        T, H = value.shape
        gate = (key * query).reshape(T, hc, H).sum(axis=-1) / np.float32(np.sqrt(H))  # [T, hc]
        gate = np.sqrt(np.maximum(np.abs(gate), 1e-6)) * np.sign(gate)
        return (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(T, -1)

    def ple_conv(self, gated: np.ndarray, normed: np.ndarray, taps: np.ndarray, dilation: int, state: PLEState) -> np.ndarray:
        """gated + silu of the dilated causal conv of normed [T, C] (taps [C, K], tap k reads the input
        (K - 1 - k) * dilation rows back); state.conv advanced, a short call's window kept for a rollback."""
        T, K = gated.shape[0], taps.shape[1]
        window = np.concatenate([state.conv, normed])  # [(K - 1) * dilation + T, C]
        conv = sum(window[k * dilation : k * dilation + T] * taps[:, k] for k in range(K))
        state.conv_window = window if T <= MAX_ROWS else None
        state.conv = window[T:].copy()
        return gated + silu(conv)

    # ---- QSA

    def indexed_attention(self, layer: IndexedAttention, qkv: np.ndarray, index_qk: np.ndarray, cache: IndexedKVCache,
                          start: int, first: int) -> np.ndarray:
        """Gated attention's core over the tokens the indexer selects, rows [first, T) of a call at position
        `start`: qkv [T, q | k | v] (Attention.split) and index_qk [T, (heads + 1) * d] of every row (all go to
        the cache). Returns sigmoid(gate) * attention [T - first, heads * hd]."""
        a, ix, c = layer.attention, layer.indexer, layer.attention.config
        T, heads, kv_heads, hd, eps = qkv.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        q_and_gate, k, v = a.split(qkv, first)
        q_and_gate = q_and_gate.reshape(T - first, heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(T - first, heads * hd)
        q = self.rms_norm(q, a.q_norm, eps)
        k = self.rms_norm(k.reshape(T, kv_heads, hd), a.k_norm, eps)
        cos, sin = rope_tables(np.arange(start, start + T), c.rotary_dim, c.rope_theta)
        q, k = apply_rope(q, cos[first:], sin[first:]), apply_rope(k, cos, sin)
        past = cache.length  # blocks and selections count cache rows; the MTP layer's sit one position on
        k, v = k.transpose(1, 0, 2), v.reshape(T, kv_heads, hd).transpose(1, 0, 2)  # [kv, T, hd]
        d = ix.q_norm.shape[0]
        index_keys = np.ascontiguousarray(index_qk[:, ix.heads * d :])  # [T, d]
        index_q = self.rms_norm(index_qk[first:, : ix.heads * d].reshape(T - first, ix.heads, d), ix.q_norm, eps)
        index_q = _rotated(c, index_q, np.arange(start + first, start + T))  # [T - first, index heads, d]
        out = np.empty((T - first, heads * hd), np.float32)
        # MAX_ROWS rows at a time, each slice as a verify of its rows: a q4 cache keeps its latest rows exact
        # in a ring of RECENT_ROWS + MAX_ROWS, so a row's window is read before a later slice overwrites it.
        for lo in range(0, T, MAX_ROWS):
            hi = min(T, lo + MAX_ROWS)
            cache.kv.append(k[:, lo:hi], v[:, lo:hi])
            cache.append_index_keys(index_keys[lo:hi],
                                    lambda first_block, raw_blocks: self._pooled(ix, first_block, raw_blocks, start - past))
            for t in range(max(lo, first), hi):
                tokens = self._selected(ix, index_q[t - first], cache, past + t)
                keys, values = cache.kv.rows_at(tokens, past + t + 1)  # the budget's rows, not the history
                # the row attends every selected token: as the last of them, nothing is masked
                out[t - first] = attend(q[t - first : t - first + 1], keys, values, len(tokens) - 1)[0]
        return out * sigmoid(gate)

    def _pooled(self, ix: Indexer, first_block: int, raw_blocks: np.ndarray, offset: int) -> np.ndarray:
        """Block keys [n, d] of complete blocks [n, ratio, d]: mean, norm, RoPE at the position of the
        block's first token (its cache row + offset)."""
        pooled = self.rms_norm(raw_blocks.mean(axis=1), ix.k_norm, ix.config.rms_norm_eps)
        starts = (first_block + np.arange(len(pooled))) * ix.ratio + offset
        return _rotated(ix.config, pooled[:, None, :], starts)[:, 0]

    @staticmethod
    def _selected(ix: Indexer, q: np.ndarray, cache: IndexedKVCache, row: int) -> np.ndarray:
        """Cache rows the query q [index heads, d] of cache row `row` reads: its top blocks, in order, and the tail."""
        complete = (row + 1) // ix.ratio
        if complete <= ix.top_blocks:
            return np.arange(row + 1)
        tail = np.arange(complete * ix.ratio, row + 1)
        scores = np.maximum(q @ cache.blocks[:complete].T, 0).sum(axis=0)  # [complete]: relu summed over heads
        top = np.sort(np.argsort(-scores, kind="stable")[: ix.top_blocks])  # ties: the earlier block
        return np.concatenate([(top[:, None] * ix.ratio + np.arange(ix.ratio)).ravel(), tail])


def _rotated(config: ModelConfig, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The attention's partial RoPE on the first rotary_dim of each [.., heads, d] row."""
    cos, sin = rope_tables(positions, config.rotary_dim, config.rope_theta)
    return apply_rope(x, cos, sin)


def flash_op_set(ops):
    """The op set Flash-Next's layers run on: a CPU op set gains FlashCpuOps's steps; the GPU's has them."""
    return FlashCpuOps(ops.compiled_steps) if type(ops) is CpuOps else ops
