"""The numpy op set: what engine/model.py's layers ask of a backend, on the CPU, fp32 throughout.

The numerics reference for every other backend. Its choices, each measured on the CPU:
- Up to MAX_ROWS rows (a decode step, a verify) every row is computed on its own, exactly as its
  one-row decode step: attention attends row by row, DeltaNet runs the recurrence token by token
  and keeps the state after each row for a rollback.
- Longer calls (prefill) run attention over all rows at once and DeltaNet in its chunked form
  (CHUNK tokens, WY form inside a chunk), with the work split between the cores (threads.py).
Math: REFERENCE.md section 1.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from duet.engine.backend import MAX_ROWS, compiled, compiled_sampling, cpu
from duet.engine.backend.threads import in_parallel, in_team, one_blas_thread
from duet.engine.cache import RECENT_ROWS, DeltaNetState, KVCache, Q4KVCache, SequenceState
from duet.engine.heads import ShortlistHead
from duet.engine.sampling import candidate_rows
from duet.engine.weights import take_rows

# DeltaNet prefill chunk length. transformers' torch_chunk_gated_delta_rule uses 64; with numpy on
# the CPU 32 runs the rule 20% faster (128 tokens x 8 heads, one thread: 7.4 -> 5.9 ms; 512 tokens:
# 31.7 -> 25.2 ms): the C x C terms and the triangular inverse shrink more than the per-chunk
# state products add.
CHUNK = 32
# e^-30 ~ 1e-13: nothing next to O(1) terms in fp32 (eps 1.2e-7). Low enough to drop nothing that
# shows, high enough that a product of two floored factors and a few small ones (beta, k.k) stays
# far above the denormals (< 1.2e-38), which run up to ~100x slower on x86.
DECAY_FLOOR = -30.0
# State elements (rows x value heads x dk x dv) a decode or verify pass's DeltaNet step needs before
# its heads are split between the cores. The 0.8B geometry's 16 x 128 x 128 a row split: 12.9 ->
# 9.0 ms a token; the demo's 4 x 32 x 64 lost ~45 us a layer to a Python worker's handoff (71 -> 26 us
# at one row). With numba's threads (a region starts in 2-5 us) 2^14 gave the demo's verify passes
# nothing either (`duet bench spec --temperature 0`, MTP 1.30x both ways).
DELTANET_SPLIT_MIN = 1 << 17
# attend_rows splits its KV heads between the cores from this many query-key products (rows x query
# heads x keys x head dim): ~30 us of work, against a split's ~5 us.
ATTEND_SPLIT_MIN = 1 << 18
# An MTP pass runs in one compiled call (compiled.mtp_rows, the cores as a team) below this many
# multiply-adds (rows x its Linears' weights): ~70 us of products on one core, the bound set when the
# call ran on one core alone (~30 us of calls saved, at most half the products' time lost). The demo's
# head is 0.79 M a row; a 0.8B head's is ~20 M.
MTP_ROWS_MAX_PRODUCTS = 1 << 22


def _in_lanes(linear) -> bool:
    """Whether a Linear is compiled bf16 lanes (AVX-512 CPUs) whose rows fill whole pairs of 32-row blocks."""
    return isinstance(linear, compiled.BF16Linear) and linear.lanes is not None and linear.rows == linear.lanes.shape[0] * 32


@dataclass(frozen=True)
class MTPPlan:
    """An MTP head as compiled.mtp_rows reads it (CpuOps.mtp_plan): its Linears' bf16 lanes, its norms
    in fp32."""

    norms: np.ndarray  # [5, H]: the embedding's, the hidden state's, the layer's two, the head's final norm
    fc: np.ndarray
    qkv_proj: np.ndarray
    o_proj: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    inv_freq: np.ndarray
    heads: int
    eps: np.float32
    products: int  # multiply-adds a row: the weights of the five Linears
    # For a cycle's drafts in one call (compiled.mtp_greedy_drafts, compiled_sampling.mtp_sampled_drafts),
    # or None: the token table's bf16 lanes (a tied table, the head's own), the draft head's lanes and
    # the ids of their rows.
    embed: np.ndarray | None
    draft_rows: np.ndarray | None
    draft_ids: np.ndarray | None

    def head_args(self, start: int, cache: KVCache) -> tuple:
        """The MTP kernels' shared arguments (compiled.mtp_rows' from norms to down) for passes from
        position `start` whose keys and values go to `cache` from its length on."""
        return (self.norms, self.eps, self.fc, self.qkv_proj, self.heads, self.q_norm, self.k_norm, start, self.inv_freq,
                cache.keys, cache.values, cache.length, self.o_proj, self.gate_up, self.down)


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


@functools.cache
def rope_frequencies(rotary_dim: int, theta: float) -> np.ndarray:
    """inv_freq = theta^(-2i / rotary_dim), fp32 [rotary_dim / 2]; one array every call shares (never written)."""
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)


def rope_tables(positions: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, rotary_dim / 2] of the fp32 angles position * inv_freq."""
    angles = positions[:, None].astype(np.float32) * rope_frequencies(rotary_dim, theta)[None, :]
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
    _advance_conv(state, window, T)
    return out


def _advance_conv(state: DeltaNetState, window: np.ndarray, T: int) -> None:
    """The conv state after T new rows: the window's last K - 1 rows; a verify keeps the window to roll back."""
    state.window = window if T <= MAX_ROWS else None
    state.conv = window[T:].copy()


def delta_rule_rows(q, k, v, beta, log_decay, state: DeltaNetState) -> np.ndarray:
    """Token by token, noting what a rollback to any row replays (state.ran_rows; the compiled path
    runs compiled.deltanet_heads instead, every per-head step fused)."""
    prior, decays, rows = state.recurrent, [], []
    for t in range(q.shape[0]):
        decays.append(np.exp(log_decay[t]))  # a row at a time, as its own decode step computes it
        state.recurrent = delta_update(state.recurrent, decays[-1], k[t], v[t], beta[t])
        rows.append(np.einsum("hkv,hk->hv", state.recurrent, q[t]))
    state.ran_rows(prior, (k, v, beta, np.stack(decays)), replay_rows)
    return np.stack(rows)


def replay_rows(prior, row_inputs: tuple, rows: int) -> np.ndarray:
    """The state after the first `rows` of delta_rule_rows' rows, from the state before them."""
    k, v, beta, decay = row_inputs
    S = prior
    for t in range(rows):
        S = delta_update(S, decay[t], k[t], v[t], beta[t])
    return S


def delta_update(S, decay, k, v, beta) -> np.ndarray:
    """The state after one token: e^g S + k u^T, u = beta (v - (e^g S)^T k); S [Hv, dk, dv], decay = e^g [Hv]."""
    S = S * decay[:, None, None]
    predicted = np.einsum("hkv,hk->hv", S, k)
    update = (v - predicted) * beta[:, None]
    return S + k[:, :, None] * update[:, None, :]


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


class CpuOps:
    """engine/model.py's layers on numpy. Positions are plain ints: the position of a call's first row.

    compiled_steps: a decode or verify pass's per-row steps (norms, conv, SwiGLU, attention, DeltaNet) and
    a prefill's SwiGLU run as compiled kernels; by default when the compiled kernels are available
    (decided once: the check reads the environment, ~1 us, which ~150 steps a verify cycle would pay
    each time)."""

    # A verify row's extra time in decode steps (engine/speculative.py's Depth). On two cores a 5-row
    # verify of the demo took 1.29-1.39 decode steps (compiled kernels: one weight read for all rows).
    VERIFY_ROW_COST = 0.1
    # A layer may compute its output for a call's last row alone (Model.forward's and mtp_forward's
    # last_only): every per-row step here gives a row the same bits alone as among others.
    LAST_ROW_ALONE = True

    def __init__(self, compiled_steps: bool | None = None):
        self.compiled_steps = compiled.unavailable() is None if compiled_steps is None else compiled_steps

    # ---- assembly: stored tensors -> what the layers hold

    def linear(self, weight, route: str):
        return compiled.make_linear(weight, route)

    def concat_outputs(self, linears: list):
        return cpu.ConcatOutputs(linears)

    def vector(self, values: np.ndarray) -> np.ndarray:
        return values

    def embedding(self, table, tied_head=None):
        """The token table as stored: fp32 rows, or GGUF blocks dequantized row by row on lookup.
        tied_head: the output head when it is the same matrix; a compiled bf16 head, which holds the
        bits in its own layout, serves the lookups (one copy of the matrix, not two)."""
        return tied_head if isinstance(tied_head, compiled.BF16Linear) else table

    def host_head(self, head):
        """A head that runs on the host (engine.heads.RescoredHead)."""
        return head

    def shortlist_part(self, head, matrix, rows: np.ndarray | slice, route: str):
        """A Linear over some rows of the output head's stored matrix (a view where rows is a slice
        of a float matrix, or of a compiled head's planes); head is the head assembled from it."""
        if isinstance(rows, slice) and isinstance(head, (compiled.PlanesLinear, compiled.BF16Linear)):
            leading = head.leading_rows(rows.stop)
            if leading is not None:
                return leading
        return self.linear(take_rows(matrix, rows), route)

    def shortlist_head(self, linear, ids: np.ndarray, vocab: int) -> ShortlistHead:
        return ShortlistHead(linear, ids, vocab)

    def weights_taken(self) -> None:
        """After Model.take_weights (a route switch): nothing on the CPU depends on the old weights."""

    # ---- states

    def new_state(self, caches: list) -> SequenceState:
        return SequenceState(caches)

    def kv_cache(self, kv_heads: int, head_dim: int, kv: str) -> KVCache | Q4KVCache:
        return Q4KVCache(kv_heads, head_dim) if kv == "q4" else KVCache(kv_heads, head_dim)

    def deltanet_state(self, channels: int, kernel: int, value_heads: int, key_dim: int, value_dim: int) -> DeltaNetState:
        return DeltaNetState(channels, kernel, value_heads, key_dim, value_dim)

    # ---- a pass

    def forward(self, model, state: SequenceState, ids: np.ndarray, last_only: bool) -> np.ndarray:
        """model.run_layers over the embedded ids at the state's position; advances the state."""
        with one_blas_thread() if len(ids) > MAX_ROWS else nullcontext():  # prefill splits work itself
            hidden = model.run_layers(model.embed[ids], state.layers, state.length, last_only, ids)
        state.advance(len(ids))
        return hidden

    def logits(self, model, hidden: np.ndarray) -> np.ndarray:
        return model.lm_head(hidden)

    def mtp_position(self, state: SequenceState, T: int) -> int:
        """The MTP layer sees x_{t+1} at position t + 1: its first row sits one past its cache row."""
        return state.length + 1

    def mtp_plan(self, model) -> MTPPlan | None:
        """The model's MTP head (engine/model.py's MTPHead) as compiled.mtp_rows reads it, or None where
        that kernel cannot run it: compiled steps off, a Linear other than bf16 lanes (AVX-512 CPUs)
        whose rows fill whole pairs of blocks, a layer other than gated attention with an MLP. A cycle's
        drafts run in one call too where the token table and the draft head (model.draft_head, else
        lm_head) are such lanes as well."""
        head = model.mtp
        layer = getattr(head, "layer", None)
        mixer, ffn = getattr(layer, "mixer", None), getattr(layer, "ffn", None)
        linears = [getattr(head, "fc", None), getattr(mixer, "qkv_proj", None), getattr(mixer, "o_proj", None),
                   getattr(ffn, "gate_up", None), getattr(ffn, "down", None)]
        if not self.compiled_steps or not all(map(_in_lanes, linears)):
            return None
        c = mixer.config
        f32 = functools.partial(np.ascontiguousarray, dtype=np.float32)
        norms = f32(np.stack([head.norm_embedding, head.norm_hidden, layer.input_norm, layer.post_norm, head.norm]))
        shortlist = model.draft_head if isinstance(model.draft_head, ShortlistHead) else None
        draft_head = model.lm_head if shortlist is None else shortlist.linear
        drafting = _in_lanes(model.embed) and _in_lanes(draft_head)
        draft_ids = (np.arange(draft_head.rows) if shortlist is None else shortlist.ids).astype(np.int64) if drafting else None
        return MTPPlan(norms, *(linear.lanes for linear in linears), f32(mixer.q_norm), f32(mixer.k_norm),
                       rope_frequencies(c.rotary_dim, c.rope_theta), c.num_attention_heads, np.float32(c.rms_norm_eps),
                       sum(linear.rows * linear.shape[1] for linear in linears),
                       model.embed.lanes if drafting else None, draft_head.lanes if drafting else None, draft_ids)

    def mtp_rows(self, plan: MTPPlan, model, state: SequenceState, ids: np.ndarray, hidden: np.ndarray,
                 last_only: bool) -> np.ndarray | None:
        """Model.mtp_forward's pass in one compiled call (compiled.mtp_rows: the op set's kernels in its
        order, so its bits), advancing the state; None where the op set's calls serve better: more than
        MAX_ROWS rows, a cache other than the fp32 KVCache, products or attention the op set would split
        between the cores (MTP_ROWS_MAX_PRODUCTS, ATTEND_SPLIT_MIN)."""
        T, cache = len(ids), state.layers[0]
        first, past = (T - 1 if last_only else 0), cache.length
        if not self._fits_one_call(plan, cache, T, T - first, past + T):
            return None
        cache.reserve(past + T)
        out = np.empty((T - first, hidden.shape[1]), np.float32)
        head = plan.head_args(self.mtp_position(state, T), cache)
        in_team(compiled.mtp_rows_team, compiled.mtp_rows,
                (np.ascontiguousarray(model.embed[ids], np.float32), np.ascontiguousarray(hidden, np.float32), *head, first, out,
                 *compiled.pass_scratch(T, first, head)))
        cache.length = past + T  # the kernel wrote rows past.., as append would have
        state.advance(T)
        return out

    def mtp_greedy_drafts(self, plan: MTPPlan, state: SequenceState, hidden: np.ndarray, k: int) -> list[int] | None:
        """Model.mtp_greedy_drafts in one compiled call (compiled.mtp_greedy_drafts: per draft the
        kernels of draft_greedy_ids and mtp_rows, so the same ids), leaving the state as its k - 1 passes
        would; None where those calls serve: no drafting form in the plan, or a pass mtp_rows declines."""
        if not self._drafts_fit(plan, state, k):
            return None
        drafts = np.empty(k, np.int64)
        head = plan.head_args(self.mtp_position(state, 1), state.layers[0])
        in_team(compiled.mtp_greedy_drafts_team, compiled.mtp_greedy_drafts,
                (np.ascontiguousarray(hidden, np.float32), plan.embed, plan.draft_rows, plan.draft_ids, *head, drafts,
                 *compiled.drafting_scratch(k, plan.draft_rows, head)))
        self._drafted(state, k)
        return drafts.tolist()

    def mtp_sampled_drafts(self, plan: MTPPlan, state: SequenceState, hidden: np.ndarray, k: int, params,
                           uniforms) -> tuple[list[int], list[np.ndarray], list[np.ndarray], tuple] | None:
        """Model.mtp_sampled_drafts in one compiled call (compiled_sampling.mtp_sampled_drafts: per draft
        the kernels of draft_candidates, the warpers, the softmax and the draw, so the same drafts and
        q, returned also packed as speculative.Draft.packed), drawing uniforms(k) only then; None where
        those calls serve: as mtp_greedy_drafts, or sampling with penalties, min-p, or a top-k that keeps
        the whole shortlist."""
        if (not self._drafts_fit(plan, state, k) or params.greedy or params.penalizes or params.min_p > 0
                or not 0 < params.top_k < len(plan.draft_ids)):
            return None
        drafts, counts = np.empty(k, np.int64), np.empty(k, np.int64)
        q, q_ids = np.empty((k, len(plan.draft_ids)), np.float32), np.empty((k, len(plan.draft_ids)), np.int64)
        head = plan.head_args(self.mtp_position(state, 1), state.layers[0])
        in_team(compiled_sampling.mtp_sampled_drafts_team, compiled_sampling.mtp_sampled_drafts,
                (np.ascontiguousarray(hidden, np.float32), plan.embed, plan.draft_rows, plan.draft_ids, *head, int(params.top_k),
                 np.float32(params.temperature), float(params.top_p), uniforms(k), drafts, q, q_ids, counts,
                 *compiled.drafting_scratch(k, plan.draft_rows, head)))
        self._drafted(state, k)
        return (drafts.tolist(), [q[i, :n] for i, n in enumerate(counts)], [q_ids[i, :n] for i, n in enumerate(counts)],
                (q, q_ids, counts))

    @staticmethod
    def _fits_one_call(plan: MTPPlan, cache, rows: int, attending: int, end: int) -> bool:
        """Whether an MTP pass of `rows` rows, `attending` of them reading keys [0, end), runs in one
        compiled call: no more than MAX_ROWS rows, the fp32 KVCache, products and attention the op set
        would not split between the cores (MTP_ROWS_MAX_PRODUCTS, ATTEND_SPLIT_MIN)."""
        return (rows <= MAX_ROWS and type(cache) is KVCache and rows * plan.products < MTP_ROWS_MAX_PRODUCTS
                and attending * plan.heads * end * cache.keys.shape[2] < ATTEND_SPLIT_MIN)

    def _drafts_fit(self, plan: MTPPlan, state: SequenceState, k: int) -> bool:
        """Whether k drafts can run in one call: the plan has a drafting form and each one-row pass fits
        one call (_fits_one_call); if so, the cache has room for them."""
        cache = state.layers[0]
        if plan.draft_rows is None or not self._fits_one_call(plan, cache, 1, 1, cache.length + k):
            return False
        cache.reserve(cache.length + k)
        return True

    @staticmethod
    def _drafted(state: SequenceState, k: int) -> None:
        """The state as k - 1 one-row MTP passes leave it (a drafting kernel wrote their rows)."""
        state.layers[0].length += k - 1
        for _ in range(k - 1):
            state.advance(1)

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def top_k_candidates(self, logits: np.ndarray, top_k: int, temperature: float) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of logits [T, V] on the host as the sampler reads them. With top_k on (0 < top_k < V):
        only the columns top-k keeps in some row, those of logits / temperature at or above the row's
        k-th largest (the same fp32 division and k-th value as the sampler's top-k, so the processors
        give the same values from them as from whole rows), as (values [T, C], -inf where a row does
        not keep a column; the columns [C], ascending). Else (the whole rows, None)."""
        T, V = logits.shape
        if not 0 < top_k < V:
            return logits, None
        if self.compiled_steps:
            return compiled_sampling.top_k_columns(logits, top_k, temperature)
        scaled = logits / np.float32(temperature)
        kth = np.partition(scaled, V - top_k, axis=-1)[:, V - top_k : V - top_k + 1]  # [T, 1]
        rows, columns = np.divmod(np.flatnonzero(scaled >= kth), V)  # np.nonzero of [T, V]: 26 us, this 5 (4 x 4,096)
        return candidate_rows(T, rows, columns, logits[rows, columns])

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return x

    def concat(self, parts: list, axis: int = -1) -> np.ndarray:
        return np.concatenate(parts, axis=axis)

    sigmoid = staticmethod(sigmoid)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """rms_norm; up to MAX_ROWS rows (x [T, ..., D]) in one compiled pass."""
        if x.shape[0] > MAX_ROWS or not self.compiled_steps or x.dtype != np.float32 or weight.shape != x.shape[-1:]:
            return rms_norm(x, weight, eps)
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        out = np.empty_like(rows)
        compiled.rms_norm_rows(rows, np.ascontiguousarray(weight, dtype=np.float32), np.float32(eps), out)
        return out.reshape(x.shape)

    def add_rms_norm(self, x: np.ndarray, delta: np.ndarray | None, weight: np.ndarray, eps: float,
                     for_linears: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(x + delta, its rms_norm): a residual add and the norm after it (engine/model.py's
        DecoderLayer); delta None adds nothing. for_linears: only Linears read the norm (the GPU's
        op set then hands it in the form they read; here it is the fp32 rows either way)."""
        if delta is None:
            return x, self.rms_norm(x, weight, eps)
        if x.shape[0] > MAX_ROWS or not self.compiled_steps or x.ndim != 2 or weight.shape != x.shape[-1:]:
            x = x + delta
            return x, self.rms_norm(x, weight, eps)
        total, out = np.empty(x.shape, np.float32), np.empty(x.shape, np.float32)
        compiled.add_rms_norm_rows(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(delta, np.float32),
                                   np.ascontiguousarray(weight, np.float32), np.float32(eps), total, out)
        return total, out

    @staticmethod
    def gate_up(linear):
        """An MLP's gate | up Linear in the form swiglu takes (on the CPU, as it is)."""
        return linear

    def swiglu(self, gate_up, x: np.ndarray) -> np.ndarray:
        """silu(gate) * up of gate_up(x) as [T, I] (gate rows then up rows). With the compiled steps,
        token-major through one compiled pass (rows split between the cores for a prefill). numpy's
        prefill keeps the intermediate feature-major [I, T]: its gate/up product comes out that way
        without a transposing copy, and the down projection reads the transposed view as a plain operand."""
        if self.compiled_steps:
            product = np.ascontiguousarray(gate_up(x), dtype=np.float32)
            out = np.empty((x.shape[0], product.shape[1] // 2), np.float32)
            compiled.split_kernel(compiled.swiglu_rows, (product, out), x.shape[0], split=x.shape[0] > MAX_ROWS)
            return out
        product = gate_up.by_feature(x)
        inner = product.shape[0] // 2
        hidden = np.empty((inner, x.shape[0]), np.float32)

        def features(lo: int, hi: int) -> None:
            np.multiply(silu(product[lo:hi]), product[inner + lo : inner + hi], out=hidden[lo:hi])

        in_parallel(features, inner, split=x.shape[0] > MAX_ROWS)
        return hidden.T

    def attention(self, layer, qkv: np.ndarray, cache, start: int, first: int) -> np.ndarray:
        """Gated attention's core for rows [first, T) of a call at position `start`: qkv [T, q | k | v]
        (the stacked projection of every row; Attention.split names its columns), whose keys and
        values all go to the cache. Returns sigmoid(gate) * attention [T - first, heads * hd]."""
        c = layer.config
        T, heads, kv_heads, hd = qkv.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        if T <= MAX_ROWS and self.compiled_steps:
            return self._attention_rows(layer, qkv, cache, start, first)
        q_and_gate, k, v = layer.split(qkv, first)
        q_and_gate = q_and_gate.reshape(T - first, heads, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:].reshape(T - first, heads * hd)
        q = self.rms_norm(q, layer.q_norm, c.rms_norm_eps)
        k = self.rms_norm(k.reshape(T, kv_heads, hd), layer.k_norm, c.rms_norm_eps)
        cos, sin = rope_tables(np.arange(start, start + T), c.rotary_dim, c.rope_theta)
        q, k = apply_rope(q, cos[first:], sin[first:]), apply_rope(k, cos, sin)
        k, v = k.transpose(1, 0, 2), v.reshape(T, kv_heads, hd).transpose(1, 0, 2)  # [kv, T, hd]
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
        return out * sigmoid(gate)

    @staticmethod
    def _attention_rows(layer, qkv: np.ndarray, cache, start: int, first: int) -> np.ndarray:
        """attention for a decode or verify pass in two compiled passes: queries and keys normed and
        rotated (compiled.qk_norm_rope_rows), then each row attends exactly as its own decode step
        would and takes its gate (compiled.attend_rows). A layer took 13 calls and ~20 numpy ops
        with three projections; now 5 calls."""
        c = layer.config
        T, hd = qkv.shape[0], c.head_dim
        qkv = np.ascontiguousarray(qkv, np.float32)
        q = np.empty((T - first, c.num_attention_heads, hd), np.float32)
        k = np.empty((c.num_key_value_heads, T, hd), np.float32)
        compiled.qk_norm_rope_rows(qkv, first, layer.q_norm, layer.k_norm, np.float32(c.rms_norm_eps), start,
                                   rope_frequencies(c.rotary_dim, c.rope_theta), q, k)
        v = layer.split(qkv)[2].reshape(T, k.shape[0], hd).transpose(1, 0, 2)  # [kv, T, hd]
        past = cache.length
        cache.append(k, v)
        out = np.empty((T - first, q.shape[1] * hd), np.float32)
        gates = qkv[first:]
        kv_heads = k.shape[0]
        if type(cache).rows is KVCache.rows:  # rows are prefixes of its buffers: each row reads up to its own position
            split = (T - first) * q.shape[1] * (past + T) * hd >= ATTEND_SPLIT_MIN
            compiled.split_kernel(compiled.attend_rows, (q, cache.keys, cache.values, past + first, gates, out), kv_heads, split)
        elif type(cache) is Q4KVCache:  # a row reads what its decode step would (the window of exact rows moves with it)
            split = (T - first) * q.shape[1] * (past + T) * hd >= ATTEND_SPLIT_MIN
            compiled.split_kernel(compiled.attend_q4_rows, (q, cache.codes.view(np.uint16)[..., 0], cache.scales.view(np.uint16), cache.sink, cache.ring,
                                                            cache.hadamard, cache.signs, RECENT_ROWS, past + first, gates, out), kv_heads, split)
        else:  # any other cache: each row over the rows(end) its decode step would read
            for i, t in enumerate(range(first, T)):
                keys, values = (np.ascontiguousarray(rows, dtype=np.float32) for rows in cache.rows(past + t + 1))
                compiled.attend_rows(q[i : i + 1], keys, values, past + t, gates[i : i + 1], out[i : i + 1], 0, kv_heads)
        return out

    def deltanet(self, layer, x: np.ndarray, state: DeltaNetState, start: int) -> np.ndarray:
        """Gated DeltaNet over every row of x [T, H] (the normed input): in_proj's q | k | v | z | b | a,
        then the core -> the gated norm's output [T, Hv * dv], the conv and recurrent state advanced."""
        c = layer.config
        projected = layer.in_proj(x)
        T = projected.shape[0]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        per_key = hv // hk  # value head h reads key head h // per_key: each key head repeated, not tiled
        channels = 2 * hk * dk + hv * dv
        mixed = self.causal_conv(projected[:, :channels], layer.conv, state)
        z = projected[:, channels : channels + hv * dv].reshape(T, hv, dv)
        b, a = projected[:, -2 * hv : -hv], projected[:, -hv:]  # [T, Hv]
        if T <= MAX_ROWS and self.compiled_steps and c.output_gate == "silu":  # the kernel fuses SiLU's gate
            return self._deltanet_rows_compiled(layer, mixed, z, b, a, state, per_key)
        gate = silu if c.output_gate == "silu" else sigmoid
        out = np.empty((T, hv, dv), np.float32)
        S = np.empty_like(state.recurrent) if T > MAX_ROWS else None  # after a prefill, filled head by head

        def heads(lo: int, hi: int) -> None:
            """Key heads [lo, hi) and their value heads: every step here is per head."""
            vlo, vhi = lo * per_key, hi * per_key
            q = mixed[:, lo * dk : hi * dk].reshape(T, hi - lo, dk)
            k = mixed[:, (hk + lo) * dk : (hk + hi) * dk].reshape(T, hi - lo, dk)
            v = mixed[:, 2 * hk * dk + vlo * dv : 2 * hk * dk + vhi * dv].reshape(T, vhi - vlo, dv)
            beta = sigmoid(b[:, vlo:vhi])
            log_decay = layer.decay_rate[vlo:vhi] * softplus(a[:, vlo:vhi] + layer.dt_bias[vlo:vhi])  # g <= 0
            q = np.repeat(l2_normalize(q), per_key, axis=1) * dk**-0.5
            k = np.repeat(l2_normalize(k), per_key, axis=1)
            if T <= MAX_ROWS:
                o = delta_rule_rows(q, k, v, beta, log_decay, state)
            else:
                o, S[vlo:vhi] = delta_rule_chunked(q, k, v, beta, log_decay, state.recurrent[vlo:vhi])
            out[:, vlo:vhi] = rms_norm(o, layer.norm, c.rms_norm_eps) * gate(z[:, vlo:vhi])

        # The chunked rule's hundreds of small products run on one BLAS thread per part of the heads:
        # two BLAS threads only wait on each other there (2.5 s against 0.02 s single-threaded for
        # 128 tokens x 16 heads on two busy cores). Splitting the heads: 13% of a prefill on two cores.
        in_parallel(heads, hk, split=T > MAX_ROWS)
        if T > MAX_ROWS:
            state.recurrent = S
        return out.reshape(T, hv * dv)

    def causal_conv(self, mixed: np.ndarray, taps: np.ndarray, state: DeltaNetState) -> np.ndarray:
        """causal_conv; up to MAX_ROWS rows in one compiled pass."""
        T = mixed.shape[0]
        if T > MAX_ROWS or not self.compiled_steps:
            return causal_conv(mixed, taps, state)
        window = np.concatenate([state.conv, mixed], axis=0).astype(np.float32, copy=False)  # [K - 1 + T, C]
        out = np.empty(mixed.shape, np.float32)
        compiled.conv_rows(window, np.ascontiguousarray(taps.T, dtype=np.float32), out)
        _advance_conv(state, window, T)
        return out

    @staticmethod
    def _deltanet_rows_compiled(layer, mixed, z, b, a, state: DeltaNetState, per_key: int) -> np.ndarray:
        """The per-head steps of a decode or verify pass in one compiled kernel (compiled.deltanet_heads),
        value heads split between the cores when the states are large enough to pay for the handoff
        (DELTANET_SPLIT_MIN): ~20 numpy ops a layer took ~0.5 ms of a 0.8B step's layer."""
        T, hv, dv = z.shape
        dk = state.recurrent.shape[1]
        last = np.empty(state.recurrent.shape, np.float32)
        row_inputs = (np.empty((T, hv, dk), np.float32), np.empty((T, hv, dv), np.float32),
                      np.empty((T, hv), np.float32), np.empty((T, hv), np.float32))  # k, v, beta, e^g
        out = np.empty((T, hv, dv), np.float32)
        f32 = [np.ascontiguousarray(x, dtype=np.float32) for x in (mixed, z, b, a)]
        vectors = [np.ascontiguousarray(x, dtype=np.float32) for x in (layer.decay_rate, layer.dt_bias, layer.norm)]
        eps = np.float32(layer.config.rms_norm_eps)
        compiled.split_kernel(compiled.deltanet_heads, (*f32, *vectors, eps, per_key, state.recurrent, last, *row_inputs, out), hv,
                              split=T * hv * dk * dv >= DELTANET_SPLIT_MIN)
        state.ran_rows(state.recurrent, row_inputs, compiled.delta_replay)
        state.recurrent = last
        return out.reshape(T, hv * dv)


CPU = CpuOps()
