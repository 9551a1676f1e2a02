"""`duet convert SRC DST --format F`: a bf16/fp16/fp32 HF checkpoint to INT4 safetensors or to GGUF.

    int4          compressed-tensors `pack-quantized`: symmetric INT4, group 128, round to nearest,
                  the W4 layout (engine/quant/w4.py). Kept 16-bit as real INT4 checkpoints keep them:
                  embeddings, lm_head, DeltaNet in_proj_a/b, routers, shared-expert gates, and any
                  matrix whose input size is not a multiple of 128 (listed in `ignore`).
    gguf-f32, gguf-f16, gguf-bf16, gguf-q8_0, gguf-q4_0
                  GGUF as llama.cpp's convert_hf_to_gguf.py writes the architecture (qwen35,
                  qwen35moe, qwen3next), tokenizer and chat template included. Matrices take the
                  type; vectors, conv taps and router gates stay f32, as the converter keeps them.

    trellis-2, trellis-3, trellis-4
                  duet's trellis files (engine/checkpoint/trellis_files.py): the matrices INT4 would
                  code, when N % 16 == 0 too, Hadamard-rotated and trellis-coded at 2, 3 or 4 bits
                  per weight (engine/quant/trellis.py); the rest kept as they are.

Natural routes: int4 -> w4a16 (also w4a8); gguf-q8_0 / gguf-q4_0 / trellis-K -> w4a8; float files -> bf16.
DST is a new folder (int4) or a .gguf path; nothing existing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from engine.checkpoint.gguf import grouped_to_stored_heads, head_rows, stored_to_grouped_heads
from engine.checkpoint.hf import TensorPlan
from engine.checkpoint.safetensors import SafetensorsCheckpoint
from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import DuetError
from engine.checkpoint.trellis_files import trellis_metadata
from engine.quant import trellis
from engine.quant.w4 import GROUP, quantize_rtn

INT4 = "int4"
GGUF_TYPES = {"gguf-f32": "F32", "gguf-f16": "F16", "gguf-bf16": "BF16", "gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0"}
TRELLIS_RATES = {f"trellis-{k}": k for k in trellis.RATES}
TRELLIS_SEED = 1  # rotation signs of every matrix: np.random.default_rng(1), first K of them
FORMATS = (INT4, *GGUF_TYPES, *TRELLIS_RATES)
OUR_FORMAT = {"duet.format": "int4-pack-quantized", "duet.version": "1"}  # __metadata__ of our INT4 files
# in_proj_ba is Qwen3-Next's fused in_proj_b + in_proj_a: kept 16-bit like them (its per-head split
# takes rows that cut trellis tiles).
KEPT_16BIT = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate")
ARCHS = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
         "qwen3_next": "qwen3next"}
MROPE_SECTIONS = [11, 11, 10, 0]  # llama.cpp requires the key for qwen35; text-only positions make it plain RoPE
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}  # general.file_type (llama_ftype)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def add_convert_command(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="HF model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("dst", metavar="DST", help="new folder (int4) or new .gguf file")
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    parser.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    src, dst = Path(args.src).expanduser(), Path(args.dst).expanduser()
    if not src.is_dir():
        raise DuetError(f"{src}: no such model folder; pass SRC as a folder holding config.json")
    if dst.exists():
        raise DuetError(f"{dst}: already exists; pass DST as a new path (nothing is overwritten)")
    config = ModelConfig.from_file(src / "config.json")
    ckpt = SafetensorsCheckpoint(src)
    plan = TensorPlan(ckpt, config)  # checks every tensor the model needs before anything is written
    if args.format == INT4:
        count = write_int4(src, dst, ckpt, plan)
        print(f"wrote {dst}: {count} matrices INT4 (compressed-tensors pack-quantized, group {GROUP})")
    elif args.format in TRELLIS_RATES:
        count = write_trellis(src, dst, ckpt, plan, TRELLIS_RATES[args.format])
        print(f"wrote {dst}: {count} matrices trellis-coded at {TRELLIS_RATES[args.format]} bits per weight")
    else:
        if dst.suffix != ".gguf":
            raise DuetError(f"{dst}: a GGUF output needs a .gguf file name")
        count = write_gguf(src, dst, config, ckpt, plan, GGUF_TYPES[args.format])
        print(f"wrote {dst}: {count} tensors, {GGUF_TYPES[args.format]} matrices")
    ckpt.close()
    return 0


# --------------------------------------------------------------------------------------------
# INT4 safetensors (compressed-tensors pack-quantized)


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return (len(shape) == 2 and name.endswith(".weight") and shape[1] % GROUP == 0
            and not name[: -len(".weight")].endswith(KEPT_16BIT))


def write_int4(src: Path, dst: Path, ckpt: SafetensorsCheckpoint, plan: TensorPlan) -> int:
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    ignore, count = [], 0
    for name, matrix in per_expert_matrices(ckpt, plan):
        if matrix.ndim == 2 and quantizable(name, matrix.shape):
            module, w4 = name[: -len(".weight")], quantize_rtn(matrix)
            tensors[module + ".weight_packed"] = ("I32", w4.packed.shape, w4.packed.tobytes())
            tensors[module + ".weight_scale"] = ("BF16", w4.scales.shape, w4.scales.tobytes())
            tensors[module + ".weight_shape"] = ("I64", (2,), np.array(matrix.shape, np.int64).tobytes())
            count += 1
        else:
            if matrix.ndim == 2 and name.endswith(".weight"):
                ignore.append(name[: -len(".weight")])
            tensors[name] = raw_tensor(ckpt, name, matrix)
    dst.mkdir(parents=True)
    write_safetensors(dst / "model.safetensors", tensors, {"format": "pt", **OUR_FORMAT})
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = compressed_tensors_config(ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for file in TOKENIZER_FILES:
        if (src / file).exists():
            shutil.copy(src / file, dst / file)
    return count


def write_trellis(src: Path, dst: Path, ckpt: SafetensorsCheckpoint, plan: TensorPlan, k: int) -> int:
    """Our trellis files (engine/checkpoint/trellis_files.py): the INT4 choice of matrices, each also
    needing N % 16 == 0; config.json unchanged (the files' metadata says what they are)."""
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    count = 0
    for name, matrix in per_expert_matrices(ckpt, plan):
        if matrix.ndim == 2 and quantizable(name, matrix.shape) and matrix.shape[0] % trellis.TILE_ROWS == 0:
            module = name[: -len(".weight")]
            coded = trellis.quantize_matrix(matrix, k, TRELLIS_SEED, trellis.STEPS[k])
            tensors[module + ".trellis_codes"] = ("U8", coded.packed.shape, coded.packed.tobytes())
            tensors[module + ".trellis_row_scale"] = ("F32", coded.row_scale.shape, coded.row_scale.tobytes())
            count += 1
        else:
            tensors[name] = raw_tensor(ckpt, name, matrix)
    dst.mkdir(parents=True)
    write_safetensors(dst / "model.safetensors", tensors, {"format": "pt", **trellis_metadata(k, TRELLIS_SEED)})
    for file in ("config.json", *TOKENIZER_FILES):
        if (src / file).exists():
            shutil.copy(src / file, dst / file)
    return count


def per_expert_matrices(ckpt: SafetensorsCheckpoint, plan: TensorPlan):
    """(name, fp32 array) of every tensor the model reads; fused experts split into per-expert matrices."""
    for name in plan.expected:
        value = ckpt.read_f32(name)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = name[: -len("gate_up_proj")] if name.endswith("gate_up_proj") else name[: -len("down_proj")]
            for e, matrix in enumerate(value):
                if name.endswith("gate_up_proj"):
                    gate, up = np.split(matrix, 2)
                    yield f"{base}{e}.gate_proj.weight", gate
                    yield f"{base}{e}.up_proj.weight", up
                else:
                    yield f"{base}{e}.down_proj.weight", matrix
        else:
            yield name, value


def raw_tensor(ckpt: SafetensorsCheckpoint, name: str, value: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor kept as the source stores it (bf16 stays bf16); split experts are written in fp32."""
    if name in ckpt and ckpt.info(name).dtype in ("BF16", "F16", "F32"):
        info = ckpt.info(name)
        with open(ckpt.file_of(name), "rb") as handle:
            handle.seek(info.begin)
            return info.dtype, info.shape, handle.read(info.nbytes)
    return "F32", value.shape, np.ascontiguousarray(value, np.float32).tobytes()


def compressed_tensors_config(ignore: list[str]) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},
        "ignore": sorted(ignore),
    }


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict) -> None:
    """8-byte header length, JSON header (dtype, shape, data_offsets), then the tensors' bytes."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # align the data block to 8 bytes
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for _, _, data in tensors.values():
            handle.write(data)


# --------------------------------------------------------------------------------------------
# GGUF (what llama.cpp's converter writes for qwen35 / qwen35moe / qwen3next)


def write_gguf(src: Path, dst: Path, config: ModelConfig, ckpt: SafetensorsCheckpoint, plan: TensorPlan,
               qtype_name: str) -> int:
    """Two passes over the tensors: their infos first (the header precedes the data), then the data
    one tensor at a time, so memory holds one converted tensor, never the model."""
    import gguf

    arch = ARCHS[config.model_type]
    qtype = gguf.GGMLQuantizationType[qtype_name]
    tensors = gguf_tensors(config, arch, lambda key: ckpt.read_f32(plan.name(key)), plan.fused_experts, plan.has_mtp)
    writer = gguf.GGUFWriter(str(dst), arch)
    write_gguf_metadata(writer, config, arch, src.name, qtype)
    write_gguf_tokenizer(writer, src, config)
    for name, load in tensors:
        data, raw_dtype = gguf_data(name, load(), qtype, shape_only=True)
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, load in tensors:
        writer.write_tensor_data(gguf_data(name, load(), qtype)[0])
    writer.close()
    return len(tensors)


KEPT_F32 = ("ssm_conv1d", "ffn_gate_inp")  # matrices the converter keeps in f32 (conv taps, router gates)


def gguf_data(name: str, value: np.ndarray, qtype, shape_only: bool = False):
    """(array to write, raw GGML type or None): matrices in qtype when their rows fit its blocks, else f32.

    Embedding and output head stay Q8_0 in a Q4_0 file: one token's row or the logits take the
    whole error of their 32-blocks, so llama-quantize keeps them above the body's type too.
    """
    import gguf

    if name in TABLES and qtype == gguf.GGMLQuantizationType.Q4_0:
        qtype = gguf.GGMLQuantizationType.Q8_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    keep_f32 = value.ndim < 2 or any(part in name for part in KEPT_F32) or value.shape[-1] % block
    if keep_f32 or qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(value, np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return value.astype(np.float16), None
    if shape_only:  # the byte shape, without quantizing
        return np.empty(gguf.quant_shape_to_byte_shape(value.shape, qtype), np.uint8), qtype
    return gguf.quants.quantize(np.ascontiguousarray(value, np.float32), qtype), qtype


def write_gguf_metadata(writer, config: ModelConfig, arch: str, name: str, qtype) -> None:
    import gguf

    c = config
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[qtype.name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(c.num_hidden_layers + c.mtp_num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    if c.intermediate_size:
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    if c.num_experts:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    recurrent = [kind != FULL_ATTENTION for kind in c.layer_types] + [False] * c.mtp_num_hidden_layers
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(_full_attention_interval(c))
    writer.add_rope_dimension_count(c.rotary_dim)
    if arch != "qwen3next":
        writer.add_rope_dimension_sections(MROPE_SECTIONS)
    if c.mtp_num_hidden_layers:
        writer.add_nextn_predict_layers(c.mtp_num_hidden_layers)



def _full_attention_interval(c: ModelConfig) -> int:
    full = [i for i, kind in enumerate(c.layer_types) if kind == FULL_ATTENTION]
    return full[0] + 1 if full else c.num_hidden_layers + 1


def write_gguf_tokenizer(writer, src: Path, config: ModelConfig) -> None:
    """tokenizer.ggml.*: gpt2-style BPE tokens padded to the vocabulary, types, merges, ids, template."""
    from gguf import TokenType

    from engine.tokenizer import GGUF_PRE_SPLITS, Tokenizer

    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise DuetError(f"{src / 'tokenizer.json'}: a {model.get('type')} tokenizer; GGUF conversion takes byte-level BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    vocab.update({content: token["id"] for content, token in added.items()})
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    types = [TokenType.UNUSED] * config.vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = (TokenType.CONTROL if added[token].get("special") else TokenType.USER_DEFINED) if token in added \
            else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tokenizer = Tokenizer.from_dir(src, extra_eos_ids=config.eos_token_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(data.get("pre_tokenizer"), src, GGUF_PRE_SPLITS))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for token, add in ((tokenizer.eos_token, writer.add_eos_token_id), (tokenizer.pad_token, writer.add_pad_token_id),
                       (tokenizer.bos_token, writer.add_bos_token_id)):
        if token is not None:
            add(vocab[token])
    writer.add_add_bos_token(False)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def pre_tokenizer_name(pre: dict | None, src: Path, splits: dict[str, str | None]) -> str:
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer: ByteLevel with its regex, or a known Split."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = pre.get("pretokenizers", []) if pre else []
    pattern = next((p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"), None)
    for name, split in splits.items():
        if split is not None and split == pattern:
            return name
    raise DuetError(f"{src / 'tokenizer.json'}: its pre-tokenizer is not one GGUF names here "
                    f"({', '.join(splits)}); convert a Qwen or GPT-2 style tokenizer")



OUTPUT_HEAD = "output.weight"
TABLES = ("token_embd.weight", OUTPUT_HEAD)


def gguf_tensors(c: ModelConfig, arch: str, get, fused_experts: bool, has_mtp: bool) -> list:
    """(GGUF name, loader of its numpy data) for every tensor, transformed as llama.cpp's converter does."""
    out: list = []

    def put(name: str, load):
        out.append((name, load))

    def norm(name: str, key: str):
        put(name, lambda: get(key) + np.float32(1))  # zero-centred norms are stored as 1 + w

    put("token_embd.weight", lambda: get("embed_tokens.weight"))
    norm("output_norm.weight", "norm.weight")
    if not c.tie_word_embeddings:
        put(OUTPUT_HEAD, lambda: get("lm_head.weight"))
    for i, kind in enumerate(c.layer_types):
        _gguf_layer(c, arch, f"blk.{i}.", f"layers.{i}.", kind, c.moe_layers[i], get, put, norm, fused_experts)
    if has_mtp:
        n = f"blk.{c.num_hidden_layers}."
        put(n + "nextn.eh_proj.weight", lambda: get("mtp.fc.weight"))
        norm(n + "nextn.enorm.weight", "mtp.pre_fc_norm_embedding.weight")
        norm(n + "nextn.hnorm.weight", "mtp.pre_fc_norm_hidden.weight")
        norm(n + "nextn.shared_head_norm.weight", "mtp.norm.weight")
        _gguf_layer(c, arch, n, "mtp.layers.0.", FULL_ATTENTION, c.is_moe, get, put, norm, fused_experts)
    return out


def _gguf_layer(c: ModelConfig, arch: str, b: str, p: str, kind: str, moe: bool, get, put, norm, fused: bool) -> None:
    norm(b + "attn_norm.weight", p + "input_layernorm.weight")
    norm(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")
    if kind == FULL_ATTENTION:
        a = p + "self_attn."
        for name, key in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            put(f"{b}{name}.weight", lambda key=key: get(f"{a}{key}.weight"))
        norm(b + "attn_q_norm.weight", a + "q_norm.weight")
        norm(b + "attn_k_norm.weight", a + "k_norm.weight")
    else:
        _gguf_deltanet(c, arch, b, p + "linear_attn.", get, put)
    m = p + "mlp."
    if not moe:
        for name, key in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            put(f"{b}{name}.weight", lambda key=key: get(f"{m}{key}.weight"))
        return
    put(b + "ffn_gate_inp.weight", lambda: get(m + "gate.weight"))
    for name, key in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
        put(f"{b}{name}.weight", lambda key=key: _stacked_experts(c, get, m, key, fused))
    for name, key in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")):
        put(f"{b}{name}.weight", lambda key=key: get(f"{m}shared_expert.{key}.weight"))
    put(b + "ffn_gate_inp_shexp.weight", lambda: get(m + "shared_expert_gate.weight"))


def _stacked_experts(c: ModelConfig, get, m: str, key: str, fused: bool) -> np.ndarray:
    """[E, out, in]: per-expert matrices stacked, or the fused gate_up / down tensors split."""
    if not fused:
        return np.stack([get(f"{m}experts.{e}.{key}.weight") for e in range(c.num_experts)])
    if key == "down_proj":
        return get(m + "experts.down_proj")
    gate, up = np.split(get(m + "experts.gate_up_proj"), 2, axis=1)
    return gate if key == "gate_proj" else up


def _gguf_deltanet(c: ModelConfig, arch: str, b: str, d: str, get, put) -> None:
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    qk = 2 * hk * dk
    if arch == "qwen3next":
        from engine.checkpoint.hf import qwen3_next_rows

        (qkv_rows, z_rows), _ = qwen3_next_rows(c)
        put(b + "attn_qkv.weight", lambda: get(d + "in_proj_qkvz.weight")[qkv_rows])
        put(b + "attn_gate.weight", lambda: get(d + "in_proj_qkvz.weight")[z_rows])
        put(b + "ssm_ba.weight", lambda: get(d + "in_proj_ba.weight"))
        heads = np.arange(hv)
    else:
        # V heads from grouped (g * r + j) to tiled (j * hk + g) order: row t of the file is grouped head tiled_from[t].
        heads = stored_to_grouped_heads(grouped_to_stored_heads(hk, hv))
        v_rows = np.concatenate([np.arange(qk), qk + head_rows(heads, dv)])
        put(b + "attn_qkv.weight", lambda: get(d + "in_proj_qkv.weight")[v_rows])
        put(b + "attn_gate.weight", lambda: get(d + "in_proj_z.weight")[head_rows(heads, dv)])
        put(b + "ssm_beta.weight", lambda: get(d + "in_proj_b.weight")[heads])
        put(b + "ssm_alpha.weight", lambda: get(d + "in_proj_a.weight")[heads])
    channels = np.concatenate([np.arange(qk), qk + head_rows(heads, dv)])
    put(b + "ssm_conv1d.weight", lambda: get(d + "conv1d.weight")[channels, 0, :])
    put(b + "ssm_a", lambda: -np.exp(get(d + "A_log"))[heads])
    put(b + "ssm_dt.bias", lambda: get(d + "dt_bias")[heads])
    put(b + "ssm_norm.weight", lambda: get(d + "norm.weight"))
    put(b + "ssm_out.weight", lambda: get(d + "out_proj.weight")[:, head_rows(heads, dv)])
