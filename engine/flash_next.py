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
Runs on the CPU op set; the GPU backend does not take this model type yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duet.engine.backend import MAX_ROWS
from duet.engine.backend.cpu_ops import CPU, apply_rope, attend, rope_tables, sigmoid, silu
from duet.engine.cache import IndexedKVCache, PLEState, WithPLE
from duet.engine.choices import KVCache
from duet.engine.config import ModelConfig
from duet.engine.model import Attention, DeltaNet, Model, MoE
from duet.engine.weights import ShardedRows


@dataclass
class HyperConnection:
    """Streams [T, hc * H] -> the block's input [T, H] and each stream's injection weight [T, hc]."""

    norm: np.ndarray  # 1 + w, [hc * H]: an RMSNorm over each stream's H values
    down: object  # Linear [lowrank, hc * H]
    up: object  # Linear [hc * H, lowrank]
    inject: object | None  # Linear [hc, hc * H]; None in the head's mixer
    hc: int
    eps: float
    ops: object = CPU

    def __call__(self, streams: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        T = streams.shape[0]
        normed = stream_norm(self.ops, streams, self.norm, self.hc, self.eps).reshape(T, -1)  # [T, hc * H]
        weight = sigmoid(self.up(silu(self.down(normed) / self.hc)))  # [T, hc * H]
        mixed = (weight * normed).reshape(T, self.hc, -1).mean(axis=1)  # [T, H]
        if self.inject is None:
            return mixed, None
        return mixed, 2 * sigmoid(self.inject(normed) / self.hc)


def stream_norm(ops, x: np.ndarray, weight: np.ndarray, hc: int, eps: float) -> np.ndarray:
    """x [T, hc * H] normed over each stream's H values with its slice of weight [hc * H]: [T, hc, H]."""
    return ops.rms_norm(x.reshape(x.shape[0], hc, -1), weight.reshape(hc, -1), eps)


def injected(streams: np.ndarray, out: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Each stream plus the block's output [T, H] times its weight [T, hc]."""
    T, hc = weight.shape
    return streams + (weight[:, :, None] * out[:, None, :]).reshape(T, -1)


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
        """The concatenated heads' rows [T, heads * D]."""
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
    ops: object = CPU

    def new_state(self) -> PLEState:
        context = len(self.ngrams.multipliers) - 1
        return PLEState(context, self.ngrams.eos, (self.conv.shape[1] - 1) * self.dilation, self.conv.shape[0])

    def __call__(self, streams: np.ndarray, ids: np.ndarray, state: PLEState) -> np.ndarray:
        T, H = streams.shape[0], streams.shape[1] // self.hc
        history = np.concatenate([state.tokens, ids])
        embedded = self.ngrams(history, T)  # [T, P]
        key = stream_norm(self.ops, self.key_proj(embedded), self.norm_key, self.hc, self.eps)  # [T, hc, H]
        value = self.value_proj(embedded)  # [T, H]
        gate = (key * stream_norm(self.ops, streams, self.norm_query, self.hc, self.eps)).sum(axis=-1) / np.float32(np.sqrt(H))  # [T, hc]
        gate = np.sqrt(np.maximum(np.abs(gate), 1e-6)) * np.sign(gate)
        gated = (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(T, -1)  # [T, hc * H]
        window = np.concatenate([state.conv, stream_norm(self.ops, gated, self.norm_conv, self.hc, self.eps).reshape(T, -1)])
        K, d = self.conv.shape[1], self.dilation
        conv = sum(window[k * d : k * d + T] * self.conv[:, k] for k in range(K))  # tap k reads x[t - (K-1-k) d]
        short = T <= MAX_ROWS  # a decode or verify call keeps its windows for a rollback
        state.token_window, state.conv_window = (history, window) if short else (None, None)
        state.tokens, state.conv = history[T:].copy(), window[T:].copy()
        return gated + silu(conv)


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
    ops: object = CPU

    def rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The attention's partial RoPE on the first rotary_dim of each [.., heads, d] row."""
        cos, sin = rope_tables(positions, self.config.rotary_dim, self.config.rope_theta)
        return apply_rope(x, cos, sin)

    def pool(self, first_block: int, raw_blocks: np.ndarray, offset: int) -> np.ndarray:
        """Block keys [n, d] of complete blocks [n, ratio, d]: mean, norm, RoPE at the position of the
        block's first token (its cache row + offset)."""
        pooled = self.ops.rms_norm(raw_blocks.mean(axis=1), self.k_norm, self.config.rms_norm_eps)
        starts = (first_block + np.arange(len(pooled))) * self.ratio + offset
        return self.rotate(pooled[:, None, :], starts)[:, 0]

    def queries(self, x: np.ndarray, cache: IndexedKVCache, start: int, first: int, offset: int) -> np.ndarray:
        """Index every row's key into the cache (after its kv rows); the queries of rows [first, T),
        the call's first row at position `start`."""
        T, d = x.shape[0], self.q_norm.shape[0]
        qk = self.qk_proj(x)  # [T, (heads + 1) * d]
        cache.append_index_keys(np.ascontiguousarray(qk[:, self.heads * d :]),
                                lambda first_block, raw_blocks: self.pool(first_block, raw_blocks, offset))
        q = self.ops.rms_norm(qk[first:, : self.heads * d].reshape(T - first, self.heads, d), self.q_norm,
                              self.config.rms_norm_eps)
        return self.rotate(q, np.arange(start + first, start + T))

    def selected(self, q: np.ndarray, cache: IndexedKVCache, row: int) -> np.ndarray:
        """Cache rows the query of cache row `row` reads: its top blocks, in order, and the tail."""
        complete = (row + 1) // self.ratio
        if complete <= self.top_blocks:
            return np.arange(row + 1)
        tail = np.arange(complete * self.ratio, row + 1)
        scores = np.maximum(q @ cache.blocks[:complete].T, 0).sum(axis=0)  # [complete]: relu summed over heads
        top = np.sort(np.argsort(-scores, kind="stable")[: self.top_blocks])  # ties: the earlier block
        return np.concatenate([(top[:, None] * self.ratio + np.arange(self.ratio)).ravel(), tail])


@dataclass
class IndexedAttention:
    """Gated attention (engine/model.Attention's projections and norms) over the tokens QSA selects."""

    attention: Attention
    indexer: Indexer

    def new_cache(self, kv: str = KVCache.BF16) -> IndexedKVCache:
        return IndexedKVCache(self.attention.new_cache(kv), self.indexer.q_norm.shape[0], self.indexer.ratio)

    def __call__(self, x, cache: IndexedKVCache, pos, last_only: bool = False):
        a, c = self.attention, self.attention.config
        T, first = x.shape[0], x.shape[0] - 1 if last_only else 0
        heads, kv_heads, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q_and_gate = a.q_proj(x[first:]).reshape(T - first, heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(T - first, heads * hd)
        q = a.ops.rms_norm(q, a.q_norm, c.rms_norm_eps)
        k = a.ops.rms_norm(a.k_proj(x).reshape(T, kv_heads, hd), a.k_norm, c.rms_norm_eps)
        cos, sin = rope_tables(np.arange(pos, pos + T), c.rotary_dim, c.rope_theta)
        q, k = apply_rope(q, cos[first:], sin[first:]), apply_rope(k, cos, sin)
        past = cache.length  # blocks and selections count cache rows; the MTP layer's sit one position on
        cache.kv.append(k.transpose(1, 0, 2), a.v_proj(x).reshape(T, kv_heads, hd).transpose(1, 0, 2))
        index_q = self.indexer.queries(x, cache, pos, first, offset=pos - past)  # [T - first, index heads, d]
        out = np.empty((T - first, heads * hd), np.float32)
        for i, row in enumerate(range(past + first, past + T)):
            tokens = self.indexer.selected(index_q[i], cache, row)
            keys, values = cache.kv.rows(row + 1)
            # the row attends every selected token: as the last of them, nothing is masked
            out[i] = attend(q[i : i + 1], keys[:, tokens], values[:, tokens], len(tokens) - 1)[0]
        return a.o_proj(out * sigmoid(gate))


@dataclass
class FlashLayer:
    mixer: IndexedAttention | DeltaNet
    ffn: MoE
    mixer_hc: HyperConnection
    ffn_hc: HyperConnection
    ple: PLE | None = None

    def new_cache(self, kv: str = KVCache.BF16):
        cache = self.mixer.new_cache(kv)
        return cache if self.ple is None else WithPLE(cache, self.ple.new_state())

    def __call__(self, streams, cache, pos, ids: np.ndarray, last_only: bool = False):
        if self.ple is not None:
            streams = streams + self.ple(streams, ids, cache.ple)
            cache = cache.mixer
        mixed, weight = self.mixer_hc(streams)
        out = self.mixer(mixed, cache, pos, last_only)
        if last_only:
            streams, weight = streams[-1:], weight[-1:]
        streams = injected(streams, out, weight)
        mixed, weight = self.ffn_hc(streams)
        return injected(streams, self.ffn(mixed), weight)


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
    the lm_head's input in `logits`."""

    def new_state(self, kv: str = KVCache.BF16):
        return self.ops.new_state([layer.new_cache(kv) for layer in self.layers])

    def run_layers(self, x, caches: list, pos, last_only: bool = False, ids: np.ndarray | None = None):
        streams = np.tile(x, (1, self.config.flash.hc_count))  # [T, hc * H]
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            streams = layer(streams, cache, pos, ids, last_only and i == last)
        return streams

    def logits(self, hidden) -> np.ndarray:
        return super().logits(self.norm(hidden)[0])

    def draft_logits(self, hidden) -> np.ndarray:
        return super().draft_logits(self.mtp.mixer(hidden)[0])

    def mtp_forward(self, state, next_tokens, hidden):
        """The MTP head over rows t (next_tokens[t] = x_{t+1}, hidden[t] = the trunk's streams at t);
        returns its streams, which the next draft step reads as its h."""
        head, eps, ops, hc = self.mtp, self.config.rms_norm_eps, self.ops, self.config.flash.hc_count
        ids = np.asarray(next_tokens, dtype=np.int64)
        T = len(ids)
        e = head.fc_embedding(ops.rms_norm(self.embed[ids], head.norm_embedding, eps))  # [T, H]
        h = stream_norm(ops, hidden, head.norm_hidden, hc, eps).reshape(T * hc, -1)
        streams = (head.fc_hidden(h).reshape(T, hc, -1) + e[:, None, :]).reshape(T, -1)
        streams = head.layer(streams, state.layers[0], ops.mtp_position(state, T), ids)
        state.advance(T)
        return streams
