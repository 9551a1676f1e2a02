"""The Qwen3.5-family forward on the GPU: engine/model.py's math on engine/backend/cupy_backend.py's ops.

`GpuModel` offers what engine/generate.py and engine/speculative.py use of engine.model.Model
(config, new_state, forward, logits, draft_logits, mtp, new_mtp_state, mtp_forward, take_weights).
It is made from a CPU Model as engine/checkpoint/hf.py assembles it (the Linears of one route over
the read weights) by moving every matrix and vector to the device, so the CPU model stays the one
place that knows the checkpoint and the reference every GPU test holds this one to.

Rows. A call of T <= MAX_ROWS tokens (a decode step, or a verify of the last token plus drafts)
runs every layer once over all rows. A longer call (prefill) runs the Linears over all rows and
the DeltaNet and attention cores MAX_ROWS rows at a time, each slice exactly as a verify of its
rows would run. Hidden states stay on the device; `logits` hands numpy to the sampler.

Where the numbers differ from the CPU model (the GPU tests' tolerances cover each):
- fp32 sums in other orders (GEMVs, attention, norms), and the "full" KV cache keeps bf16 rows on the
  card where the CPU keeps fp32;
- a DeltaNet prefill runs the recurrence row by row, where the CPU uses the chunked form;
- a q4-KV prefill reads its own earlier rows as the cache holds them (the CPU reads the rows of one
  prefill call exact): prompts shorter than SINK_ROWS + RECENT_ROWS tokens see no difference;
- bf16-route Linears are cuBLAS products, which do not promise a verify row the bits of the one-row
  step it stands for; the W4 routes' kernels compute every row the same way at any row count.

Decode cycles as CUDA graphs. A short call on a dense model is captured once per (rows, attention
grid) and replayed: tokens and the position are read on the device from `state.inputs`, so the
same graph serves every cycle; the graph also computes the logits and pushes the greedy ids into
`state.ring`. Grids are sized for a power-of-two number of ATTENTION_CHUNK key chunks, and chunks
past a row's end are empty, which the combine skips, so a replay computes what the uncaptured pass
computes. MoE layers route on the host, and a head computed on the host cannot be captured: those
models run uncaptured.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from engine import model as cpu_model
from engine.backend import cpu
from engine.backend import cupy_backend as gb
from engine.backend.cupy_backend import ATTENTION_CHUNK, MAX_ROWS
from engine.heads import ShortlistHead
from engine.kernels.build import kernel

KV_CAPACITY = 256  # rows an attention cache starts with (it doubles as a sequence grows), as engine.cache
RING_SLOTS = 64  # captured cycles whose greedy ids stay readable in state.ring


def _dev(a) -> cp.ndarray:
    return cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))


# ------------------------------------------------------------------------------ weights ---

def gpu_linear(linear):
    """The GPU Linear of a CPU Linear (engine/backend/cpu.py): same route, same weights."""
    if isinstance(linear, cpu.PermutedInput):
        return gb.PermutedInput(gpu_linear(linear.linear), linear.order)
    if isinstance(linear, cpu.ConcatOutputs):
        return ConcatOutputs([gpu_linear(p) for p in linear.parts])
    kinds = {cpu.DenseLinear: gb.DenseLinear, cpu.W4A16Linear: gb.W4A16Linear, cpu.W4A8Linear: gb.W4A8Linear,
             cpu.TrellisLinear: gb.TrellisLinear}
    if type(linear) not in kinds:
        raise ValueError(f"no GPU Linear for {type(linear).__name__}")
    return kinds[type(linear)](linear.weight)


class ConcatOutputs(cpu.ConcatOutputs):
    """engine.backend.cpu.ConcatOutputs over GPU Linears: the outputs join on the device."""

    def __call__(self, x) -> cp.ndarray:
        return cp.concatenate([p(x) for p in self.parts], axis=-1)


class HostHead:
    """A head that runs on the host as the CPU model runs it (engine.heads.RescoredHead: its tables
    are meant to stay in host memory); hidden rows go down, logits come back up."""

    def __init__(self, head):
        self.head = head

    def __call__(self, hidden) -> cp.ndarray:
        return cp.asarray(self.head(cp.asnumpy(hidden)))


class GpuShortlistHead:
    """engine.heads.ShortlistHead: the shortlisted ids' logits, -inf elsewhere."""

    def __init__(self, linear, ids: np.ndarray, vocab: int):
        self.linear, self.ids, self.vocab = linear, cp.asarray(ids), vocab

    def __call__(self, hidden) -> cp.ndarray:
        scores = self.linear(hidden)
        logits = cp.full((scores.shape[0], self.vocab), -np.inf, cp.float32)
        logits[:, self.ids] = scores
        return logits


def gpu_head(head, lm_head=None, lm_head_gpu=None):
    """The output head (or, with lm_head given, the draft head) on the device where our kernels run it.

    A draft shortlist of a float head's leading rows is a view of the head's device rows, as it is a
    view of the head's host rows on the CPU.
    """
    if isinstance(head, ShortlistHead):
        linear = head.linear
        if (isinstance(linear, cpu.DenseLinear) and isinstance(lm_head, cpu.DenseLinear)
                and isinstance(lm_head_gpu, gb.DenseLinear)
                and linear.weight.ctypes.data == lm_head.weight.ctypes.data):
            return GpuShortlistHead(gb.DenseLinear(lm_head_gpu.weight[: linear.weight.shape[0]]), head.ids, head.vocab)
        try:
            return GpuShortlistHead(gpu_linear(linear), head.ids, head.vocab)
        except ValueError:  # rows our W4 kernels do not take (not a multiple of 16): run it as the CPU does
            return HostHead(head)
    if isinstance(head, (cpu.DenseLinear, cpu.W4A16Linear, cpu.W4A8Linear, cpu.TrellisLinear, cpu.PermutedInput,
                         cpu.ConcatOutputs)):
        return gpu_linear(head)
    return HostHead(head)


class Embedding:
    """The token table on the device: bf16 bits when every value is a bf16 (checkpoints store bf16;
    the reader widened them to fp32 exactly), else fp32 (a GGUF table dequantized, as the CPU model's
    row lookup dequantizes). Gathered rows come back fp32 [T, H]."""

    ROWS_AT_ONCE = 4096  # host rows checked and narrowed at a time (no full-size temporaries)

    def __init__(self, table):
        if isinstance(table, cp.ndarray):  # already on the device (a tied head's fp32 rows)
            self.table, self.bf16 = table, False
            return
        if not isinstance(table, np.ndarray):  # a quantized table (GGUF token_embd): its exact fp32 values
            table = table.dequantize()
        bits = np.ascontiguousarray(table, dtype=np.float32).view(np.uint32)
        blocks = range(0, bits.shape[0], self.ROWS_AT_ONCE)
        self.bf16 = not any(np.any(bits[i:i + self.ROWS_AT_ONCE] & 0xFFFF) for i in blocks)
        if not self.bf16:
            self.table = _dev(table)
            return
        high = np.empty(bits.shape, np.uint16)
        for i in blocks:
            high[i:i + self.ROWS_AT_ONCE] = bits[i:i + self.ROWS_AT_ONCE] >> 16
        self.table = cp.asarray(high)

    def __call__(self, ids: cp.ndarray) -> cp.ndarray:
        rows = self.table[ids]  # [T, H]
        return (rows.astype(cp.uint32) << cp.uint32(16)).view(cp.float32) if self.bf16 else rows


# -------------------------------------------------------------------------------- rows ---

class Rows:
    """Where a call's T rows sit. starts int32 [ceil(T / MAX_ROWS)] on the device: the cache index
    of row i * MAX_ROWS; rope_start int32 [1]: the rotary position of row 0 (the cache index of row 0
    but for the MTP layer, whose position runs one ahead of its rows). `past` is the host's bound on
    the cache index of row 0, which sizes attention grids (the true index when uncaptured, a
    bucket's start in a graph)."""

    def __init__(self, T: int, starts: cp.ndarray, past: int, rope_start: cp.ndarray | None = None):
        self.T, self.starts, self.past = T, starts, past
        self.rope_start = starts[:1] if rope_start is None else rope_start

    @classmethod
    def at(cls, index: int, T: int, rope_offset: int = 0) -> Rows:
        starts = cp.asarray(index + np.arange(0, T, MAX_ROWS), dtype=cp.int32)
        rope = cp.asarray([index + rope_offset], dtype=cp.int32) if rope_offset else None
        return cls(T, starts, index, rope)

    def slices(self):
        """(row slice, its cache index int32 [1] on the device, host bound of that index)."""
        for i, s in enumerate(range(0, self.T, MAX_ROWS)):
            yield slice(s, min(self.T, s + MAX_ROWS)), self.starts[i:i + 1], self.past + s


# ---------------------------------------------------------------------------- layers ---

class Attention:
    """Gated full attention (engine.model.Attention)."""

    def __init__(self, a: cpu_model.Attention):
        c = self.config = a.config
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (gpu_linear(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        self.q_norm, self.k_norm = _dev(a.q_norm), _dev(a.k_norm)
        # engine.model.rope_tables' inv_freq, the same fp32 expression
        self.inv_freq = _dev(1.0 / c.rope_theta ** (np.arange(0, c.rotary_dim, 2, dtype=np.float32) / c.rotary_dim))

    def new_cache(self, kv: str = "full") -> gb.KVCache | gb.Q4KVCache:
        c = self.config
        cache = gb.Q4KVCache if kv == "q4" else gb.KVCache
        return cache(c.num_key_value_heads, c.head_dim, KV_CAPACITY)

    def __call__(self, x: cp.ndarray, cache, rows: Rows) -> cp.ndarray:
        c = self.config
        T, heads, kv, hd, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        q_and_gate = self.q_proj(x)  # [T, heads * 2 * hd], per head [query | gate]
        q = gb.qk_norm_rope(q_and_gate, self.q_norm, self.inv_freq, rows.rope_start, heads, hd, 2 * hd, c.rotary_dim, eps)
        k = gb.qk_norm_rope(self.k_proj(x), self.k_norm, self.inv_freq, rows.rope_start, kv, hd, hd, c.rotary_dim, eps)
        v = self.v_proj(x).reshape(T, kv, hd)
        out = cp.empty((T, heads * hd), cp.float32)
        for piece, start, past in rows.slices():
            cache.append(k[piece], v[piece], start)
            out[piece] = gb.attend(q[piece], cache, start, past)
        return self.o_proj(gb.attention_gate(out, q_and_gate, hd))


class DeltaNet:
    """Gated DeltaNet (engine.model.DeltaNet), the recurrence row by row with a state after each row."""

    def __init__(self, d: cpu_model.DeltaNet):
        self.config = d.config
        self.in_proj, self.out_proj = gpu_linear(d.in_proj), gpu_linear(d.out_proj)
        self.conv = _dev(d.conv)  # [channels, kernel]
        self.decay_rate, self.dt_bias, self.norm = _dev(d.decay_rate), _dev(d.dt_bias), _dev(d.norm)

    def new_cache(self, kv: str = "full") -> gb.DeltaNetState:
        c = self.config
        return gb.DeltaNetState(self.conv.shape[0], self.conv.shape[1], c.linear_num_value_heads,
                                c.linear_key_head_dim, c.linear_value_head_dim)

    def __call__(self, x: cp.ndarray, state: gb.DeltaNetState, rows: Rows) -> cp.ndarray:
        c = self.config
        T = x.shape[0]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        channels = 2 * hk * dk + hv * dv
        projected = self.in_proj(x)  # [T, channels + Hv * dv + 2 Hv]: q | k | v | z | b | a
        mixed = cp.ascontiguousarray(projected[:, :channels])
        z = cp.ascontiguousarray(projected[:, channels : channels + hv * dv]).reshape(T * hv, dv)
        b, a = cp.ascontiguousarray(projected[:, -2 * hv : -hv]), cp.ascontiguousarray(projected[:, -hv:])  # [T, Hv]
        out = cp.empty((T, hv, dv), cp.float32)
        for piece, _, _ in rows.slices():
            conv = gb.causal_conv(mixed[piece], self.conv, state)  # [t, channels] after SiLU
            q = gb.l2_norm_heads(conv, hk, dk, dk ** -0.5)  # [t, Hk, dk]; value heads share them in the kernel
            k = gb.l2_norm_heads(conv, hk, dk, 1.0, offset=hk * dk)
            v = conv[:, 2 * hk * dk:].reshape(-1, hv, dv)
            out[piece] = gb.delta_rule_rows(q, k, v, b[piece], a[piece], self.decay_rate, self.dt_bias, state)
        normed = gb.gated_rms_norm(out.reshape(T * hv, dv), z, self.norm, c.rms_norm_eps)
        return self.out_proj(normed.reshape(T, hv * dv))


class MLP:
    def __init__(self, m: cpu_model.MLP):
        self.gate_up, self.down = gpu_linear(m.gate_up), gpu_linear(m.down)

    def __call__(self, x: cp.ndarray) -> cp.ndarray:
        return self.down(gb.silu_mul(self.gate_up(x)))


class MoE:
    """Routed experts plus a gated shared expert (engine.model.MoE). The router's logits come to the
    host and the experts are chosen there by the CPU model's own code, so both pick the same experts
    from the same logits; the experts run on the device over their rows."""

    def __init__(self, m: cpu_model.MoE):
        self.router, self.shared_gate = gpu_linear(m.router), gpu_linear(m.shared_gate)
        self.experts = [MLP(e) for e in m.experts]
        self.shared = MLP(m.shared)
        self.top_k, self.normalize = m.top_k, m.normalize

    def __call__(self, x: cp.ndarray) -> cp.ndarray:
        probs = cpu_model.softmax(cp.asnumpy(self.router(x)), axis=-1)  # [T, E]
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]  # [T, k]
        weights = np.take_along_axis(probs, chosen, axis=-1)
        if self.normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        out = self.shared(x) / (1.0 + cp.exp(-self.shared_gate(x)))  # sigmoid(gate) * shared, [T, H]
        for expert in np.unique(chosen):
            rows, slot = np.nonzero(chosen == expert)  # each row picks an expert at most once
            index = cp.asarray(rows)
            out[index] += self.experts[expert](x[index]) * cp.asarray(weights[rows, slot], dtype=cp.float32)[:, None]
        return out


class Layer:
    def __init__(self, layer: cpu_model.DecoderLayer):
        self.mixer = Attention(layer.mixer) if isinstance(layer.mixer, cpu_model.Attention) else DeltaNet(layer.mixer)
        self.ffn = MoE(layer.ffn) if isinstance(layer.ffn, cpu_model.MoE) else MLP(layer.ffn)
        self.input_norm, self.post_norm, self.eps = _dev(layer.input_norm), _dev(layer.post_norm), layer.eps

    def __call__(self, x: cp.ndarray, cache, rows: Rows) -> cp.ndarray:
        x = x + self.mixer(gb.rms_norm(x, self.input_norm, self.eps), cache, rows)
        return x + self.ffn(gb.rms_norm(x, self.post_norm, self.eps))


class MTPHead:
    def __init__(self, h: cpu_model.MTPHead):
        self.fc, self.layer = gpu_linear(h.fc), Layer(h.layer)
        self.norm_embedding, self.norm_hidden, self.norm = _dev(h.norm_embedding), _dev(h.norm_hidden), _dev(h.norm)


# ----------------------------------------------------------------------------- state ---

class GpuState:
    """engine.cache.SequenceState on the device: a cache per layer, the token count, and what the
    captured cycles read and write: `inputs` int32 [1 + MAX_ROWS] (the position of row 0, then the
    tokens of a short call), `ring` int32 [RING_SLOTS, MAX_ROWS] of greedy ids with `ring_count`
    (uint64 [1]) cycles pushed, and the graphs captured for this state."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
        self.length_before_last_call = 0
        self.inputs = cp.zeros(1 + MAX_ROWS, cp.int32)
        self.ring = cp.full((RING_SLOTS, MAX_ROWS), -1, cp.int32)
        self.ring_count = cp.zeros(1, cp.uint64)
        self.graphs: dict[tuple, CycleGraph] = {}
        self.graphs_version = -1  # the GpuModel weights version the graphs were captured with

    def attention_caches(self) -> list:
        return [c for c in self.layers if not isinstance(c, gb.DeltaNetState)]

    def reserve(self, rows: int) -> None:
        """Room for `rows` positions in every attention cache; moved arrays void the graphs."""
        if any([cache.reserve(rows) for cache in self.attention_caches()]):
            self.graphs.clear()

    def advance(self, T: int) -> None:
        self.length_before_last_call = self.length
        self.length += T
        self._sync_caches()

    def keep(self, rows: int) -> None:
        """Roll back the last short call to its first `rows` rows (engine.cache.SequenceState.keep)."""
        end = self.length_before_last_call + rows
        for cache in self.layers:
            if isinstance(cache, gb.DeltaNetState):
                cache.keep(rows)
        self.length = end
        self._sync_caches()

    def rewind(self, length: int) -> None:
        """Cut an attention-only state (the MTP head's) back to `length` tokens."""
        assert len(self.attention_caches()) == len(self.layers)
        self.length = length
        self._sync_caches()

    def _sync_caches(self) -> None:
        # The caches' own counts move with uncaptured appends only (a replay runs no host code); the
        # kernels never read them, so the state's count is the one kept.
        for cache in self.attention_caches():
            cache.length = self.length


# ----------------------------------------------------------------------------- model ---

class GpuModel:
    def __init__(self, model: cpu_model.Model):
        self.config = model.config
        self.version = 0  # bumped by take_weights: graphs of older weights are never replayed
        self.warm: set[int] = set()  # row counts whose kernels have run uncaptured (loaded, cuBLAS set up)
        self.graph_error: str | None = None  # why graphs were given up, if they were
        self._last_graph: tuple[cp.ndarray, CycleGraph] | None = None
        self._load(model)

    def _load(self, m: cpu_model.Model) -> None:
        self.layers = [Layer(layer) for layer in m.layers]
        self.norm = _dev(m.norm)
        self.lm_head = gpu_head(m.lm_head)
        self.draft_head = None if m.draft_head is None else gpu_head(m.draft_head, m.lm_head, self.lm_head)
        tied = isinstance(self.lm_head, gb.DenseLinear) and m.lm_head.weight is m.embed
        self.embed = Embedding(self.lm_head.weight if tied else m.embed)
        self.mtp = None if m.mtp is None else MTPHead(m.mtp)
        self.graphable = not any(isinstance(layer.ffn, MoE) for layer in self.layers) and not isinstance(self.lm_head, HostHead)

    def take_weights(self, other: cpu_model.Model) -> None:
        """Run from now on with other's weights (engine.loader.LoadedModel.use_route hands a CPU Model
        of the same checkpoint under another route). The old device weights go first, so the card
        never holds both routes."""
        if other.config is not self.config:
            raise ValueError("take_weights needs a Model of the same checkpoint")
        self.layers = self.lm_head = self.draft_head = self.embed = self.mtp = self._last_graph = None
        self._load(other)
        self.version += 1
        self.warm = set()  # the new route's kernels have not run yet

    def new_state(self, kv: str = "full") -> GpuState:
        return GpuState([layer.mixer.new_cache(kv) for layer in self.layers])

    def forward(self, state: GpuState, tokens, last_only: bool = False) -> cp.ndarray:
        """Run T new tokens; returns the post-final-norm hidden states [T, H] (device) and advances state.
        last_only: the last row only [1, H]; computed like the others (the CPU model skips work there)."""
        ids = np.asarray(tokens, dtype=np.int32)
        T = len(ids)
        state.reserve(state.length + T)
        if T <= MAX_ROWS:
            state.inputs[: 1 + T].set(np.concatenate([[state.length], ids]).astype(np.int32))
            hidden = self._short(state, T)
        else:
            rows = Rows.at(state.length, T)
            hidden = self._layers(self.embed(cp.asarray(ids)), state.layers, rows)
        state.advance(T)
        return hidden[-1:] if last_only else hidden

    def _short(self, state: GpuState, T: int) -> cp.ndarray:
        graph = self.cycle_graph(state, T)
        if graph is not None:
            hidden = graph.replay()
            self._last_graph = (hidden, graph)
            return hidden
        hidden = self.rows_pass(state, T, state.length)
        self.warm.add(T)
        return hidden

    def rows_pass(self, state: GpuState, T: int, past: int) -> cp.ndarray:
        """The uncaptured pass of a short call whose tokens and position are in state.inputs."""
        x = self.embed(state.inputs[1:1 + T])
        return self._layers(x, state.layers, Rows(T, state.inputs[:1], past))

    def _layers(self, x: cp.ndarray, caches: list, rows: Rows) -> cp.ndarray:
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache, rows)
        return gb.rms_norm(x, self.norm, self.config.rms_norm_eps)

    def cycle_graph(self, state: GpuState, T: int) -> CycleGraph | None:
        """The captured cycle for T rows at this state's length, captured now if need be; None when
        this model runs uncaptured or T has not run uncaptured yet (kernels loaded, workspaces made)."""
        if not self.graphable or T not in self.warm:
            return None
        if state.graphs_version != self.version:
            state.graphs.clear()
            state.graphs_version = self.version
        chunks = -(-(state.length + T) // ATTENTION_CHUNK)
        end = ATTENTION_CHUNK * (1 << (chunks - 1).bit_length())  # a power-of-two number of key chunks
        key = (T, end)
        if key not in state.graphs:
            try:
                state.graphs[key] = CycleGraph(self, state, T, end - T)
            except Exception as error:  # a capture the driver or a library refuses: run uncaptured from now on
                self.graphable, self.graph_error = False, f"{type(error).__name__}: {error}"
                return None
        return state.graphs[key]

    def logits(self, hidden) -> np.ndarray:
        """[T, V] fp32 numpy. For the hidden states a replay just returned, the graph's own logits."""
        if self._last_graph is not None and hidden is self._last_graph[0]:
            return cp.asnumpy(self._last_graph[1].logits)
        return cp.asnumpy(self.lm_head(hidden))

    def draft_logits(self, hidden) -> np.ndarray:
        """Logits a drafter ranks: the shortlisted ids only (-inf elsewhere) when there is a shortlist."""
        return cp.asnumpy((self.lm_head if self.draft_head is None else self.draft_head)(hidden))

    def new_mtp_state(self) -> GpuState:
        return GpuState([self.mtp.layer.mixer.new_cache()])

    def mtp_forward(self, state: GpuState, next_tokens, hidden) -> cp.ndarray:
        """MTP over rows t: next_tokens[t] = x_{t+1}, hidden[t] = h_t (engine.model.Model.mtp_forward):
        the MTP layer sees x_{t+1} at position t + 1, its cache holding row t at index t."""
        head, eps = self.mtp, self.config.rms_norm_eps
        ids = np.asarray(next_tokens, dtype=np.int32)
        T = len(ids)
        state.reserve(state.length + T)
        e = gb.rms_norm(self.embed(cp.asarray(ids)), head.norm_embedding, eps)
        h = gb.rms_norm(hidden, head.norm_hidden, eps)
        x = head.fc(cp.concatenate([e, h], axis=-1))  # [T, 2H] -> [T, H], embedding first
        x = head.layer(x, state.layers[0], Rows.at(state.length, T, rope_offset=1))
        state.advance(T)
        return gb.rms_norm(x, head.norm, eps)


class CycleGraph:
    """One short call of T rows captured as a CUDA graph: embedding of state.inputs' tokens, every
    layer at state.inputs' position, final norm, logits [T, V] and greedy ids [T], the ids pushed into
    state.ring. Its temporaries come from a memory pool of its own, kept as long as the graph, so no
    later allocation can land in memory a replay writes."""

    def __init__(self, model: GpuModel, state: GpuState, T: int, past: int):
        self.pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        for name in ("argmax_rows", "ring_push"):  # the one module only the graph uses: loaded before capture
            kernel("sampling", name)
        with cp.cuda.using_allocator(self.pool.malloc), stream:
            stream.begin_capture()
            try:
                self.hidden = model.rows_pass(state, T, past)
                self.logits = model.lm_head(self.hidden)
                self.ids = gb.argmax(self.logits)
                gb.ring_push(self.ids, state.ring, state.ring_count)
            except Exception:
                try:
                    stream.end_capture()
                except Exception:  # the capture is already invalid; the first error is the one to report
                    pass
                raise
            self.graph = stream.end_capture()

    def replay(self) -> cp.ndarray:
        """Launch on the current stream (after whatever wrote state.inputs); a copy of the hidden
        states, which the next replay overwrites."""
        self.graph.launch(stream=cp.cuda.get_current_stream())
        return self.hidden.copy()
