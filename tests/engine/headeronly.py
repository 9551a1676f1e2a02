"""Header-only checkpoints: every tensor's name, dtype and shape in a real header, and a data region
that is a hole in a sparse file (truncate to size), so a 20 GB checkpoint costs no disk.

Geometries: the 27B dense model (REFERENCE.md section 1) as the seed's INT4 checkpoint
(compressed-tensors W4, bf16 scale per 128, except in_proj_a/b, norms and conv; bf16 embedding,
lm_head, MTP head and vision tower), the same model as an IQ4_XS GGUF, and a Flash-Next-like MoE GGUF
whose routed experts use a block type the gguf package does not know (as llamAmpere's trellis files do).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1}
H, V, LAYERS, INTER = 5120, 248_320, 64, 17_408
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
HK, HV, DK, DV, CONV = 16, 48, 128, 128, 4
QKV_CHANNELS = 2 * HK * DK + HV * DV


def write_safetensors(folder: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], shards: int = 1) -> None:
    """Header-only safetensors: `model.safetensors`, or `shards` files and their index."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        filename = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per_shard:(i + 1) * per_shard]}
        _write_one(folder / filename, part)
        weight_map.update({n: filename for n in part})
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _write_one(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)  # the data: a hole


# --- the 27B INT4 checkpoint ------------------------------------------------------------------------

def config_27b() -> dict:
    text = dict(
        model_type="qwen3_5_text", vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTER,
        linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
        linear_conv_kernel_dim=CONV, full_attention_interval=4, max_position_embeddings=262_144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, mtp_num_hidden_layers=1, attn_output_gate=True,
    )
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"],
                                           "weights": {"num_bits": 4, "group_size": 128, "symmetric": True}}},
             "ignore": ["lm_head", "re:.*in_proj_a", "re:.*in_proj_b", "re:mtp.*", "re:model.visual.*"]}
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "tie_word_embeddings": False, "quantization_config": quant}


def int4(name: str, n: int, k: int) -> dict:
    """compressed-tensors pack-quantized: 8 nibbles per int32 along K, a bf16 scale per 128, the shape."""
    return {f"{name}.weight_packed": ("I32", (n, k // 8)), f"{name}.weight_scale": ("BF16", (n, k // 128)),
            f"{name}.weight_shape": ("I64", (2,))}


def bf16(name: str, n: int, k: int) -> dict:
    return {f"{name}.weight": ("BF16", (n, k))}


def attention_layer(p: str, linear) -> dict:
    t = {}
    t |= linear(p + "self_attn.q_proj", 2 * HEADS * HEAD_DIM, H)
    t |= linear(p + "self_attn.k_proj", KV_HEADS * HEAD_DIM, H)
    t |= linear(p + "self_attn.v_proj", KV_HEADS * HEAD_DIM, H)
    t |= linear(p + "self_attn.o_proj", H, HEADS * HEAD_DIM)
    t |= {p + "self_attn.q_norm.weight": ("BF16", (HEAD_DIM,)), p + "self_attn.k_norm.weight": ("BF16", (HEAD_DIM,))}
    return t


def deltanet_layer(p: str, linear) -> dict:
    d = p + "linear_attn."
    t = {}
    t |= linear(d + "in_proj_qkv", QKV_CHANNELS, H)
    t |= linear(d + "in_proj_z", HV * DV, H)
    t |= bf16(d + "in_proj_b", HV, H) | bf16(d + "in_proj_a", HV, H)
    t |= {d + "conv1d.weight": ("BF16", (QKV_CHANNELS, 1, CONV)), d + "A_log": ("F32", (HV,)),
          d + "dt_bias": ("BF16", (HV,)), d + "norm.weight": ("BF16", (DV,))}
    t |= linear(d + "out_proj", H, HV * DV)
    return t


def mlp_and_norms(p: str, linear) -> dict:
    t = linear(p + "mlp.gate_proj", INTER, H) | linear(p + "mlp.up_proj", INTER, H) | linear(p + "mlp.down_proj", H, INTER)
    return t | {p + "input_layernorm.weight": ("BF16", (H,)), p + "post_attention_layernorm.weight": ("BF16", (H,))}


def vision_tower() -> dict:
    """Qwen3.5's ViT: 27 blocks of width 1152 and a merger into 5120, about 0.92 GB in bf16."""
    t, w, inner = {}, 1152, 4304
    for i in range(27):
        b = f"model.visual.blocks.{i}."
        for name, n, k in (("attn.qkv", 3 * w, w), ("attn.proj", w, w), ("mlp.linear_fc1", inner, w), ("mlp.linear_fc2", w, inner)):
            t |= bf16(b + name, n, k) | {f"{b}{name}.bias": ("BF16", (n,))}
        for norm in ("norm1", "norm2"):
            t |= {f"{b}{norm}.weight": ("BF16", (w,)), f"{b}{norm}.bias": ("BF16", (w,))}
    t |= {"model.visual.patch_embed.proj.weight": ("BF16", (w, 3, 2, 16, 16)), "model.visual.pos_embed.weight": ("BF16", (2304, w))}
    t |= bf16("model.visual.merger.linear_fc1", 4 * w, 4 * w) | bf16("model.visual.merger.linear_fc2", H, 4 * w)
    return t


def tensors_27b_int4() -> dict:
    t = {}
    for i in range(LAYERS):
        p = f"model.language_model.layers.{i}."
        t |= attention_layer(p, int4) if (i + 1) % 4 == 0 else deltanet_layer(p, int4)
        t |= mlp_and_norms(p, int4)
    t |= {"model.language_model.embed_tokens.weight": ("BF16", (V, H)), "model.language_model.norm.weight": ("BF16", (H,)),
          "lm_head.weight": ("BF16", (V, H))}
    t |= bf16("mtp.fc", H, 2 * H) | {f"mtp.{n}.weight": ("BF16", (H,)) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    t |= attention_layer("mtp.layers.0.", bf16) | mlp_and_norms("mtp.layers.0.", bf16)
    return t | vision_tower()


def write_27b_int4(folder: Path, shards: int = 4) -> Path:
    write_safetensors(folder, tensors_27b_int4(), shards)
    (folder / "config.json").write_text(json.dumps(config_27b()))
    return folder


# --- GGUF ---------------------------------------------------------------------------------------------

def write_gguf(path: Path, arch: str, keys: dict[str, int | float], tensors: dict[str, tuple[int, tuple[int, ...], int]]) -> Path:
    """Header-only GGUF through the gguf package's own writer: tensors are name -> (ggml type, shape
    outermost first, bytes). A small token list is included so the reader has to step over arrays."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_token_list([f"tok{i}" for i in range(2000)])
    data = 0
    for name, (ggml_type, shape, nbytes) in tensors.items():
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
        data += -(-nbytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as f:
        f.truncate(-(-path.stat().st_size // 32) * 32 + data)
    return path


def quant_bytes(ggml_type, shape: tuple[int, ...]) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return math.prod(shape) // block * size


def write_27b_gguf(path: Path) -> Path:
    """The 27B as llama.cpp names it (arch qwen35), IQ4_XS linears, F32 norms, an MTP block 64."""
    from gguf import GGMLQuantizationType as Q

    def tensor(name, kind, *shape):
        return {name: (kind, shape, quant_bytes(kind, shape))}

    t = tensor("token_embd.weight", Q.Q4_K, V, H) | tensor("output.weight", Q.Q6_K, V, H) | tensor("output_norm.weight", Q.F32, H)
    for i in range(LAYERS + 1):
        b = f"blk.{i}."
        t |= tensor(b + "attn_norm.weight", Q.F32, H) | tensor(b + "post_attention_norm.weight", Q.F32, H)
        t |= tensor(b + "ffn_gate.weight", Q.IQ4_XS, INTER, H) | tensor(b + "ffn_up.weight", Q.IQ4_XS, INTER, H)
        t |= tensor(b + "ffn_down.weight", Q.IQ4_XS, H, INTER)
        if (i + 1) % 4 == 0 or i == LAYERS:
            t |= tensor(b + "attn_q.weight", Q.IQ4_XS, 2 * HEADS * HEAD_DIM, H)
            t |= tensor(b + "attn_k.weight", Q.IQ4_XS, KV_HEADS * HEAD_DIM, H) | tensor(b + "attn_v.weight", Q.IQ4_XS, KV_HEADS * HEAD_DIM, H)
            t |= tensor(b + "attn_output.weight", Q.IQ4_XS, H, HEADS * HEAD_DIM)
            t |= tensor(b + "attn_q_norm.weight", Q.F32, HEAD_DIM) | tensor(b + "attn_k_norm.weight", Q.F32, HEAD_DIM)
        else:
            t |= tensor(b + "attn_qkv.weight", Q.IQ4_XS, QKV_CHANNELS, H) | tensor(b + "attn_gate.weight", Q.IQ4_XS, HV * DV, H)
            t |= tensor(b + "ssm_beta.weight", Q.F16, HV, H) | tensor(b + "ssm_alpha.weight", Q.F16, HV, H)
            t |= tensor(b + "ssm_conv1d.weight", Q.F32, QKV_CHANNELS, CONV) | tensor(b + "ssm_a", Q.F32, HV)
            t |= tensor(b + "ssm_dt.bias", Q.F32, HV) | tensor(b + "ssm_norm.weight", Q.F32, DV)
            t |= tensor(b + "ssm_out.weight", Q.IQ4_XS, H, HV * DV)
    t |= tensor(f"blk.{LAYERS}.nextn.eh_proj.weight", Q.Q8_0, H, 2 * H)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        t |= tensor(f"blk.{LAYERS}.nextn.{norm}.weight", Q.F32, H)
    keys = {"block_count": LAYERS + 1, "nextn_predict_layers": 1, "context_length": 262_144, "embedding_length": H,
            "feed_forward_length": INTER, "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
            "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM, "rope.dimension_count": 64,
            "rope.freq_base": 1e7, "attention.layer_norm_rms_epsilon": 1e-6, "ssm.conv_kernel": CONV,
            "ssm.state_size": DK, "ssm.group_count": HK, "ssm.time_step_rank": HV, "ssm.inner_size": HV * DV,
            "full_attention_interval": 4}
    return write_gguf(path, "qwen35", keys, t)


TRELLIS_TYPE = 200  # not a type the gguf package knows: sized from the offsets, as a custom trellis block


def write_flash_next_like_gguf(path: Path) -> Path:
    """A Flash-Next-like MoE (arch qwen35moe): 48 layers, 512 experts, 10 routed a token, each expert
    1.88 MB (3 x 2560 x 640 weights at 3.0625 bits, a trellis-like custom type); the rest Q4_K/Q6_K."""
    from gguf import GGMLQuantizationType as Q

    h, layers, experts, inner, heads, kv, hk, hv = 2560, 48, 512, 640, 32, 2, 16, 32
    qkv = 2 * hk * DK + hv * DV

    def tensor(name, kind, *shape):
        nbytes = math.prod(shape) * 49 // 128 if kind == TRELLIS_TYPE else quant_bytes(kind, shape)  # 3.0625 bits
        return {name: (kind, shape, nbytes)}

    t = tensor("token_embd.weight", Q.Q4_K, V, h) | tensor("output.weight", Q.Q6_K, V, h) | tensor("output_norm.weight", Q.F32, h)
    for i in range(layers):
        b = f"blk.{i}."
        t |= tensor(b + "attn_norm.weight", Q.F32, h) | tensor(b + "post_attention_norm.weight", Q.F32, h)
        t |= tensor(b + "ffn_gate_inp.weight", Q.F32, experts, h) | tensor(b + "ffn_gate_inp_shexp.weight", Q.F32, h)
        for proj, n, k in (("gate", inner, h), ("up", inner, h), ("down", h, inner)):
            t |= tensor(f"{b}ffn_{proj}_exps.weight", TRELLIS_TYPE, experts, n, k)
            t |= tensor(f"{b}ffn_{proj}_shexp.weight", Q.Q8_0, n, k)
        if (i + 1) % 4 == 0:
            t |= tensor(b + "attn_q.weight", Q.Q4_K, 2 * heads * HEAD_DIM, h) | tensor(b + "attn_k.weight", Q.Q4_K, kv * HEAD_DIM, h)
            t |= tensor(b + "attn_v.weight", Q.Q4_K, kv * HEAD_DIM, h) | tensor(b + "attn_output.weight", Q.Q4_K, h, heads * HEAD_DIM)
        else:
            t |= tensor(b + "attn_qkv.weight", Q.Q4_K, qkv, h) | tensor(b + "attn_gate.weight", Q.Q4_K, hv * DV, h)
            t |= tensor(b + "ssm_conv1d.weight", Q.F32, qkv, CONV) | tensor(b + "ssm_out.weight", Q.Q4_K, h, hv * DV)
    keys = {"block_count": layers, "context_length": 262_144, "embedding_length": h, "feed_forward_length": 0,
            "attention.head_count": heads, "attention.head_count_kv": kv, "attention.key_length": HEAD_DIM,
            "rope.dimension_count": 64, "ssm.conv_kernel": CONV, "ssm.state_size": DK, "ssm.group_count": hk,
            "ssm.time_step_rank": hv, "ssm.inner_size": hv * DV, "full_attention_interval": 4,
            "expert_count": experts, "expert_used_count": 10, "expert_feed_forward_length": inner,
            "expert_shared_feed_forward_length": inner}
    return write_gguf(path, "qwen35moe", keys, t)


# --- Flash-Next (qwen4_exp) at the seed's scale -----------------------------------------------------
# 48 layers (36 DeltaNet, 12 QSA), hidden 2048, 512 experts of 512, 10 routed a token (transformers'
# Qwen4ExpTextConfig defaults, llama.cpp's A3B at 48 layers); 4 streams; PLE on one layer, 2- and
# 3-grams of 8 heads each over ~20M-row prime vocabularies, 128 wide: a 41B-value table (transformers:
# "~45B"). The indexer's heads, budget and ratio are not published; these are assumptions.
FN = dict(h=2048, layers=48, heads=16, kv=2, experts=512, inner=512, hc=4, lowrank=320, hk=16, hv=32, d=128,
          index_heads=16, index_dim=128, budget=2048, ratio=4, ple_heads=16, ple_rows=320_000_000, shards=512)


def config_flash_next() -> dict:
    f = FN
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"],
                                           "weights": {"num_bits": 4, "group_size": 128, "symmetric": True}}},
             "ignore": ["lm_head", "re:.*in_proj_a", "re:.*in_proj_b", "re:.*hyper_connection.*", "re:.*index_qk_proj",
                        "re:.*mlp.gate", "re:.*shared_expert_gate"]}
    return dict(model_type="qwen4_exp_text", vocab_size=V, hidden_size=f["h"], num_hidden_layers=f["layers"],
                num_attention_heads=f["heads"], num_key_value_heads=f["kv"], head_dim=HEAD_DIM,
                linear_num_key_heads=f["hk"], linear_num_value_heads=f["hv"], linear_key_head_dim=f["d"],
                linear_value_head_dim=f["d"], linear_conv_kernel_dim=CONV, full_attention_interval=4,
                max_position_embeddings=262_144, num_experts=f["experts"], num_experts_per_tok=10,
                moe_intermediate_size=f["inner"], shared_expert_intermediate_size=f["inner"], hc_count=f["hc"],
                hc_lowrank=f["lowrank"], ple_layer_ids=[2], ple_embed_dim=f["h"], ngram_size=3, heads_per_ngram=8,
                split_ngram_parts=f["shards"], indexer_n_heads=f["index_heads"], indexer_kv_heads=1,
                indexer_head_dim=f["index_dim"], indexer_budget=f["budget"], indexer_compress_ratio=f["ratio"],
                eos_token_id=248046, output_gate_type="sigmoid", quantization_config=quant,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def tensors_flash_next_int4() -> dict:
    f = FN
    h, wide = f["h"], f["hc"] * f["h"]
    qkv = 2 * f["hk"] * f["d"] + f["hv"] * f["d"]
    t = {"model.embed_tokens.weight": ("BF16", (V, h)), "lm_head.weight": ("BF16", (V, h))}

    def hyper(p: str, inject: bool = True) -> dict:
        parts = {p + "hc_norm.weight": ("BF16", (wide,))} | bf16(p + "input_mix_weight_down", f["lowrank"], wide)
        parts |= bf16(p + "input_mix_weight_up", wide, f["lowrank"])
        return parts | (bf16(p + "block_inject_weight", f["hc"], wide) if inject else {})

    t |= hyper("model.hyper_connection_mixer.", inject=False)
    for i in range(f["layers"]):
        p = f"model.layers.{i}."
        t |= hyper(p + "attn_hyper_connection.") | hyper(p + "mlp_hyper_connection.")
        if (i + 1) % 4 == 0:
            a = p + "self_attn."
            t |= int4(a + "q_proj", 2 * f["heads"] * HEAD_DIM, h) | int4(a + "k_proj", f["kv"] * HEAD_DIM, h)
            t |= int4(a + "v_proj", f["kv"] * HEAD_DIM, h) | int4(a + "o_proj", h, f["heads"] * HEAD_DIM)
            t |= {a + "q_norm.weight": ("BF16", (HEAD_DIM,)), a + "k_norm.weight": ("BF16", (HEAD_DIM,))}
            t |= bf16(a + "indexer.index_qk_proj", (f["index_heads"] + 1) * f["index_dim"], h)
            t |= {a + f"indexer.{n}.weight": ("BF16", (f["index_dim"],)) for n in ("q_layernorm", "k_layernorm")}
        else:
            d = p + "linear_attn."
            t |= int4(d + "in_proj_qkv", qkv, h) | int4(d + "in_proj_z", f["hv"] * f["d"], h)
            t |= bf16(d + "in_proj_b", f["hv"], h) | bf16(d + "in_proj_a", f["hv"], h) | int4(d + "out_proj", h, f["hv"] * f["d"])
            t |= {d + "conv1d.weight": ("BF16", (qkv, 1, CONV)), d + "A_log": ("F32", (f["hv"],)),
                  d + "dt_bias": ("BF16", (f["hv"],)), d + "norm.weight": ("BF16", (f["d"],))}
        m = p + "mlp."
        t |= bf16(m + "gate", f["experts"], h) | bf16(m + "shared_expert_gate", 1, h)
        for name, n, k in (("gate_proj", f["inner"], h), ("up_proj", f["inner"], h), ("down_proj", h, f["inner"])):
            t |= int4(f"{m}shared_expert.{name}", n, k)
            for e in range(f["experts"]):
                t |= int4(f"{m}experts.{e}.{name}", n, k)
        if i == 1:  # ple_layer_ids [2], 1-based
            e = p + "ple.ple_embedding."
            t |= int4(p + "ple.key_proj", wide, h) | int4(p + "ple.value_proj", h, h)
            t |= {f"{p}ple.{n}.weight": ("BF16", (wide,)) for n in ("norm_key", "norm_query", "norm_conv")}
            t |= {p + "ple.conv1d.weight": ("BF16", (wide, 1, 4)), e + "layer_multipliers": ("I64", (3,)),
                  e + "ngram_heads_vocab_sizes": ("I64", (f["ple_heads"],)), e + "ngram_heads_offsets": ("I64", (f["ple_heads"],))}
            rows = f["ple_rows"] // f["shards"]
            t |= {f"{e}ngram_embedding.shard_{j}.weight": ("BF16", (rows, h // f["ple_heads"])) for j in range(f["shards"])}
    return t


def write_flash_next_int4(folder: Path, shards: int = 8) -> Path:
    write_safetensors(folder, tensors_flash_next_int4(), shards)
    (folder / "config.json").write_text(json.dumps(config_flash_next()))
    return folder
