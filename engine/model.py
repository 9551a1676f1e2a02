"""The Qwen3.5-family hybrid forward pass in numpy, fp32 throughout.

Three of every four layers are gated DeltaNet (linear attention with a recurrent state), every
fourth is gated full attention; the feed-forward is a dense SwiGLU MLP or routed experts plus a
gated shared expert. `Model.forward` runs T new tokens of one sequence and advances its state, so
prefill and token-by-token decode are the same call. Math: REFERENCE.md section 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from engine.backend import MAX_ROWS, threads
from engine.backend.threads import in_parallel, one_blas_thread
from engine.cache import DeltaNetState, KVCache, Q4KVCache, SequenceState
from engine.config import ModelConfig

# DeltaNet prefill chunk length. transformers' torch_chunk_gated_delta_rule uses 64; with numpy on
# the CPU 32 runs the rule 20% faster (128 tokens x 8 heads, one thread: 7.4 -> 5.9 ms; 512 tokens:
# 31.7 -> 25.2 ms): the C x C terms and the triangular inverse shrink more than the per-chunk
# state products add.
CHUNK = 32
# e^-30 ~ 1e-13: nothing next to O(1) terms in fp32 (eps 1.2e-7). Low enough to drop nothing that
# shows, high enough that a product of two floored factors and a few small ones (beta, k.k) stays
# far above the denormals (< 1.2e-38), which run up to ~100x slower on x86.
DECAY_FLOOR = -30.0


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis. Zero-centred norms pass 1 + w.
    Prefill's rows (the leading axis) are split between the cores."""
    out = np.empty(np.broadcast_shapes(x.shape, weight.shape), np.result_type(x, weight))

    def rows(lo: int, hi: int) -> None:
        part = x[lo:hi]
        np.multiply(part, 1 / np.sqrt(sum_of_squares(part) / np.float32(x.shape[-1]) + eps), out=out[lo:hi])
        out[lo:hi] *= weight

    in_parallel(rows, x.shape[0], split=x.ndim > 1 and x.shape[0] > MAX_ROWS)
    return out


def sum_of_squares(x: np.ndarray) -> np.ndarray:
    """Over the last axis, keeping it (length 1). One pass with no temporary the size of x: a
    DeltaNet gated norm over [128, 8, 128] took 0.32 ms with mean(x * x), 0.13 ms this way."""
    return np.einsum("...i,...i->...", x, x)[..., None]


def silu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.divide(x, _one_plus_exp_minus(x), out=out)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.reciprocal(_one_plus_exp_minus(x))


def _one_plus_exp_minus(x: np.ndarray) -> np.ndarray:
    """1 + e^-x in one buffer; e^-x overflows to inf for x < -88, which makes both results 0."""
    with np.errstate(over="ignore"):
        e = np.exp(-x)
    e += 1.0
    return e


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x * (1 / np.sqrt(sum_of_squares(x) + eps))


def decay(log_decay: np.ndarray) -> np.ndarray:
    """e^x for a (cumulative) log-decay x <= 0, exactly 0 below e^DECAY_FLOOR.

    Once a head's decay summed over a chunk passes -87, a plain exp gives denormal floats,
    and every multiply and matmul that touches them runs up to ~100x slower on x86. Factors under
    e^DECAY_FLOOR are invisible in fp32 next to the O(1) in-chunk terms, so flushing them changes nothing.
    """
    return np.where(log_decay > DECAY_FLOOR, np.exp(np.maximum(log_decay, DECAY_FLOOR)), np.float32(0.0))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# --------------------------------------------------------------------------------------------
# Gated full attention


@dataclass
class Attention:
    q_proj: object  # Linear [heads * 2 * head_dim, H], per head [query | gate]
    k_proj: object
    v_proj: object
    o_proj: object
    q_norm: np.ndarray  # 1 + w, [head_dim]
    k_norm: np.ndarray
    config: ModelConfig

    def new_cache(self, kv: str = "full") -> KVCache | Q4KVCache:
        c = self.config
        return Q4KVCache(c.num_key_value_heads, c.head_dim) if kv == "q4" else KVCache(c.num_key_value_heads, c.head_dim)

    def __call__(self, x: np.ndarray, cache: KVCache, start: int, last_only: bool = False) -> np.ndarray:
        """Keys and values of every row go to the cache; the output is for every row, or for the
        last only (its query, gate and o_proj are then the only ones computed)."""
        c = self.config
        T, heads, kv_heads, hd = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        first = T - 1 if last_only else 0  # rows [first, T) are the ones whose output is returned
        q_and_gate = self.q_proj(x[first:]).reshape(T - first, heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(T - first, heads * hd)
        q = rms_norm(q, self.q_norm, c.rms_norm_eps)
        k = rms_norm(self.k_proj(x).reshape(T, kv_heads, hd), self.k_norm, c.rms_norm_eps)
        v = self.v_proj(x).reshape(T, kv_heads, hd)
        cos, sin = rope_tables(np.arange(start, start + T), c.rotary_dim, c.rope_theta)
        q, k = apply_rope(q, cos[first:], sin[first:]), apply_rope(k, cos, sin)
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [kv, T, hd]
        past = cache.length
        if T <= MAX_ROWS:  # each row exactly as its own decode step would compute it
            cache.append(k, v)
            out = np.concatenate([attend(q[i : i + 1], *cache.rows(past + t + 1), past + t)
                                  for i, t in enumerate(range(first, T))])
        else:  # prefill: cached rows as the cache holds them, the new rows exact
            old_keys, old_values = cache.rows(past)
            cache.append(k, v)
            keys, values = np.concatenate([old_keys, k], axis=1), np.concatenate([old_values, v], axis=1)
            out = np.empty((T - first, heads * hd), np.float32)
            group = heads // kv_heads

            def kv_groups(lo: int, hi: int) -> None:  # KV heads [lo, hi) and the query heads reading them
                out[:, lo * group * hd : hi * group * hd] = attend(q[:, lo * group : hi * group], keys[lo:hi],
                                                                   values[lo:hi], past + first)

            in_parallel(kv_groups, kv_heads)
        return self.o_proj(out * sigmoid(gate))


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, rotary_dim / 2], inv_freq = theta^(-2i / rotary_dim)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    angles = positions[:, None].astype(np.float32) * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotate-half on the first rotary_dim dims of each head: pairs (j, j + rotary_dim / 2)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, past: int) -> np.ndarray:
    """Causal GQA: q [T, heads, hd] at positions past.., keys/values [kv, >= past + T, hd] -> [T, heads * hd].

    Query head h reads KV head h // (heads / kv).
    """
    T, heads, hd = q.shape
    kv, L = keys.shape[0], keys.shape[1]
    group = heads // kv
    qg = q.transpose(1, 0, 2).reshape(kv, group * T, hd)  # rows ordered (head in group, t)
    scores = (qg @ keys.transpose(0, 2, 1)) * hd**-0.5  # [kv, group * T, L]
    scores = scores.reshape(kv, group, T, L)
    future = np.arange(L)[None, :] > (past + np.arange(T))[:, None]  # [T, L]
    scores = np.where(future, -np.inf, scores)
    probs = softmax(scores, axis=-1).reshape(kv, group * T, L)
    out = (probs @ values).reshape(heads, T, hd)
    return out.transpose(1, 0, 2).reshape(T, heads * hd)


# --------------------------------------------------------------------------------------------
# Gated DeltaNet


@dataclass
class DeltaNet:
    # One Linear over the four input projections stacked by rows, so prefill runs one GEMM, not four:
    # [2 * Hk * dk + Hv * dv | Hv * dv | Hv | Hv, H] = q | k | v (heads contiguous) | z | b | a
    in_proj: object
    conv: np.ndarray  # depthwise taps [channels, kernel], oldest input first
    decay_rate: np.ndarray  # -exp(A_log), [Hv]
    dt_bias: np.ndarray  # [Hv]
    norm: np.ndarray  # plain weight of the gated norm, [dv]
    out_proj: object  # [H, Hv * dv]
    config: ModelConfig

    def new_cache(self, kv: str = "full") -> DeltaNetState:
        c = self.config
        return DeltaNetState(self.conv.shape[0], self.conv.shape[1], c.linear_num_value_heads,
                             c.linear_key_head_dim, c.linear_value_head_dim)

    def __call__(self, x: np.ndarray, state: DeltaNetState, start: int, last_only: bool = False) -> np.ndarray:
        """Every row advances the state; the output is for every row, or for the last only."""
        c = self.config
        T = x.shape[0]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        per_key = hv // hk  # value head h reads key head h // per_key: each key head repeated, not tiled
        channels = 2 * hk * dk + hv * dv
        projected = self.in_proj(x)
        mixed = causal_conv(projected[:, :channels], self.conv, state)
        z = projected[:, channels : channels + hv * dv].reshape(T, hv, dv)
        b, a = projected[:, -2 * hv : -hv], projected[:, -hv:]  # [T, Hv]
        out = np.empty((T, hv, dv), np.float32)
        S = np.empty_like(state.recurrent) if T > MAX_ROWS else None  # after a prefill, filled head by head

        def heads(lo: int, hi: int) -> None:
            """Key heads [lo, hi) and their value heads: every step here is per head."""
            vlo, vhi = lo * per_key, hi * per_key
            q = mixed[:, lo * dk : hi * dk].reshape(T, hi - lo, dk)
            k = mixed[:, (hk + lo) * dk : (hk + hi) * dk].reshape(T, hi - lo, dk)
            v = mixed[:, 2 * hk * dk + vlo * dv : 2 * hk * dk + vhi * dv].reshape(T, vhi - vlo, dv)
            beta = sigmoid(b[:, vlo:vhi])
            log_decay = self.decay_rate[vlo:vhi] * softplus(a[:, vlo:vhi] + self.dt_bias[vlo:vhi])  # g <= 0
            q = np.repeat(l2_normalize(q), per_key, axis=1) * dk**-0.5
            k = np.repeat(l2_normalize(k), per_key, axis=1)
            if T <= MAX_ROWS:
                o = delta_rule_rows(q, k, v, beta, log_decay, state)
            else:
                o, S[vlo:vhi] = delta_rule_chunked(q, k, v, beta, log_decay, state.recurrent[vlo:vhi])
            out[:, vlo:vhi] = rms_norm(o, self.norm, c.rms_norm_eps) * silu(z[:, vlo:vhi])

        # The chunked rule's hundreds of small products run on one BLAS thread per part of the heads:
        # two BLAS threads only wait on each other there (2.5 s against 0.02 s single-threaded for
        # 128 tokens x 16 heads on two busy cores). Splitting the heads: 13% of a prefill on two cores.
        in_parallel(heads, hk, split=T > MAX_ROWS)
        if T > MAX_ROWS:
            state.recurrent = S
        return self.out_proj(out.reshape(T, hv * dv)[T - 1 if last_only else 0 :])


# Tokens a causal-conv block covers: the K taps and SiLU's passes over [16, 3072] (a core's half of
# the 0.8B geometry's channels) stay in L2, where passes over all 128 tokens went out to memory
# (one core: 3.00 -> 1.86 ms for [128, 6144]).
CONV_ROWS = 16


def causal_conv(mixed: np.ndarray, taps: np.ndarray, state: DeltaNetState) -> np.ndarray:
    """Depthwise causal conv over time then SiLU; mixed [T, C], taps [C, K]. Updates state.conv."""
    T, K = mixed.shape[0], taps.shape[1]
    window = np.concatenate([state.conv, mixed], axis=0)  # [K - 1 + T, C]
    taps_by_lag = np.ascontiguousarray(taps.T)  # [K, C]: one contiguous row per tap
    out = np.empty_like(mixed)

    def channels(lo: int, hi: int) -> None:
        for t0 in range(0, T, CONV_ROWS):  # each block's passes stay in cache
            t1 = min(T, t0 + CONV_ROWS)
            o = out[t0:t1, lo:hi]
            np.multiply(window[t0:t1, lo:hi], taps_by_lag[0, lo:hi], out=o)
            for j in range(1, K):
                o += window[t0 + j : t1 + j, lo:hi] * taps_by_lag[j, lo:hi]
            silu(o, out=o)

    in_parallel(channels, mixed.shape[1], split=T > MAX_ROWS)
    state.window = window if T <= MAX_ROWS else None  # kept for a verify rollback only
    state.conv = window[T:].copy()
    return out


def delta_rule_rows(q, k, v, beta, log_decay, state: DeltaNetState) -> np.ndarray:
    """Token by token, keeping S after every row so a verify pass can roll back to any row."""
    state.row_states = []
    rows = []
    for t in range(q.shape[0]):
        rows.append(delta_rule_step(q[t], k[t], v[t], beta[t], log_decay[t], state))
        state.row_states.append(state.recurrent)
    return np.stack(rows)


def delta_rule_step(q, k, v, beta, log_decay, state: DeltaNetState) -> np.ndarray:
    """One token: S = e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q. q,k [Hv,dk], v [Hv,dv]."""
    S = state.recurrent * np.exp(log_decay)[:, None, None]
    predicted = np.einsum("hkv,hk->hv", S, k)
    update = (v - predicted) * beta[:, None]
    S = S + k[:, :, None] * update[:, None, :]
    state.recurrent = S
    return np.einsum("hkv,hk->hv", S, q)


def delta_rule_chunked(q, k, v, beta, log_decay, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same recurrence over T tokens, CHUNK at a time (WY form inside a chunk).

    q, k [T, Hv, dk]; v [T, Hv, dv]; beta, log_decay [T, Hv]; S [Hv, dk, dv] the state before.
    Returns the outputs [T, Hv, dv] and the state after.
    Inside a chunk with cumulative log-decay G_i, the delta-rule updates collapse to one lower
    triangular system (I + L) U = [beta V | beta K e^G], L_ij = beta_i k_i.k_j e^(G_i - G_j), j < i;
    across chunks the state is carried exactly as the one-token rule carries it.
    """
    T, hv, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % CHUNK
    n = (T + pad) // CHUNK

    def chunks(a):  # [T, Hv, ...] -> [Hv, n, CHUNK, ...], contiguous so every op after it runs unstrided
        if pad:
            a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return np.ascontiguousarray(np.moveaxis(a.reshape(n, CHUNK, hv, *a.shape[2:]), 2, 0))

    q, k, v, beta, g = chunks(q), chunks(k), chunks(v), chunks(beta), chunks(log_decay)
    G = np.cumsum(g, axis=-1)  # [Hv, n, C]
    lower = np.tril(np.ones((CHUNK, CHUNK), bool))
    pair_decay = decay(np.where(lower, G[..., :, None] - G[..., None, :], -np.inf))  # [Hv, n, C, C]
    k_beta = k * beta[..., None]
    L = (k_beta @ np.swapaxes(k, -1, -2)) * pair_decay
    inverse = unit_lower_inverse(L, pair_decay > 0)
    new_values = inverse @ (v * beta[..., None])
    k_cum = inverse @ (k_beta * decay(G)[..., None])
    intra = (q @ np.swapaxes(k, -1, -2)) * pair_decay  # causal q.k within the chunk
    q_decayed = q * decay(G)[..., None]
    k_to_end = k * decay(G[..., -1:] - G)[..., None]
    chunk_decay = decay(G[..., -1])  # [Hv, n]

    out = np.empty((hv, n, CHUNK, dv), np.float32)
    for i in range(n):
        v_new = new_values[:, i] - k_cum[:, i] @ S  # [Hv, C, dv]
        out[:, i] = q_decayed[:, i] @ S + intra[:, i] @ v_new
        S = S * chunk_decay[:, i, None, None] + np.swapaxes(k_to_end[:, i], -1, -2) @ v_new
    return np.moveaxis(out, 0, 2).reshape(n * CHUNK, hv, dv)[:T], S


SOLVE_BLOCK = 16  # diagonal blocks of the chunk's triangular system, inverted all at once


def unit_lower_inverse(L: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """(I + strict_lower(L))^-1 for L [..., C, C], C a multiple of SOLVE_BLOCK, batched over leading axes.

    keep [..., C, C] marks the entries that stay: where the pair decay is 0, the exact inverse holds
    that decay times O(1) terms, so it is set to 0 too, as each row is formed. Without that, chains
    of products of small L entries reach denormals: the rule over one layer's 16 heads of a 128-token
    prefill (random 0.8B geometry) took 16.1 ms, 9.6 ms with the mask, outputs identical.

    The diagonal blocks (unit lower, SOLVE_BLOCK wide) are inverted together by forward substitution,
    then block row i below them follows from the rows above it: X_i,<i = -X_ii (L_i,<i X_<i,<i).
    16 + C / 16 batched products instead of C forward-substitution steps (2.1 -> 1.1 ms a layer).
    """
    C, b = L.shape[-1], SOLVE_BLOCK
    nb = C // b
    lead = L.shape[:-2]
    blocks = L.reshape(*lead, nb, b, nb, b)
    diagonal = np.stack([blocks[..., j, :, j, :] for j in range(nb)], axis=-3)  # [..., nb, b, b]
    keep_blocks = keep.reshape(*lead, nb, b, nb, b)
    keep_diagonal = np.stack([keep_blocks[..., j, :, j, :] for j in range(nb)], axis=-3)
    eye = np.eye(b, dtype=L.dtype)
    inv_diagonal = np.empty_like(diagonal)
    inv_diagonal[..., 0, :] = eye[0]
    for i in range(1, b):
        row = eye[i] - (diagonal[..., i : i + 1, :i] @ inv_diagonal[..., :i, :])[..., 0, :]
        inv_diagonal[..., i, :] = row * keep_diagonal[..., i, :]
    X = np.zeros_like(L)
    X[..., :b, :b] = inv_diagonal[..., 0, :, :]
    for i in range(1, nb):
        rows = slice(i * b, (i + 1) * b)
        X[..., rows, rows] = inv_diagonal[..., i, :, :]
        below = -(inv_diagonal[..., i, :, :] @ (L[..., rows, : i * b] @ X[..., : i * b, : i * b]))
        X[..., rows, : i * b] = below * keep[..., rows, : i * b]
    return X


# --------------------------------------------------------------------------------------------
# Feed-forward


@dataclass
class MLP:
    gate_up: object  # Linear [2 * I, H]: gate rows then up rows
    down: object  # [H, I]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        # The intermediate stays feature-major [I, T]: a prefill's gate/up product comes out that way
        # without a transposing copy, and down reads it back as a plain operand.
        gate_up = self.gate_up.by_feature(x)
        inner = gate_up.shape[0] // 2
        hidden = np.empty((inner, x.shape[0]), np.float32)

        def features(lo: int, hi: int) -> None:
            np.multiply(silu(gate_up[lo:hi]), gate_up[inner + lo : inner + hi], out=hidden[lo:hi])

        in_parallel(features, inner, split=x.shape[0] > MAX_ROWS)
        return self.down(hidden.T)


@dataclass
class MoE:
    router: object  # Linear [E, H]
    experts: list  # MLP per expert
    shared: MLP
    shared_gate: object  # Linear [1, H]
    top_k: int
    normalize: bool

    def __call__(self, x: np.ndarray) -> np.ndarray:
        probs = softmax(self.router(x), axis=-1)  # [T, E]
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]  # [T, k]
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = sigmoid(self.shared_gate(x)) * self.shared(x)
        for expert in np.unique(chosen):
            rows, slot = np.nonzero(chosen == expert)
            out[rows] += self.experts[expert](x[rows]) * weights[rows, slot][:, None]
        return out


# --------------------------------------------------------------------------------------------
# Decoder layer, model, MTP head


@dataclass
class DecoderLayer:
    mixer: Attention | DeltaNet
    ffn: MLP | MoE
    input_norm: np.ndarray  # 1 + w
    post_norm: np.ndarray
    eps: float

    def __call__(self, x: np.ndarray, cache, start: int, last_only: bool = False) -> np.ndarray:
        mixed = self.mixer(rms_norm(x, self.input_norm, self.eps), cache, start, last_only)
        x = (x[-1:] if last_only else x) + mixed
        return x + self.ffn(rms_norm(x, self.post_norm, self.eps))


@dataclass
class MTPHead:
    """Multi-token prediction: from h_t (post-norm) and x_{t+1}, logits for x_{t+2}."""

    fc: object  # Linear [H, 2H] over [norm_e(embed(x_{t+1})) ; norm_h(h_t)]
    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    layer: DecoderLayer  # one full-attention layer with its own KV cache
    norm: np.ndarray


class Model:
    def __init__(self, config: ModelConfig, embed: np.ndarray, layers: list[DecoderLayer], norm: np.ndarray,
                 lm_head, mtp: MTPHead | None = None, draft_head=None):
        self.config = config
        self.embed = embed  # [V, H] fp32
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # Linear [V, H], or a head of engine/heads.py
        self.mtp = mtp
        self.draft_head = draft_head  # logits over the draft shortlist (engine/heads.py); None: lm_head
        threads.start()

    def take_weights(self, other: Model) -> None:
        """Run from now on with other's layers and heads (the same checkpoint under another route).

        States made by new_state stay valid: they hold caches, not weights. Drafters holding this
        Model see the new weights on their next call.
        """
        if other.config is not self.config:
            raise ValueError("take_weights needs a Model of the same checkpoint")
        self.embed, self.layers, self.norm = other.embed, other.layers, other.norm
        self.lm_head, self.mtp, self.draft_head = other.lm_head, other.mtp, other.draft_head

    def new_state(self, kv: str = "full") -> SequenceState:
        """Fresh per-sequence state; kv "q4" keeps attention keys/values in the 4-bit cache."""
        return SequenceState([layer.mixer.new_cache(kv) for layer in self.layers])

    def forward(self, state: SequenceState, tokens, last_only: bool = False) -> np.ndarray:
        """Run T new tokens; returns the post-final-norm hidden states [T, H] and advances state.

        last_only: return the last row only [1, H], as a prefill needs when nothing reads the other
        rows (no MTP drafter). The last layer then runs its query, output projection and
        feed-forward for that row alone: 3.5% of a prefill's products in the 0.8B geometry, whose
        last layer is full attention. Every layer's cache still takes every row.
        """
        x = self.embed[np.asarray(tokens, dtype=np.int64)]
        last = len(self.layers) - 1
        with one_blas_thread() if len(tokens) > MAX_ROWS else nullcontext():  # prefill splits work itself
            for i, (layer, cache) in enumerate(zip(self.layers, state.layers)):
                x = layer(x, cache, state.length, last_only and i == last)
        state.length_before_last_call = state.length
        state.length += len(tokens)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.lm_head(hidden)

    def draft_logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits a drafter ranks: the shortlisted ids only (-inf elsewhere) when there is a shortlist."""
        return self.lm_head(hidden) if self.draft_head is None else self.draft_head(hidden)

    def new_mtp_state(self) -> SequenceState:
        return SequenceState([self.mtp.layer.mixer.new_cache()])

    def mtp_forward(self, state: SequenceState, next_tokens, hidden: np.ndarray) -> np.ndarray:
        """MTP over rows t: next_tokens[t] = x_{t+1}, hidden[t] = h_t. Returns the MTP hidden states.

        The MTP layer sees x_{t+1} at position t + 1; state.length counts the rows it has seen, so
        the first row of a sequence sits at position 1.
        """
        head, eps = self.mtp, self.config.rms_norm_eps
        e = rms_norm(self.embed[np.asarray(next_tokens, dtype=np.int64)], head.norm_embedding, eps)
        h = rms_norm(hidden, head.norm_hidden, eps)
        x = head.fc(np.concatenate([e, h], axis=-1))
        x = head.layer(x, state.layers[0], state.length + 1)
        state.length += len(next_tokens)
        return rms_norm(x, head.norm, eps)
