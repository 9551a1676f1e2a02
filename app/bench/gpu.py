"""GPU benchmarks against the physical limit, both routes side by side.

W4 GEMVs: each weight of the 27B geometry (REFERENCE.md section 1: hidden 5120, 24 query / 4 KV
heads of 256, DeltaNet 16 key / 48 value heads of 128, intermediate 17408, vocab 248320) as random
INT4 in the W4 layout, run through the w4a16 and w4a8 Linears at 1, 4, 8 and 16 rows. A figure is
weight bytes (packed nibbles + bf16 scales) over the median time of one call, route overheads
(activation rounding or int8 quantization) included, as a share of the device-to-device copy
bandwidth measured in the same run ((bytes read + bytes written) / time, what a memory-bound pass
can reach). Each weight has enough copies in rotation that the L2 cache never holds the one being read.

Decode cycle: a random INT4 model of the 27B geometry (as many of its 64 layers as the card holds,
said in the output) on the GPU model (engine/backend/cupy_model.py), a context of CONTEXT tokens
prefilled, then a verify pass of 1 to 16 rows: uncaptured, and replayed as a CUDA graph. Its
limit is the bill of bytes (engine/placement.py, from the model's tensor headers as `duet models
info` computes it: the W4 decoder and int4 head, the DeltaNet and conv state read and written,
the KV cache at the context, what a verify of several rows records for a rollback) over the copy bandwidth.
DeltaNet's in_proj is stacked as the assembler stacks a W4 checkpoint's (qkv | z in W4, in_proj_b | a
in bf16, multiplied in the DeltaNet launch); the bill's bf16 rescoring rows are not read (this head
is the int4 one alone).

    duet bench gpu [--json] [--repeats N] [--layers N]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from duet.engine import KVCache, Route

HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS = 5120, 256, 24, 4
DN_KEY_HEADS, DN_VALUE_HEADS, DN_DIM = 16, 48, 128
INTERMEDIATE, VOCAB = 17408, 248320
SHAPES = {  # name: (N outputs, K inputs)
    "attn q_proj (query|gate)": (2 * Q_HEADS * HEAD_DIM, HIDDEN),
    "attn k_proj / v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn o_proj": (HIDDEN, Q_HEADS * HEAD_DIM),
    "deltanet in_proj_qkv": (2 * DN_KEY_HEADS * DN_DIM + DN_VALUE_HEADS * DN_DIM, HIDDEN),
    "deltanet in_proj_z": (DN_VALUE_HEADS * DN_DIM, HIDDEN),
    "deltanet out_proj": (HIDDEN, DN_VALUE_HEADS * DN_DIM),
    "mlp gate_up": (2 * INTERMEDIATE, HIDDEN),
    "mlp down": (HIDDEN, INTERMEDIATE),
    "lm_head (int4 ranking)": (VOCAB, HIDDEN),
}
ROWS = (1, 4, 8, 16)
ROUTES = (Route.W4A16, Route.W4A8)
ROTATION_BYTES = 512 << 20  # weight bytes cycled through per shape: several times any L2 cache


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, (read + written bytes) / median time, in bytes/s."""
    import cupy as cp

    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.__setitem__(Ellipsis, src), repeats)


def _median_seconds(call, repeats: int) -> float:
    import cupy as cp

    for _ in range(3):
        call()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def random_w4(N: int, K: int, rng: np.random.Generator):
    """Random nibbles and bf16 scales in the W4 layout (the bytes are what is measured)."""
    from duet.engine.quant.w4 import W4Weight

    packed = rng.integers(0, 1 << 32, (N, K // 8), dtype=np.uint32)
    scales = np.full((N, K // 128), 0x3C00, np.uint16)  # bf16 2^-7
    return W4Weight(packed, scales)


def gemv_table(shapes=SHAPES, rows=ROWS, routes=ROUTES, repeats: int = 20) -> dict:
    """{copy_bytes_per_s, rows, results: [{name, N, K, weight_bytes, route, rows, bytes_per_s, of_copy}]}."""
    import cupy as cp

    from duet.engine.backend import cpu
    from duet.engine.backend import cupy_backend as gb

    copy = copy_bandwidth()
    rng = np.random.default_rng(0)
    results = []
    for name, (N, K) in shapes.items():
        weight = random_w4(N, K, rng)
        copies = max(1, -(-ROTATION_BYTES // weight.nbytes))
        for route in routes:
            linears = [cpu.make_linear(weight, route, gb) for _ in range(copies)]
            for T in rows:
                x = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
                turn = iter(range(1 << 62))
                seconds = _median_seconds(lambda: linears[next(turn) % copies](x), repeats)
                results.append({"name": name, "N": N, "K": K, "weight_bytes": weight.nbytes, "route": route,
                                "rows": T, "bytes_per_s": weight.nbytes / seconds,
                                "of_copy": weight.nbytes / seconds / copy})
            linears.clear()  # free this route's copies before the next route uploads its own
            cp.get_default_memory_pool().free_all_blocks()
    return {"device": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
            "copy_bytes_per_s": copy, "rows": list(rows), "results": results}


def format_table(report: dict) -> str:
    rows = report["rows"]
    head = f"{'weight':26} {'N x K':>14} {'MB':>7} {'route':6}" + "".join(f" {f'{t} row' + ('s' if t > 1 else ''):>16}" for t in rows)
    lines = [f"{report['device']}: device-to-device copy {report['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             f"(read + written); each cell: weight GB/s and % of copy", head]
    by_key = {(r["name"], r["route"], r["rows"]): r for r in report["results"]}
    for name in dict.fromkeys(r["name"] for r in report["results"]):
        for route in dict.fromkeys(r["route"] for r in report["results"]):
            first = by_key[(name, route, rows[0])]
            cells = "".join(f" {by_key[(name, route, t)]['bytes_per_s'] / 1e9:8.0f} ({by_key[(name, route, t)]['of_copy']:4.0%})"
                            for t in rows)
            lines.append(f"{name:26} {first['N']:>6} x {first['K']:<6} {first['weight_bytes'] / 1e6:7.1f} {route:6}{cells}")
    return "\n".join(lines)


# ------------------------------------------------------------------------ decode cycle ---

LAYERS_27B = 64
CONTEXT = 512  # tokens in the cache when the cycles run
CYCLE_ROWS = (1, 2, 4, 8, 16)
REPLAYS = 10  # graph launches per timed call, back to back as consecutive cycles run


def geometry_27b(layers: int):
    """ModelConfig of the 27B geometry with `layers` layers (every 4th full attention)."""
    from duet.engine.config import ModelConfig

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return ModelConfig.from_dict(dict(
        model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, layer_types=types,
        intermediate_size=INTERMEDIATE, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        linear_num_key_heads=DN_KEY_HEADS, linear_num_value_heads=DN_VALUE_HEADS, linear_key_head_dim=DN_DIM,
        linear_value_head_dim=DN_DIM, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25}), "27B geometry")


def tensor_shapes(c) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the text model's tensors (what a checkpoint of this config holds)."""
    H, hk, hv, d = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    channels = 2 * hk * d + hv * d
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,), "lm_head.weight": (c.vocab_size, H)}
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, H), p + "mlp.up_proj.weight": (c.intermediate_size, H),
                   p + "mlp.down_proj.weight": (H, c.intermediate_size)}
        if kind == "full_attention":
            heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            shapes |= {p + "self_attn.q_proj.weight": (2 * heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                       p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        else:
            a = p + "linear_attn."
            shapes |= {a + "in_proj_qkv.weight": (channels, H), a + "in_proj_z.weight": (hv * d, H),
                       a + "in_proj_b.weight": (hv, H), a + "in_proj_a.weight": (hv, H),
                       a + "conv1d.weight": (channels, 1, c.linear_conv_kernel_dim), a + "A_log": (hv,),
                       a + "dt_bias": (hv,), a + "norm.weight": (d,), a + "out_proj.weight": (H, hv * d)}
    return shapes


def cycle_bill(c, rows: int) -> int:
    """Bytes of one verify pass of `rows` rows at CONTEXT (engine.placement, from bf16 headers planned
    as the W4 repack): the pass, plus what a pass of several rows records for a rollback."""
    from duet.engine.checkpoint.headers import CheckpointHeaders
    from duet.engine.checkpoint.safetensors import TensorInfo
    from duet.engine.placement import bill_of_bytes, weights_of

    tensors = {name: TensorInfo(name, "BF16", shape, 0, 2 * int(np.prod(shape))) for name, shape in tensor_shapes(c).items()}
    headers = CheckpointHeaders("random INT4, 27B geometry", "safetensors", c, tensors, (), 0)
    bill = bill_of_bytes(weights_of(headers, w4=True), c, CONTEXT, KVCache.BF16, depth=rows - 1)
    return bill.verify_pass + bill.rollback


def random_device_model(c, route: str, seed: int = 0):
    """A Model (engine.model) on the GPU op set of random INT4 weights already on the device: the W4
    matrices as CuPy arrays in W4Weight, which the route's GPU Linear takes without a copy. Both
    routes share the matrices of one call to `random_device_weights`."""
    from duet.engine import model as m
    from duet.engine.backend import cupy_backend as gb
    from duet.engine.backend.cupy_model import GpuOps

    ops = GpuOps(c)
    linear = lambda weight: ops.linear(weight, route)  # noqa: E731
    w, rng = random_device_weights(c, seed), np.random.default_rng(seed)
    ones = lambda n: ops.vector(np.ones(n, np.float32))  # noqa: E731  zero-centred norms hold 1 + w

    def layer(i: int, kind: str) -> m.DecoderLayer:
        p = f"model.layers.{i}."
        if kind == "full_attention":
            a = p + "self_attn."
            mixer = m.Attention(linear(w[a + "qkv"]), linear(w[a + "o_proj"]), ones(c.head_dim), ones(c.head_dim), c, ops)
        else:  # in_proj as the assembler stacks a W4 checkpoint's: qkv | z in W4 beside in_proj_b | in_proj_a in bf16
            d, hv = p + "linear_attn.", c.linear_num_value_heads
            in_proj = ops.concat_outputs([linear(w[d + "in_proj_qkvz"]), gb.BF16Linear(w[d + "in_proj_ba"])])
            channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + hv * c.linear_value_head_dim
            conv = rng.standard_normal((channels, c.linear_conv_kernel_dim)).astype(np.float32)
            mixer = m.DeltaNet(in_proj, ops.vector(conv), ops.vector(-np.exp(rng.uniform(0, 2.5, hv))), ones(hv),
                               ones(c.linear_value_head_dim), linear(w[d + "out_proj"]), c, ops)
        ffn = m.MLP(linear(w[p + "mlp.gate_up"]), linear(w[p + "mlp.down"]), ops)
        return m.DecoderLayer(mixer, ffn, ones(c.hidden_size), ones(c.hidden_size), c.rms_norm_eps, ops)

    layers = [layer(i, kind) for i, kind in enumerate(c.layer_types)]
    return m.Model(c, ops.embedding(w["embed"]), layers, ones(c.hidden_size), linear(w["lm_head"]), ops=ops)


_device_weights: dict = {}


def random_device_weights(c, seed: int) -> dict:
    """{name: W4Weight of CuPy arrays} for every matrix, "embed": fp32 [V, H] on the device; made once
    per (layers, seed) and shared by the routes."""
    key = (c.num_hidden_layers, seed)
    if key not in _device_weights:
        _device_weights.clear()
        _device_weights[key] = _make_device_weights(c, seed)
    return _device_weights[key]


def _make_device_weights(c, seed: int) -> dict:
    import cupy as cp

    from duet.engine.quant.w4 import W4Weight

    cp.random.seed(seed)

    def w4(N: int, K: int) -> W4Weight:
        nibbles = cp.random.randint(0, 256, N * K // 2, dtype=cp.int32).astype(cp.uint8)  # two levels a byte
        scales = cp.full((N, K // 128), 0x3C00, cp.uint16)  # bf16 2^-7
        return W4Weight(nibbles.view(cp.uint32).reshape(N, K // 8), scales)

    out = {"embed": cp.random.standard_normal((c.vocab_size, c.hidden_size), dtype=cp.float32),
           "lm_head": w4(c.vocab_size, c.hidden_size)}
    shapes = tensor_shapes(c)
    for name, shape in shapes.items():
        if name.endswith(("gate_proj.weight", "up_proj.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight")) \
                or len(shape) != 2 or "in_proj" in name or name.startswith(("model.embed", "lm_head")):
            continue
        out[name.removesuffix(".weight")] = w4(*shape)
    for i, kind in enumerate(c.layer_types):  # gate | up, q | k | v, qkv | z stacked by rows, as the assembler stacks them
        out[f"model.layers.{i}.mlp.gate_up"] = w4(2 * c.intermediate_size, c.hidden_size)
        if kind == "full_attention":
            rows = sum(shapes[f"model.layers.{i}.self_attn.{n}_proj.weight"][0] for n in "qkv")
            out[f"model.layers.{i}.self_attn.qkv"] = w4(rows, c.hidden_size)
        else:
            d = f"model.layers.{i}.linear_attn."
            out[d + "in_proj_qkvz"] = w4(sum(shapes[f"{d}in_proj_{n}.weight"][0] for n in ("qkv", "z")), c.hidden_size)
            ba = cp.random.standard_normal((2 * c.linear_num_value_heads, c.hidden_size), dtype=cp.float32) * 0.01
            out[d + "in_proj_ba"] = (ba.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 bits (truncated: any will do)
    out = {k.replace(".mlp.down_proj", ".mlp.down"): v for k, v in out.items()}
    return out


def layers_that_fit() -> int:
    """Layers of the 27B geometry (a multiple of 4, at most 64) whose weights, with the head and the
    fp32 embedding, fill at most 70% of the free device memory."""
    import cupy as cp

    from duet.engine.placement import w4_bytes

    free = cp.cuda.Device().mem_info[0]
    c = geometry_27b(4)
    per_four = sum(w4_bytes(s) for n, s in tensor_shapes(c).items() if ".layers." in n and len(s) == 2)
    fixed = c.vocab_size * c.hidden_size * 4 + w4_bytes((c.vocab_size, c.hidden_size))  # fp32 embedding, int4 head
    return int(max(4, min(LAYERS_27B, 4 * ((0.7 * free - fixed) // per_four))))


def cycle_table(layers: int | None = None, rows=CYCLE_ROWS, routes=ROUTES, repeats: int = 10) -> dict:
    """{copy_bytes_per_s, layers, context, results: [{route, rows, bill_bytes, limit_s, uncaptured_s,
    graph_s, of_limit}]}."""
    import cupy as cp

    copy = copy_bandwidth()
    layers = layers or layers_that_fit()
    c = geometry_27b(layers)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, c.vocab_size, CONTEXT)]
    results = []
    for route in routes:
        model = random_device_model(c, route)
        ops, state = model.ops, model.new_state()
        model.forward(state, prompt)
        for T in rows:
            tokens = prompt[:T]

            def uncaptured():
                ops.graphable = False
                model.forward(state, tokens)
                state.keep(1)

            uncaptured_s = _median_seconds(uncaptured, repeats)
            ops.graphable = True
            model.forward(state, tokens)  # captures this (T, attention grid) and replays it once
            state.keep(1)
            graph = ops.cycle_graph(model, state, T)
            if graph is None:
                raise RuntimeError(f"the {route} cycle of {T} rows was not captured: {ops.graph_error}")
            stream = cp.cuda.get_current_stream()
            graph_s = _median_seconds(lambda: [graph.graph.launch(stream=stream) for _ in range(REPLAYS)], repeats) / REPLAYS
            bill = cycle_bill(c, T)
            results.append({"route": route, "rows": T, "bill_bytes": bill, "limit_s": bill / copy,
                            "uncaptured_s": uncaptured_s, "graph_s": graph_s, "of_limit": bill / copy / graph_s})
        model = ops = state = graph = None  # free this route's weights and state before the next one
        cp.get_default_memory_pool().free_all_blocks()
    return {"device": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
            "copy_bytes_per_s": copy, "layers": layers, "context": CONTEXT, "results": results}


def format_cycle_table(report: dict) -> str:
    layers = report["layers"]
    scope = ("all 64 layers" if layers == LAYERS_27B else
             f"{layers} of its 64 layers (what this card holds; the bill is this model's, a full model's is "
             f"~{LAYERS_27B / layers:.1f}x the decoder part)")
    lines = [f"{report['device']}: decode cycle of a random INT4 model of the 27B geometry, {scope}; context "
             f"{report['context']}, bf16 KV; limit = bill of bytes / copy {report['copy_bytes_per_s'] / 1e9:.0f} GB/s",
             f"{'route':6} {'rows':>4} {'bill MB':>9} {'limit ms':>9} {'uncaptured ms':>14} {'graph ms':>9} {'of limit':>9}"]
    for r in report["results"]:
        lines.append(f"{r['route']:6} {r['rows']:4d} {r['bill_bytes'] / 1e6:9.1f} {r['limit_s'] * 1e3:9.3f} "
                     f"{r['uncaptured_s'] * 1e3:14.3f} {r['graph_s'] * 1e3:9.3f} {r['of_limit']:9.0%}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ command ---

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per figure; the median counts")
    parser.add_argument("--layers", type=int, help="layers of the 27B geometry in the cycle model (default: what fits)")
    parser.add_argument("--table", choices=("gemv", "cycle", "both"), default="both",
                        help="which table to measure (scripts/gpu_check.sh runs each as its own stage)")


def run(args: argparse.Namespace) -> int:
    from duet.engine.backend.select import backend_name
    from duet.engine.errors import DuetError

    if backend_name("auto") != "cupy":
        raise DuetError("duet bench gpu needs an NVIDIA GPU and CuPy (pip install 'duet[gpu]')")
    report, text = {}, []
    if args.table in ("gemv", "both"):
        report["gemv"] = gemv_table(repeats=args.repeats)
        text.append(format_table(report["gemv"]))
    if args.table in ("cycle", "both"):
        report["cycle"] = cycle_table(args.layers, repeats=args.repeats)
        text.append(format_cycle_table(report["cycle"]))
    print(json.dumps(report) if args.json else "\n\n".join(text))
    return 0
