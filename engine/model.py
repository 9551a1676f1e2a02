"""The Qwen3.5-family hybrid forward pass, written once against a backend's op set.

Three of every four layers are gated DeltaNet (linear attention with a recurrent state), every
fourth is gated full attention; the feed-forward is a dense SwiGLU MLP or routed experts plus a
gated shared expert. `Model.forward` runs T new tokens of one sequence and advances its state, so
prefill and token-by-token decode are the same call. Math: REFERENCE.md section 1.

What runs where: the layers hold Linears and vectors the assembler (engine/assemble.py) made for
a backend, and an op set (`ops`) that computes the parts each backend does its own way: the
attention and DeltaNet cores (row by row or chunked, per-row states for a rollback), norms, the
SwiGLU product, the caches and the pass itself. engine/backend/cpu_ops.py is the numpy op set and
the numerics reference. A layer's `pos` is whatever its op set uses for the position of a call's
first row (an int on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duet.engine.backend import threads
from duet.engine.backend.cpu_ops import CPU, softmax
from duet.engine.choices import KVCache
from duet.engine.config import ModelConfig

# --------------------------------------------------------------------------------------------
# Mixers


@dataclass
class Attention:
    """Gated full attention."""

    # One Linear over q_proj, k_proj and v_proj stacked by rows, so a pass runs one product, not three:
    # [heads * 2 * head_dim | kv_heads * head_dim | kv_heads * head_dim, H] = q (per head [query | gate]) | k | v
    qkv_proj: object
    o_proj: object
    q_norm: np.ndarray  # 1 + w, [head_dim]
    k_norm: np.ndarray
    config: ModelConfig
    ops: object = CPU

    def new_cache(self, kv: str = KVCache.BF16):
        return self.ops.kv_cache(self.config.num_key_value_heads, self.config.head_dim, kv)

    def __call__(self, x, cache, pos, last_only: bool = False):
        """Keys and values of every row go to the cache; the output is for every row, or for the
        last only (its attention and o_proj are then the only ones computed; the stacked product
        still makes every row's query: 0.8% of a 0.8B prefill's products)."""
        first = x.shape[0] - 1 if last_only else 0  # rows [first, T) are the ones whose output is returned
        return self.o_proj(self.ops.attention(self, self.qkv_proj(x), cache, pos, first))

    def split(self, qkv, first: int = 0):
        """qkv_proj's output [T, q | k | v] as column views: (q_and_gate of rows [first, T)
        [T - first, heads * 2 * hd], k [T, kv * hd], v [T, kv * hd])."""
        c = self.config
        queries, kv = 2 * c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        return qkv[first:, :queries], qkv[:, queries : queries + kv], qkv[:, queries + kv :]


@dataclass
class DeltaNet:
    """Gated DeltaNet."""

    # One Linear over the four input projections stacked by rows, so prefill runs one GEMM, not four:
    # [2 * Hk * dk + Hv * dv | Hv * dv | Hv | Hv, H] = q | k | v (heads contiguous) | z | b | a
    in_proj: object
    conv: np.ndarray  # depthwise taps [channels, kernel], oldest input first
    decay_rate: np.ndarray  # -exp(A_log), [Hv]
    dt_bias: np.ndarray  # [Hv]
    norm: np.ndarray  # plain weight of the gated norm, [dv]
    out_proj: object  # [H, Hv * dv]
    config: ModelConfig
    ops: object = CPU

    def new_cache(self, kv: str = KVCache.BF16):
        c = self.config
        return self.ops.deltanet_state(self.conv.shape[0], self.conv.shape[1], c.linear_num_value_heads,
                                       c.linear_key_head_dim, c.linear_value_head_dim)

    def __call__(self, x, state, pos, last_only: bool = False):
        """Every row advances the state; the output is for every row, or for the last only. The op set
        runs in_proj as well: the GPU's multiplies a W4 checkpoint's 16-bit in_proj_b/a rows inside its
        DeltaNet launch."""
        out = self.ops.deltanet(self, x, state, pos)  # [T, Hv * dv]
        return self.out_proj(out[x.shape[0] - 1 if last_only else 0 :])


# --------------------------------------------------------------------------------------------
# Feed-forward


@dataclass
class MLP:
    gate_up: object  # Linear [2 * I, H]: gate rows then up rows, in the form ops.swiglu takes (ops.gate_up)
    down: object  # [H, I]
    ops: object = CPU

    def __post_init__(self):
        self.gate_up = self.ops.gate_up(self.gate_up)

    def __call__(self, x):
        return self.down(self.ops.swiglu(self.gate_up, x))


@dataclass
class MoE:
    """Routed experts plus a gated shared expert. The router's logits are ranked on the host, so
    every backend picks the same experts from the same logits."""

    router: object  # Linear [E, H]
    experts: list  # MLP per expert
    shared: MLP
    shared_gate: object  # Linear [1, H]
    top_k: int
    normalize: bool
    ops: object = CPU
    layer: int = 0  # its layer, for the expert routing (engine/experts.py) it reports to
    routing: object = None  # ExpertRouting: counts hits and misses, applies --moe-skip; None: nothing to count

    def __call__(self, x):
        probs = softmax(self.ops.to_host(self.router(x)), axis=-1)  # [T, E]
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]  # [T, k], falling weight
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if self.routing is not None:
            weights = self.routing.route(self.layer, chosen, weights)
        out = self.ops.sigmoid(self.shared_gate(x)) * self.shared(x)
        for expert in np.unique(chosen):
            rows, slot = np.nonzero(chosen == expert)  # each row picks an expert at most once
            index = self.ops.to_device(rows)
            out[index] += self.experts[expert](x[index]) * self.ops.to_device(weights[rows, slot])[:, None]
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
    ops: object = CPU

    def __call__(self, x, delta, cache, pos, last_only: bool = False):
        """The residual x [T, H] plus the layer before's output delta (None before the first layer)
        through this layer: (the residual, this layer's output). Each residual add happens inside the
        norm that follows it (ops.add_rms_norm: one pass, one kernel on the GPU), so this layer's output
        is added by the next layer's input norm, or the final norm."""
        x, normed = self.ops.add_rms_norm(x, delta, self.input_norm, self.eps, for_linears=True)
        mixed = self.mixer(normed, cache, pos, last_only)
        x, normed = self.ops.add_rms_norm(x[-1:] if last_only else x, mixed, self.post_norm, self.eps, for_linears=True)
        return x, self.ffn(normed)


@dataclass
class MTPHead:
    """Multi-token prediction: from h_t (post-norm) and x_{t+1}, logits for x_{t+2}."""

    fc: object  # Linear [H, 2H] over [norm_e(embed(x_{t+1})) ; norm_h(h_t)]
    norm_embedding: np.ndarray
    norm_hidden: np.ndarray
    layer: DecoderLayer  # one full-attention layer with its own KV cache
    norm: np.ndarray


class Model:
    def __init__(self, config: ModelConfig, embed, layers: list[DecoderLayer], norm: np.ndarray,
                 lm_head, mtp: MTPHead | None = None, draft_head=None, ops=CPU):
        self.config = config
        self.ops = ops
        self.embed = embed  # [V, H]: rows gathered by token id
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # Linear [V, H], or a head of engine/heads.py
        self.mtp = mtp
        self.draft_head = draft_head  # logits over the draft shortlist (engine/heads.py); None: lm_head
        self.mtp_plan = ops.mtp_plan(self) if mtp is not None else None  # the op set's one-call form of the MTP passes, if any
        self.routing = None  # engine/experts.ExpertRouting of a MoE model's experts, once placed
        threads.start()

    def use_routing(self, routing) -> None:
        """Let every MoE layer report its routes to `routing` (engine/experts.py); None: to nothing."""
        self.routing = routing
        for i, layer in enumerate(self.layers):
            if isinstance(layer.ffn, MoE):
                layer.ffn.layer, layer.ffn.routing = i, routing

    def drop_weights(self) -> None:
        """Let go of the layers and heads before another route's are assembled, so memory (the card's,
        on the GPU) never holds both routes. take_weights makes the model usable again."""
        self.embed = self.layers = self.norm = self.lm_head = self.mtp = self.mtp_plan = self.draft_head = None

    def take_weights(self, other: Model) -> None:
        """Run from now on with other's layers and heads (the same checkpoint under another route).

        States made by new_state stay valid: they hold caches, not weights. Drafters holding this
        Model see the new weights on their next call.
        """
        if other.config is not self.config:
            raise ValueError("take_weights needs a Model of the same checkpoint")
        self.embed, self.layers, self.norm = other.embed, other.layers, other.norm
        self.lm_head, self.mtp, self.mtp_plan, self.draft_head = other.lm_head, other.mtp, other.mtp_plan, other.draft_head
        self.use_routing(self.routing)
        self.ops.weights_taken()

    def new_state(self, kv: str = KVCache.BF16):
        """Fresh per-sequence state; kv "q4" keeps attention keys/values in the 4-bit cache."""
        return self.ops.new_state([layer.mixer.new_cache(kv) for layer in self.layers])

    def forward(self, state, tokens, last_only: bool = False):
        """Run T new tokens; returns the post-final-norm hidden states [T, H] and advances state.

        last_only: return the last row only [1, H], as a prefill needs when nothing reads the other
        rows (no MTP drafter). The last layer then runs its attention, output projection and
        feed-forward for that row alone: 2.7% of a prefill's products in the 0.8B geometry, whose
        last layer is full attention. Every layer's cache still takes every row.
        """
        return self.ops.forward(self, state, np.asarray(tokens, dtype=np.int64), last_only)

    def run_layers(self, x, caches: list, pos, last_only: bool = False, ids: np.ndarray | None = None):
        """Every layer over x [T, H] (embedded tokens) at position pos, then the final norm. ids: the
        tokens themselves, which these layers do not read (Flash-Next's n-gram layers do)."""
        last, delta = len(self.layers) - 1, None
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            x, delta = layer(x, delta, cache, pos, last_only and i == last)
        return self.ops.add_rms_norm(x, delta, self.norm, self.config.rms_norm_eps)[1]

    def head_input(self, hidden):
        """What the lm_head reads of the hidden states forward returns (a model type may mix them first)."""
        return hidden

    def draft_head_input(self, hidden):
        """What the draft head reads of the hidden states mtp_forward returns."""
        return hidden

    def logits(self, hidden) -> np.ndarray:
        """[T, V] fp32 on the host."""
        return self.ops.to_host(self.ops.logits(self, self.head_input(hidden)))

    def candidates(self, hidden, top_k: int = 0, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
        """The logits a sampler reads, on the host: (values [T, C], their ids [C]) of the ids top-k
        keeps at `temperature` in some row (top_k > 0: sampling's candidates_top_k; a GPU sends only
        those), or (logits [T, V], None)."""
        return self.ops.top_k_candidates(self.ops.logits(self, self.head_input(hidden)), top_k, temperature)

    def draft_logits(self, hidden) -> np.ndarray:
        """Logits a drafter ranks [T, V] on the host: the shortlisted ids only (-inf elsewhere) when
        there is a shortlist."""
        return self.ops.to_host(self._draft_head(self.draft_head_input(hidden)))

    def draft_candidates(self, hidden, top_k: int = 0, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
        """candidates over the draft head: a shortlist's rows rank only its own ids."""
        x = self.draft_head_input(hidden)
        if self.draft_head is None:
            return self.ops.top_k_candidates(self.lm_head(x), top_k, temperature)
        shortlist = self.draft_head
        values, columns = self.ops.top_k_candidates(shortlist.scores(x), top_k, temperature)
        return values, shortlist.ids if columns is None else shortlist.ids[columns]

    def greedy_ids(self, hidden) -> np.ndarray:
        """Each row's argmax id [T] (the first of equal maxima, as np.argmax), the logits left where
        they were computed: all greedy decoding without penalties reads of a pass. On the GPU a
        [T, V] copy to the host was 1 MB a row at V = 248,320; this is 8 bytes."""
        return self.ops.to_host(self.ops.logits(self, self.head_input(hidden)).argmax(axis=-1))

    def draft_greedy_ids(self, hidden) -> np.ndarray:
        """greedy_ids over the draft head (draft_logits' ranking): a shortlist's argmax over its own rows."""
        x = self.draft_head_input(hidden)
        ids = self.lm_head(x).argmax(axis=-1) if self.draft_head is None else self.draft_head.greedy_ids(x)
        return self.ops.to_host(ids)

    def _draft_head(self, head_input):
        return (self.lm_head if self.draft_head is None else self.draft_head)(head_input)

    def mtp_greedy_drafts(self, state, hidden, k: int) -> list[int]:
        """k greedy drafts from `hidden` [1, H], the MTP output of the last committed row: draft i is the
        draft head's argmax (draft_greedy_ids) on the output before it, and each draft but the last
        feeds an MTP pass of its own (mtp_forward; their rows stay in state, for a drafter to rewind).
        The op set may run them all in one call (mtp_plan: CpuOps.mtp_greedy_drafts), with the same ids."""
        if k < 1:
            return []
        if self.mtp_plan is not None:
            drafts = self.ops.mtp_greedy_drafts(self.mtp_plan, state, hidden, k)
            if drafts is not None:
                return drafts
        drafts = []
        for i in range(k):
            if i:
                hidden = self.mtp_forward(state, [drafts[-1]], hidden)
            drafts.append(int(self.draft_greedy_ids(hidden)[0]))
        return drafts

    def mtp_sampled_drafts(self, state, hidden, k: int, params, uniforms) -> tuple[list[int], list, list] | None:
        """k drafts drawn as engine/speculative.py's MTPDrafter draws them (the draft head's top-k
        candidates, warped by params, a draw from their softmax q), each but the last feeding an MTP
        pass, in one call of the op set where it can (mtp_plan: CpuOps.mtp_sampled_drafts): (the drafts,
        each one's q, the ids q covers, all q packed as speculative.Draft.packed), or None: the drafter
        draws them itself. uniforms(n) gives n draws of the sampler's generator, asked for only when the
        call runs."""
        if k < 1 or self.mtp_plan is None:
            return None
        return self.ops.mtp_sampled_drafts(self.mtp_plan, state, hidden, k, params, uniforms)

    def new_mtp_state(self):
        return self.ops.new_state([self.mtp.layer.mixer.new_cache()])

    def mtp_forward(self, state, next_tokens, hidden, last_only: bool = False):
        """MTP over rows t: next_tokens[t] = x_{t+1}, hidden[t] = h_t. Returns the MTP hidden states.

        The MTP layer sees x_{t+1} at position t + 1; state.length counts the rows it has seen, so
        the first row of a sequence sits at position 1. last_only: the last row's state only [1, H], all
        a drafter's commit reads; where the op set computes rows alone (LAST_ROW_ALONE) the layer's
        attention output and feed-forward run for that row only (every row's keys and values are cached).
        The op set may run the whole pass in one call (mtp_plan: CpuOps.mtp_rows), with the same bits.
        """
        head, eps, ops = self.mtp, self.config.rms_norm_eps, self.ops
        ids = np.asarray(next_tokens, dtype=np.int64)
        if self.mtp_plan is not None:
            out = ops.mtp_rows(self.mtp_plan, self, state, ids, hidden, last_only)
            if out is not None:
                return out
        e = ops.rms_norm(self.embed[ids], head.norm_embedding, eps)
        h = ops.rms_norm(hidden, head.norm_hidden, eps)
        x = head.fc(ops.concat([e, h], axis=-1))  # [T, 2H] -> [T, H], embedding first
        x, delta = head.layer(x, None, state.layers[0], ops.mtp_position(state, len(ids)), last_only and ops.LAST_ROW_ALONE)
        state.advance(len(ids))
        out = ops.add_rms_norm(x, delta, head.norm, eps)[1]
        return out[-1:] if last_only else out
