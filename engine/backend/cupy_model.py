"""The GPU op set: engine/model.py's layers on engine/backend/cupy_backend.py's kernels.

`GpuOps` has the methods engine/backend/cpu_ops.CpuOps has, so engine/assemble.py builds a GPU
model from the stored tensors as it builds a CPU one: every Linear is made on the device straight
from its stored weight (a quantized weight on the bf16 route is dequantized one matrix at a time
on its way up), and the layers are engine/model.py's. One GpuOps serves one loaded model: it keeps
that model's CUDA-graph bookkeeping. The CPU op set stays the reference every GPU test holds this
one to.

Flash-Next (engine/flash_next.py) runs here too: GpuOps has its steps (stream norms, hyper-connection
mixing and injection, the PLE gate and dilated conv, QSA's indexed attention) over
engine/kernels/flash_next.cu and attention.cu's sparse partials. Its n-gram rows are gathered on the
host, where the table lives, and go up as [T, heads * D]; its token history stays on the host.

Rows. A call of T <= MAX_ROWS tokens (a decode step, or a verify of the last token plus drafts)
runs every layer once over all rows. A longer call (prefill) runs the Linears over all rows and
the DeltaNet and attention cores MAX_ROWS rows at a time, each slice exactly as a verify of its
rows would run. A position is a `Rows`. Hidden states stay on the device, and so do the logits
where the sampler needs less than whole rows: argmax ids for greedy decoding (Model.greedy_ids),
the ids top-k keeps for top-k sampling (top_k_candidates); other settings get whole rows on the host.
Routed experts the card does not hold (engine/experts.py's placement) run on the host as the CPU's
Linears (host_expert).

Where the numbers differ from the CPU op set (the GPU tests' tolerances cover each):
- fp32 sums in other orders (GEMVs, attention, norms), and the bf16 KV cache keeps bf16 rows on the
  card where the CPU keeps fp32;
- a DeltaNet prefill runs the recurrence row by row, where the CPU uses the chunked form;
- a q4-KV prefill reads its own earlier rows as the cache holds them (the CPU reads the rows of one
  prefill call exact; Flash-Next's QSA reads them as the GPU does, MAX_ROWS rows at a time): prompts
  shorter than SINK_ROWS + RECENT_ROWS tokens see no difference;
- fp32 float matrices (a GGUF F32 or a dequantized tensor on the bf16 route) are cuBLAS products,
  which do not promise a verify row the bits of the one-row step it stands for; a checkpoint's bf16
  matrices (bf16_gemv, kept bf16 on the card) and the W4 routes' kernels compute every row the same
  way at any row count.

Decode cycles as CUDA graphs. A short call on a dense model is captured once per (rows, attention
grid) and replayed: tokens and the position are read on the device from `state.inputs`, so the
same graph serves every cycle; the graph also computes the logits. Grids are sized for a
power-of-two number of ATTENTION_CHUNK key chunks, and chunks past a row's end are empty, which
the combine skips, so a replay computes what the uncaptured pass computes. MoE layers route on the
host, and a head computed on the host cannot be captured: those models (Flash-Next among them, whose
n-gram rows are gathered on the host too) run uncaptured.
"""

from __future__ import annotations

import functools

import cupy as cp
import numpy as np

from duet.engine.backend import cpu
from duet.engine.backend.cpu_ops import rope_frequencies
from duet.engine.backend import cupy_backend as gb
from duet.engine.backend.cupy_backend import ATTENTION_CHUNK, MAX_ROWS
from duet.engine.cache import PLEState
from duet.engine.config import ModelConfig
from duet.engine.model import MoE
from duet.engine.sampling import candidate_rows
from duet.engine.weights import take_rows

KV_CAPACITY = 256  # rows an attention cache starts with (it doubles as a sequence grows), as engine.cache


def _dev(a) -> cp.ndarray:
    return cp.ascontiguousarray(cp.asarray(a, dtype=cp.float32))


# ------------------------------------------------------------------------------ weights ---

class ConcatOutputs(cpu.ConcatOutputs):
    """engine.backend.cpu.ConcatOutputs over GPU Linears: the outputs side by side as gb.Columns,
    joined on the device only where a reader needs them whole."""

    def __call__(self, x) -> gb.Columns:
        return gb.Columns([p(x) for p in self.parts])


class OnHost:
    """A Linear or head that runs on the host as the CPU op set runs it (engine.heads.RescoredHead,
    whose tables are meant to stay in host memory; a shortlist part our kernels do not take): rows
    go down, outputs come back up."""

    def __init__(self, linear):
        self.linear = linear

    def __call__(self, x) -> cp.ndarray:
        return cp.asarray(self.linear(cp.asnumpy(gb.device_f32(x))))


class GpuShortlistHead:
    """engine.heads.ShortlistHead: the shortlisted ids' logits, -inf elsewhere."""

    def __init__(self, linear, ids: np.ndarray, vocab: int):
        self.linear, self.ids, self.vocab = linear, ids, vocab
        self.device_ids = cp.asarray(ids)

    def scores(self, hidden) -> cp.ndarray:
        return gb.device_f32(self.linear(hidden))

    def __call__(self, hidden) -> cp.ndarray:
        scores = self.scores(hidden)
        logits = cp.full((scores.shape[0], self.vocab), -np.inf, cp.float32)
        logits[:, self.device_ids] = scores
        return logits

    def greedy_ids(self, hidden) -> cp.ndarray:
        """engine.heads.ShortlistHead.greedy_ids, left on the device."""
        return self.device_ids[self.scores(hidden).argmax(axis=-1)]


class Embedding:
    """The token table on the device: bf16 bits when every value is a bf16 (checkpoints store bf16;
    the reader widened them to fp32 exactly; a tied bf16 head's own bits), else fp32 (a GGUF table
    dequantized, as the CPU op set's row lookup dequantizes, or a tied fp32 head's device rows).
    `embed[ids]` gathers fp32 rows [T, H] (bf16 rows widened in the same launch); ids on the host
    or the device."""

    ROWS_AT_ONCE = 4096  # host rows checked and narrowed at a time (no full-size temporaries)

    def __init__(self, table, bf16: bool = False):
        if isinstance(table, cp.ndarray):  # already on the device: a tied head's rows, bf16 bits with `bf16`
            self.table, self.bf16 = table, bf16
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

    def __getitem__(self, ids) -> cp.ndarray:
        if not self.bf16:
            return self.table[cp.asarray(ids)]  # [T, H]
        return gb.embed_bf16(self.table, ids)


# -------------------------------------------------------------------------------- rows ---

class Rows:
    """Where a call's T rows sit. starts int32 [ceil(T / MAX_ROWS)] on the device: the cache index
    of row i * MAX_ROWS; rope_start int32 [1]: the rotary position of row 0 (the cache index of row 0
    but for the MTP layer, whose position runs one ahead of its rows). `past` is the host's bound on
    the cache index of row 0, which sizes attention grids (the true index when uncaptured, a
    bucket's start in a graph)."""

    def __init__(self, T: int, starts: cp.ndarray, past: int, rope_start: cp.ndarray | None = None, rope_offset: int = 0):
        self.T, self.starts, self.past = T, starts, past
        self.rope_start = starts[:1] if rope_start is None else rope_start
        self.rope_offset = rope_offset  # rope_start - starts[0], on the host

    @classmethod
    def at(cls, index: int, T: int, rope_offset: int = 0) -> Rows:
        starts = cp.asarray(index + np.arange(0, T, MAX_ROWS), dtype=cp.int32)
        rope = cp.asarray([index + rope_offset], dtype=cp.int32) if rope_offset else None
        return cls(T, starts, index, rope, rope_offset)

    def slices(self):
        """(row slice, its cache index int32 [1] on the device, host bound of that index)."""
        for i, s in enumerate(range(0, self.T, MAX_ROWS)):
            yield slice(s, min(self.T, s + MAX_ROWS)), self.starts[i:i + 1], self.past + s


# ------------------------------------------------------------------------------ op set ---

class GpuOps:
    """engine/model.py's layers on the device, for one loaded model of `config`. Positions are `Rows`.

    Graph bookkeeping: `version` counts the weights the model has taken (a route switch), so graphs
    of older weights are never replayed; `warm` the row counts whose kernels have run uncaptured
    since (loaded, cuBLAS set up); `graphable` turns capture off (a refused capture sets it, with
    `graph_error` saying why)."""

    # A verify row's extra time in decode steps (engine/speculative.py's Depth): the W4 kernels read the
    # weights once for up to 16 rows. The seed's 3090 ran an 8-row cycle of a 7-token drafter in 1.23
    # decode steps, drafter included (REFERENCE.md section 6: 5.9 tokens at 276.7 tok/s against 57.8).
    VERIFY_ROW_COST = 0.03
    LAST_ROW_ALONE = False  # a layer's launches (and a graph) serve every row of a call (forward)

    def __init__(self, config: ModelConfig):
        self.inv_freq = _dev(rope_frequencies(config.rotary_dim, config.rope_theta))  # the CPU's fp32 inv_freq
        self.query_heads = config.num_attention_heads
        self.version = 0
        self.warm: set[int] = set()
        self.graphable = True
        self.graph_error: str | None = None
        self._last_graph: tuple[cp.ndarray, CycleGraph] | None = None
        self.forms = 0  # what the kernels feeding Linears emit beside fp32: the forms the Linears made read

    # ---- assembly: stored tensors -> what the layers hold

    def linear(self, weight, route: str):
        """The route's GPU Linear for a stored weight; ValueError where our kernels do not take it. The
        form it reads joins those the kernels feeding Linears emit (gb.Activations)."""
        linear = cpu.make_linear(weight, route, gb)
        self.forms |= getattr(linear, "READS", 0)
        return linear

    def concat_outputs(self, linears: list) -> ConcatOutputs:
        return ConcatOutputs(linears)

    def vector(self, values: np.ndarray) -> cp.ndarray:
        return _dev(values)

    def embedding(self, table, tied_head=None) -> Embedding:
        """The token table, or a tied float head's device rows (one upload for both)."""
        if isinstance(tied_head, gb.BF16Linear):
            return Embedding(tied_head.bits, bf16=True)
        return Embedding(tied_head.weight if isinstance(tied_head, gb.DenseLinear) else table)

    def host_head(self, head) -> OnHost:
        """A head, or a routed expert kept in host RAM (engine/experts.py's placement): run on the host."""
        return OnHost(head)

    host_expert = host_head

    def shortlist_part(self, head, matrix, rows: np.ndarray | slice, route: str):
        """Leading rows of a float head: a view of the head's device rows. Other rows: a GPU Linear,
        or on the host where our kernels do not take them (W4 rows not a multiple of 16)."""
        if isinstance(rows, slice) and isinstance(head, gb.DenseLinear):
            return gb.DenseLinear(head.weight[rows])
        if isinstance(rows, slice) and isinstance(head, gb.BF16Linear):
            return head.leading_rows(rows.stop)
        part = take_rows(matrix, rows)
        try:
            return self.linear(part, route)
        except ValueError:
            return OnHost(cpu.make_linear(part, route))

    def shortlist_head(self, linear, ids: np.ndarray, vocab: int) -> GpuShortlistHead:
        return GpuShortlistHead(linear, ids, vocab)

    def weights_taken(self) -> None:
        """After Model.take_weights (a route switch): graphs of the old weights are never replayed."""
        self.version += 1
        self.warm = set()  # the new route's kernels have not run yet
        self._last_graph = None

    # ---- states

    def new_state(self, caches: list) -> GpuState:
        return GpuState(caches)

    def kv_cache(self, kv_heads: int, head_dim: int, kv: str) -> gb.KVCache | gb.Q4KVCache:
        if kv == "q4":
            return gb.Q4KVCache(kv_heads, head_dim, KV_CAPACITY)
        return gb.KVCache(kv_heads, head_dim, KV_CAPACITY, query_heads=self.query_heads)

    def deltanet_state(self, channels: int, kernel: int, value_heads: int, key_dim: int, value_dim: int) -> gb.DeltaNetState:
        return gb.DeltaNetState(channels, kernel, value_heads, key_dim, value_dim)

    # ---- a pass

    def forward(self, model, state: GpuState, ids: np.ndarray, last_only: bool) -> cp.ndarray:
        """model.run_layers over the embedded ids; advances the state. last_only: the last row only
        [1, H], computed like the others (the layers' `first` is always 0 here: a graph serves any call)."""
        T = len(ids)
        state.reserve(state.length + T)
        if T <= MAX_ROWS:
            state.inputs[: 1 + T].set(np.concatenate([[state.length], ids]).astype(np.int32))
            hidden = self._short(model, state, ids)
        else:
            hidden = model.run_layers(model.embed[ids], state.layers, Rows.at(state.length, T), ids=ids)
        state.advance(T)
        return hidden[-1:] if last_only else hidden

    def _short(self, model, state: GpuState, ids: np.ndarray) -> cp.ndarray:
        T = len(ids)
        graph = self.cycle_graph(model, state, T)
        if graph is not None:
            hidden = graph.replay()
            self._last_graph = (hidden, graph)
            return hidden
        hidden = self.rows_pass(model, state, T, state.length, ids)
        if T not in self.warm and self.graphable and capturable(model):
            model.lm_head(hidden)  # a graph captures the head too: its kernels load now, once a row count
        self.warm.add(T)
        return hidden

    def rows_pass(self, model, state: GpuState, T: int, past: int, ids: np.ndarray | None = None) -> cp.ndarray:
        """The uncaptured pass of a short call whose tokens and position are in state.inputs. ids: the
        tokens on the host, for layers that read them there (Flash-Next's n-gram rows; such a model is
        never captured); None in a capture."""
        return model.run_layers(model.embed[state.inputs[1:1 + T]], state.layers, Rows(T, state.inputs[:1], past), ids=ids)

    def cycle_graph(self, model, state: GpuState, T: int) -> CycleGraph | None:
        """The captured cycle for T rows at this state's length, captured now if need be; None when
        this model runs uncaptured or T has not run uncaptured yet (kernels loaded, workspaces made)."""
        if not (self.graphable and capturable(model)) or T not in self.warm:
            return None
        if state.graphs_version != self.version:
            state.graphs.clear()
            state.graphs_version = self.version
        chunks = -(-(state.length + T) // ATTENTION_CHUNK)
        end = ATTENTION_CHUNK * (1 << (chunks - 1).bit_length())  # a power-of-two number of key chunks
        key = (T, end)
        if key not in state.graphs:
            try:
                state.graphs[key] = CycleGraph(self, model, state, T, end - T)
            except Exception as error:  # a capture the driver or a library refuses: run uncaptured from now on
                self.graphable, self.graph_error = False, f"{type(error).__name__}: {error}"
                return None
        return state.graphs[key]

    def logits(self, model, hidden: cp.ndarray) -> cp.ndarray:
        """[T, V]. For the hidden states a replay just returned, the graph's own logits."""
        if self._last_graph is not None and hidden is self._last_graph[0]:
            return self._last_graph[1].logits
        return model.lm_head(hidden)

    @staticmethod
    def mtp_plan(model) -> None:
        """No one-call MTP pass here (CpuOps.mtp_plan): the head's layer runs its own kernels."""
        return None

    def mtp_position(self, state: GpuState, T: int) -> Rows:
        """The MTP layer sees x_{t+1} at position t + 1, its cache holding row t at index t."""
        state.reserve(state.length + T)
        return Rows.at(state.length, T, rope_offset=1)

    def to_host(self, x) -> np.ndarray:
        return cp.asnumpy(x)

    def top_k_candidates(self, logits: cp.ndarray, top_k: int, temperature: float) -> tuple[np.ndarray, np.ndarray | None]:
        """CpuOps.top_k_candidates, the kept entries found on the card: a few hundred bytes a row
        cross instead of V * 4 (1 MB at V = 248,320)."""
        T, V = logits.shape
        if not 0 < top_k < V:
            return cp.asnumpy(logits), None
        scaled = logits / np.float32(temperature)
        kth = cp.partition(scaled, V - top_k, axis=-1)[:, V - top_k : V - top_k + 1]  # [T, 1]
        rows, columns = cp.nonzero(scaled >= kth)
        return candidate_rows(T, cp.asnumpy(rows), cp.asnumpy(columns), cp.asnumpy(logits[rows, columns]))

    def to_device(self, x: np.ndarray) -> cp.ndarray:
        return cp.asarray(x)

    def concat(self, parts: list, axis: int = -1) -> cp.ndarray:
        return cp.concatenate(parts, axis=axis)

    rms_norm = staticmethod(gb.rms_norm)

    def add_rms_norm(self, x: cp.ndarray, delta: cp.ndarray | None, weight, eps: float,
                     for_linears: bool = False) -> tuple[cp.ndarray, cp.ndarray | gb.Activations]:
        """CpuOps.add_rms_norm: the residual add inside the norm's kernel (one launch, not two); for
        Linears, the norm also in the forms they read (no conversion launched by each)."""
        forms = self.forms if for_linears else 0
        return (x, gb.rms_norm(x, weight, eps, forms)) if delta is None else gb.add_rms_norm(x, delta, weight, eps, forms)

    def sigmoid(self, x: cp.ndarray) -> cp.ndarray:
        return 1.0 / (1.0 + cp.exp(-x))

    def swiglu(self, gate_up, x: cp.ndarray) -> cp.ndarray:
        """[T, 2I] (gate | up) -> [T, I], for the down projection: in gate_up's epilogue where it has one."""
        if isinstance(gate_up, (gb.SwiGLUW4A16Linear, gb.SwiGLUW4A8Linear, gb.SwiGLUBF16Linear)):
            return gate_up.swiglu(x, self.forms)
        return gb.silu_mul(gate_up(x), self.forms)

    @staticmethod
    def gate_up(linear):
        """An MLP's gate | up Linear in the form swiglu takes: W4A16's, W4A8's and bf16's with SwiGLU in
        the product."""
        if type(linear) is gb.W4A16Linear and linear.N % 32 == 0:
            return gb.SwiGLUW4A16Linear(linear)
        if type(linear) is gb.W4A8Linear and linear.N % 64 == 0:
            return gb.SwiGLUW4A8Linear(linear)
        return gb.SwiGLUBF16Linear(linear) if type(linear) is gb.BF16Linear else linear

    def attention(self, layer, qkv: cp.ndarray, cache, rows: Rows, first: int) -> cp.ndarray:
        """Gated attention's core (engine.backend.cpu_ops.CpuOps.attention; `first` is 0, see forward):
        per slice of rows, its keys and values into the cache, then its queries attend. The kernels
        read the stacked projection's columns in place."""
        c = layer.config
        heads, kv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        assert first == 0, "GpuOps.forward runs every row"
        q_and_gate, k, v = layer.split(qkv)
        norm_rope = functools.partial(gb.qk_norm_rope, q_and_gate, layer.q_norm, self.inv_freq, rows.rope_start, heads, hd,
                                      2 * hd, c.rotary_dim, eps, keys=k, key_weight=layer.k_norm)
        if rows.T <= MAX_ROWS:  # one slice: a bf16 cache takes its keys and values from the norms' launch, and
            start = rows.starts[:1]  # the combine applies the gate and writes the forms o_proj reads
            if isinstance(cache, gb.KVCache):
                q = norm_rope(append_to=cache, values=v, cache_start=start)
            else:
                q, k = norm_rope()
                cache.append(k, v, start)
            return gb.attend(q, cache, start, rows.past, gates=q_and_gate, forms=self.forms)
        q, k = norm_rope()
        parts = []
        for piece, start, past in rows.slices():
            cache.append(k[piece], v[piece], start)
            parts.append(gb.attend(q[piece], cache, start, past))
        return gb.attention_gate(_joined(parts), q_and_gate, hd, self.forms)  # for o_proj

    def deltanet(self, layer, x, state: gb.DeltaNetState, rows: Rows) -> cp.ndarray:
        """Gated DeltaNet (engine.backend.cpu_ops.CpuOps.deltanet) over x [T, H] (the normed input):
        in_proj, then the conv, the recurrence row by row with a state after each row and the gated
        norm, a launch a slice of rows -> [T, Hv * dv] in the forms out_proj reads. A W4 checkpoint's
        16-bit in_proj_b/a (the stacked Linear's last part, 2 Hv bf16 rows) is multiplied in that
        launch, not in one of its own."""
        c = layer.config
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        channels = 2 * hk * dk + hv * dv
        parts = layer.in_proj.parts if isinstance(layer.in_proj, ConcatOutputs) else []
        if len(parts) == 2 and type(parts[1]) is gb.BF16Linear and parts[1].N == 2 * hv:
            projected, b_and_a = parts[0](x), {"ba_weight": parts[1].bits, "x": x}
        else:
            projected = layer.in_proj(x)
            b_and_a = {"b": projected[:, -2 * hv : -hv], "a": projected[:, -hv:]}  # [T, Hv]
        # Column ranges of the projection, read in place by the kernel (no copies):
        mixed, z = projected[:, :channels], projected[:, channels : channels + hv * dv]
        return gb.deltanet(mixed, z, layer, hk, dk, state, [(piece, start) for piece, start, _ in rows.slices()],
                           c.rms_norm_eps, sigmoid=c.output_gate != "silu", forms=self.forms, **b_and_a)


    # ---- Flash-Next's steps (engine/flash_next.py; FlashCpuOps there is the reference)

    def ple_state(self, context: int, eos: int, conv_rows: int, channels: int) -> PLEState:
        """A PLE layer's history: its token ids on the host (the n-gram rows are gathered there), its conv inputs here."""
        return PLEState(context, eos, conv_rows, channels, zeros=cp.zeros)

    def indexed_cache(self, kv, index_dim: int, ratio: int) -> gb.IndexedKVCache:
        return gb.IndexedKVCache(kv, index_dim, ratio, KV_CAPACITY)

    silu_div = staticmethod(gb.silu_div)
    hc_mix = staticmethod(gb.hc_mix)
    hc_inject = staticmethod(gb.hc_inject)
    ple_gate = staticmethod(gb.ple_gate)
    ple_conv = staticmethod(gb.ple_conv)

    def indexed_attention(self, layer, qkv: cp.ndarray, index_qk: cp.ndarray, cache: gb.IndexedKVCache, rows: Rows,
                          first: int) -> cp.ndarray:
        """QSA's gated attention core (flash_next.FlashCpuOps.indexed_attention): per slice of rows, its keys,
        values and index keys into the cache (pooling the blocks they complete), then each query row's
        top blocks and tail are listed and attended."""
        a, ix, c = layer.attention, layer.indexer, layer.attention.config
        heads, kv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        d = ix.q_norm.shape[0]
        assert first == 0, "GpuOps.forward runs every row"
        q_and_gate, k, v = a.split(qkv)
        q, k = gb.qk_norm_rope(q_and_gate, a.q_norm, self.inv_freq, rows.rope_start, heads, hd, 2 * hd, c.rotary_dim, eps,
                               keys=k, key_weight=a.k_norm)
        index_q = gb.qk_norm_rope(index_qk, ix.q_norm, self.inv_freq, rows.rope_start, ix.heads, d, d, c.rotary_dim, eps)

        def pool(first_block: int, n: int) -> None:
            gb.pool_index_blocks(cache, first_block, n, ix.k_norm, self.inv_freq, c.rotary_dim, rows.rope_offset, eps)

        one = rows.T <= MAX_ROWS  # one slice: the combine applies the gate and writes the forms o_proj reads
        parts = []
        for piece, start, past in rows.slices():
            cache.kv.append(k[piece], v[piece], start)
            cache.append_index_keys(index_qk[piece, ix.heads * d:], past, pool)
            selected, counts = gb.qsa_select(index_q[piece], cache.blocks, start, past, ix.ratio, ix.top_blocks)
            parts.append(gb.attend_selected(q[piece], cache.kv, start, selected, counts,
                                            *((q_and_gate, self.forms) if one else ())))
        return parts[0] if one else gb.attention_gate(_joined(parts), q_and_gate, hd, self.forms)  # for o_proj


def _joined(parts: list) -> cp.ndarray:
    """The row slices' outputs as one array: a decode or verify pass has one slice, joined by no copy."""
    return parts[0] if len(parts) == 1 else cp.concatenate(parts)


def capturable(model) -> bool:
    """Whether a short call of this model can run as a CUDA graph: no experts routed on the host,
    no head computed there."""
    return not any(isinstance(layer.ffn, MoE) for layer in model.layers) and not isinstance(model.lm_head, OnHost)


# ----------------------------------------------------------------------------- state ---

ATTENTION_CACHES = (gb.KVCache, gb.Q4KVCache, gb.IndexedKVCache)  # cut back by their length; the other states keep rows

class GpuState:
    """engine.cache.SequenceState on the device: a cache per layer, the token count, what the
    captured cycles read (`inputs` int32 [1 + MAX_ROWS]: the position of row 0, then the tokens of a
    short call), the graphs captured for this state and the one memory pool their temporaries share."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
        self.length_before_last_call = 0
        self.inputs = cp.zeros(1 + MAX_ROWS, cp.int32)
        self.graphs: dict[tuple, CycleGraph] = {}
        self.graph_pool = cp.cuda.MemoryPool()
        self.graphs_version = -1  # the GpuOps.version the graphs were captured with

    def attention_caches(self) -> list:
        return [c for c in self.layers if isinstance(c, ATTENTION_CACHES)]

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
        if end < self.length:  # with every row kept the states are current (nothing to replay)
            for cache in self.layers:
                if not isinstance(cache, ATTENTION_CACHES):  # DeltaNet states (with a PLE's, engine.cache.WithPLE)
                    cache.keep(rows)
        self.length = end
        self._sync_caches()

    def rewind(self, length: int) -> None:
        """Cut an attention-only state (the MTP head's) back to `length` tokens."""
        assert len(self.attention_caches()) == len(self.layers)
        self.length = length
        self._sync_caches()

    def checkpoint(self) -> tuple:
        """engine.cache.SequenceState.checkpoint."""
        return self.length, [None if isinstance(cache, ATTENTION_CACHES) else cache.saved() for cache in self.layers]

    def restore(self, checkpoint: tuple) -> None:
        """engine.cache.SequenceState.restore."""
        self.length, saved = checkpoint
        for cache, copy in zip(self.layers, saved):
            if copy is not None:
                cache.restore(copy)
        self.length_before_last_call = self.length
        self._sync_caches()

    def _sync_caches(self) -> None:
        # The caches' own counts move with uncaptured appends only (a replay runs no host code); the
        # kernels never read them, so the state's count is the one kept.
        for cache in self.attention_caches():
            cache.length = self.length



class CycleGraph:
    """One short call of T rows captured as a CUDA graph: embedding of state.inputs' tokens, every
    layer at state.inputs' position, final norm and logits [T, V]. Its temporaries come from its
    state's graph pool, never the default one, so no allocation outside the graphs can land in
    memory a replay writes. The state's graphs share that pool's scratch: one state's cycles run one
    at a time, and what a replay hands back (hidden states, logits) stays held by its graph. One pool
    a state caches the largest graph's scratch, not every graph's."""

    def __init__(self, ops: GpuOps, model, state: GpuState, T: int, past: int):
        self.pool = state.graph_pool  # held as long as the graph
        stream = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.using_allocator(self.pool.malloc), stream:
            stream.begin_capture()
            try:
                self.hidden = ops.rows_pass(model, state, T, past)
                self.logits = model.lm_head(self.hidden)
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
