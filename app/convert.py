"""`duet convert SRC DST --format F`: a bf16/fp16/fp32 HF checkpoint to INT4 safetensors or to GGUF.

    int4          compressed-tensors `pack-quantized`: symmetric INT4, group 128, round to nearest,
                  the W4 layout (engine/quant/w4.py). Kept 16-bit as real INT4 checkpoints keep them:
                  embeddings, lm_head, DeltaNet in_proj_a/b, routers, shared-expert gates, and any
                  matrix whose input size is not a multiple of 128 (listed in `ignore`, and named in
                  what convert prints). A model none of whose matrices fit is refused. Flash-Next
                  (qwen4_exp) also keeps its hyper-connection mixers (sigmoid gates over a few
                  thousand inputs: small, and what every stream's weight comes from) and its QSA
                  indexer (a block's pick turns on score differences 4-bit noise would swamp) in
                  16 bit; its n-gram tables and hash constants are copied as they are.
    gguf-f32, gguf-f16, gguf-bf16, gguf-q8_0, gguf-q4_0
                  GGUF as llama.cpp's convert_hf_to_gguf.py writes the architecture (qwen35,
                  qwen35moe, qwen3next), tokenizer and chat template included; which tensor goes where
                  is engine/checkpoint/gguf_names.py's table. Matrices take the type; vectors, conv
                  taps and router gates stay f32, as the converter keeps them.

    trellis-2, trellis-3, trellis-4
                  duet's trellis files (engine/checkpoint/trellis_files.py): the matrices INT4 would
                  code, when N % 16 == 0 too, Hadamard-rotated and trellis-coded at 2, 3 or 4 bits
                  per weight (engine/quant/trellis.py); the rest kept as they are, named and refused
                  as for int4.

Natural routes: int4 -> w4a16 (also w4a8); gguf-q8_0 / gguf-q4_0 / trellis-K -> w4a8; float files -> bf16.
DST is a new folder (int4, trellis) or a new .gguf path. Everything is checked before a byte is
written, and the output is written beside DST and renamed into place when complete: DST is whole or
absent, and nothing existing is overwritten.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duet.engine.checkpoint.gguf_names import GGUF_ARCHITECTURE, gguf_tensors
from duet.engine.checkpoint.hf import TensorPlan, split_qwen3_next_projections
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import FULL_ATTENTION, ModelConfig
from duet.engine.errors import DuetError
from duet.engine.checkpoint.trellis_files import trellis_metadata
from duet.engine.quant import trellis
from duet.engine.quant.w4 import GROUP, quantize_rtn

INT4 = "int4"
GGUF_TYPES = {"gguf-f32": "F32", "gguf-f16": "F16", "gguf-bf16": "BF16", "gguf-q8_0": "Q8_0", "gguf-q4_0": "Q4_0"}
TRELLIS_RATES = {f"trellis-{k}": k for k in trellis.RATES}
TRELLIS_SEED = 1  # rotation signs of every matrix: np.random.default_rng(1), first K of them
FORMATS = (INT4, *GGUF_TYPES, *TRELLIS_RATES)
OUR_FORMAT = {"duet.format": "int4-pack-quantized", "duet.version": "1"}  # __metadata__ of our INT4 files
# in_proj_ba is Qwen3-Next's fused in_proj_b + in_proj_a: kept 16-bit like them (its per-head split
# takes rows that cut trellis tiles).
KEPT_16BIT = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate", "shared_expert_gate",
              "input_mix_weight_down", "input_mix_weight_up", "block_inject_weight", "index_qk_proj")
MROPE_SECTIONS = [11, 11, 10, 0]  # llama.cpp requires the key for qwen35; text-only positions make it plain RoPE
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "BF16": 32}  # general.file_type (llama_ftype)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def add_convert_command(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="HF model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("dst", metavar="DST", help="new folder (int4, trellis) or new .gguf file")
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    parser.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    src, dst, fmt = Path(args.src).expanduser(), Path(args.dst).expanduser(), args.format
    if not src.is_dir():
        raise DuetError(f"{src}: no such model folder; pass SRC as a folder holding config.json")
    if dst.exists():
        raise DuetError(f"{dst}: already exists; pass DST as a new path (nothing is overwritten)")
    if fmt in GGUF_TYPES and dst.suffix != ".gguf":
        raise DuetError(f"{dst}: a GGUF output needs a .gguf file name")
    config = ModelConfig.from_file(src / "config.json")
    ckpt = SafetensorsCheckpoint(src)
    try:
        plan = TensorPlan(ckpt, config)  # checks every tensor the model needs before anything is written
        if fmt in GGUF_TYPES:
            print(convert_to_gguf(src, dst, fmt, config, ckpt, plan))
        else:
            print(convert_to_coded(src, dst, fmt, ckpt, plan))
    finally:
        ckpt.close()
    return 0


def convert_to_gguf(src: Path, dst: Path, fmt: str, config: ModelConfig, ckpt: SafetensorsCheckpoint,
                    plan: TensorPlan) -> str:
    arch = gguf_architecture(src, config)
    vocabulary = read_gguf_vocabulary(src, config)
    with staged(dst) as out:
        count = write_gguf(src, out, config, ckpt, plan, arch, vocabulary, GGUF_TYPES[fmt])
    return f"wrote {dst}: {count} tensors, {GGUF_TYPES[fmt]} matrices"


def convert_to_coded(src: Path, dst: Path, fmt: str, ckpt: SafetensorsCheckpoint, plan: TensorPlan) -> str:
    """int4 or trellis-K; what is said names the matrices left unquantized because of their sizes."""
    unfit = matrices_that_do_not_fit(src, plan, fmt, trellis.TILE_ROWS if fmt in TRELLIS_RATES else 1)
    with staged(dst) as out:
        if fmt == INT4:
            count = write_int4(src, out, ckpt, plan)
        else:
            count = write_trellis(src, out, ckpt, plan, TRELLIS_RATES[fmt])
    coding = (f"INT4 (compressed-tensors pack-quantized, group {GROUP})" if fmt == INT4
              else f"trellis-coded at {TRELLIS_RATES[fmt]} bits per weight")
    summary = f"wrote {dst}: {count} matrices {coding}"
    if unfit:
        summary += f"\nnot quantized, their sizes do not fit {fmt}: " + ", ".join(f"{m} ({why})" for m, why in unfit.items())
    return summary


@contextmanager
def staged(dst: Path) -> Iterator[Path]:
    """A path beside dst to write the output to, renamed to dst once it is complete and removed if
    writing fails, so that DST is never half-written."""
    partial = dst.with_name(f".{dst.name}.partial")
    remove(partial)  # left by a run that was killed
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        yield partial
        if dst.exists():
            raise DuetError(f"{dst}: appeared while converting; nothing was overwritten, pass another DST")
        partial.rename(dst)
    except OSError as error:
        raise DuetError(f"{dst}: converting failed ({error.strerror or error}); nothing was written there, "
                        "free some space or pass another DST") from None
    finally:
        remove(partial)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# --------------------------------------------------------------------------------------------
# INT4 safetensors (compressed-tensors pack-quantized) and trellis files


def why_kept(name: str, shape: tuple[int, ...], tile_rows: int = 1) -> str | None:
    """None if an INT4 or trellis file codes this tensor; else why it stays as it is ('' for the
    tensors every such file keeps: vectors, embeddings, head, gate inputs, routers)."""
    if len(shape) != 2 or not name.endswith(".weight") or name[: -len(".weight")].endswith(KEPT_16BIT):
        return ""
    if shape[1] % GROUP:
        return f"{shape[1]} inputs, not a multiple of {GROUP}"
    if shape[0] % tile_rows:
        return f"{shape[0]} outputs, not a multiple of {tile_rows}"
    return None


def matrices_that_do_not_fit(src: Path, plan: TensorPlan, fmt: str, tile_rows: int) -> dict[str, str]:
    """From the headers, before anything is read: the modules the format would code but whose sizes do
    not fit its groups (layer and expert numbers as *), with why. Refuses a model it would not code at all."""
    def shape_only(name: str) -> np.ndarray:  # a read-free stand-in of the tensor: one zero broadcast
        return np.broadcast_to(np.float32(0), plan.expected[name])

    unfit, coded = {}, 0
    for name, matrix in per_expert_matrices(shape_only, plan):
        why = why_kept(name, matrix.shape, tile_rows)
        coded += why is None
        if why:
            unfit.setdefault(re.sub(r"\.\d+\.", ".*.", name[: -len(".weight")]), why)
    if not coded:
        reasons = "; ".join(sorted(set(unfit.values()))) or "it has no matrix but the ones always kept"
        raise DuetError(f"{src}: {fmt} would code none of this model's matrices ({reasons}); "
                        "convert with --format gguf-q8_0 (blocks of 32) or gguf-f16 instead")
    return unfit


def write_int4(src: Path, dst: Path, ckpt: SafetensorsCheckpoint, plan: TensorPlan) -> int:
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    ignore, count = [], 0
    for name, matrix in per_expert_matrices(ckpt.read_f32, plan):
        why = why_kept(name, matrix.shape)
        if why is None:
            module, w4 = name[: -len(".weight")], quantize_rtn(matrix)
            tensors[module + ".weight_packed"] = ("I32", w4.packed.shape, w4.packed.tobytes())
            tensors[module + ".weight_scale"] = ("BF16", w4.scales.shape, w4.scales.tobytes())
            tensors[module + ".weight_shape"] = ("I64", (2,), np.array(matrix.shape, np.int64).tobytes())
            count += 1
        else:
            if matrix.ndim == 2 and name.endswith(".weight"):
                ignore.append(name[: -len(".weight")])
            tensors[name] = raw_tensor(ckpt, name, matrix)
    tensors.update(copied_as_stored(ckpt, plan))
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
    for name, matrix in per_expert_matrices(ckpt.read_f32, plan):
        if why_kept(name, matrix.shape, trellis.TILE_ROWS) is None:
            module = name[: -len(".weight")]
            coded = trellis.quantize_matrix(matrix, k, TRELLIS_SEED, trellis.STEPS[k])
            tensors[module + ".trellis_codes"] = ("U8", coded.packed.shape, coded.packed.tobytes())
            tensors[module + ".trellis_row_scale"] = ("F32", coded.row_scale.shape, coded.row_scale.tobytes())
            count += 1
        else:
            tensors[name] = raw_tensor(ckpt, name, matrix)
    tensors.update(copied_as_stored(ckpt, plan))
    dst.mkdir(parents=True)
    write_safetensors(dst / "model.safetensors", tensors, {"format": "pt", **trellis_metadata(k, TRELLIS_SEED)})
    for file in ("config.json", *TOKENIZER_FILES):
        if (src / file).exists():
            shutil.copy(src / file, dst / file)
    return count


def per_expert_matrices(read, plan: TensorPlan):
    """(name, fp32 array) of every tensor the model reads (`read(name)` reads one); fused experts split
    into per-expert matrices."""
    for name in plan.expected:
        value = read(name)
        if name.endswith(FUSED_EXPERTS):
            yield from expert_matrices(name, value).items()
        else:
            yield name, value


def copied_as_stored(ckpt: SafetensorsCheckpoint, plan: TensorPlan) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Flash-Next's n-gram table shards and int64 hash constants, byte for byte: no format codes them."""
    names = [*plan.integers, *(name for shards in plan.tables.values() for name in shards)]
    return {name: stored_bytes(ckpt, name) for name in names}


FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def expert_matrices(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """A fused experts tensor (`...experts.gate_up_proj` [E, 2I, H] or `...experts.down_proj` [E, H, I])
    as per-expert matrices by name (`...experts.3.up_proj.weight`)."""
    base, _, kind = name.rpartition(".")
    if kind == "down_proj":
        return {f"{base}.{e}.down_proj.weight": matrix for e, matrix in enumerate(value)}
    out = {}
    for e, matrix in enumerate(value):
        out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = np.split(matrix, 2)
    return out


def raw_tensor(ckpt: SafetensorsCheckpoint, name: str, value: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """A tensor kept as the source stores it (bf16 stays bf16); split experts are written in fp32."""
    if name in ckpt and ckpt.info(name).dtype in ("BF16", "F16", "F32"):
        return stored_bytes(ckpt, name)
    return "F32", value.shape, np.ascontiguousarray(value, np.float32).tobytes()


def stored_bytes(ckpt: SafetensorsCheckpoint, name: str) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, data) of a tensor exactly as its file holds it."""
    info = ckpt.info(name)
    with open(ckpt.file_of(name), "rb") as handle:
        handle.seek(info.begin)
        return info.dtype, info.shape, handle.read(info.nbytes)


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


def gguf_architecture(src: Path, config: ModelConfig) -> str:
    arch = GGUF_ARCHITECTURE[config.model_type]
    dense = [i for i, moe in enumerate(config.moe_layers) if not moe]
    if arch == "qwen3next" and dense:
        raise DuetError(f"{src / 'config.json'}: layers {dense} have a dense MLP (mlp_only_layers), but llama.cpp's "
                        "qwen3next has experts in every layer, so GGUF cannot hold this model; convert with --format int4")
    if arch == "qwen4exp" and len(config.flash.ple_layers) > 1:
        raise DuetError(f"{src / 'config.json'}: PLE on {len(config.flash.ple_layers)} layers, but llama.cpp's qwen4exp "
                        "holds one n-gram table, so GGUF cannot hold this model; convert with --format int4")
    return arch


def write_gguf(src: Path, dst: Path, config: ModelConfig, ckpt: SafetensorsCheckpoint, plan: TensorPlan, arch: str,
               vocabulary: GGUFVocabulary, qtype_name: str) -> int:
    """The header (keys and tensor infos, from the name table's shapes), then the data one tensor at a
    time, so memory holds one converted tensor, never the model."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    tensors = gguf_tensors(config, arch, plan.has_mtp, plan.ngram_rows)
    writer = gguf.GGUFWriter(str(dst), arch)
    write_gguf_metadata(writer, config, arch, src.name, qtype, plan.has_mtp)
    if config.flash:
        write_flash_next_metadata(writer, config, ckpt, plan)
    vocabulary.write(writer)
    kinds = [gguf_type(tensor, qtype) for tensor in tensors]
    for tensor, kind in zip(tensors, kinds):
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16)
            writer.add_tensor_info(tensor.name, tensor.shape, dtype, int(np.prod(tensor.shape)) * dtype.itemsize)
        else:
            shape = gguf.quant_shape_to_byte_shape(tensor.shape, kind)
            writer.add_tensor_info(tensor.name, shape, np.dtype(np.uint8), int(np.prod(shape)), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    read = ModelTensors(ckpt, plan)
    for tensor, kind in zip(tensors, kinds):
        writer.write_tensor_data(gguf_data(tensor.from_model(read), kind))
    writer.close()
    return len(tensors)


TABLES = ("token_embd.weight", "output.weight")  # the embedding and the output head


def gguf_type(tensor, qtype):
    """The GGML type a tensor is written in: qtype for matrices whose rows fit its blocks, else F32.

    Embedding and output head stay Q8_0 in a Q4_0 file: one token's row or the logits take the
    whole error of their 32-blocks, so llama-quantize keeps them above the body's type too.
    """
    import gguf

    if tensor.name in TABLES and qtype == gguf.GGMLQuantizationType.Q4_0:
        qtype = gguf.GGMLQuantizationType.Q8_0
    if tensor.float32 or tensor.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F32
    return qtype


def gguf_data(value: np.ndarray, kind) -> np.ndarray:
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(value, np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return value.astype(np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(value, np.float32), kind)


class ModelTensors:
    """fp32 tensors of an HF checkpoint by model key, in the layout the name table uses whatever the
    checkpoint's: fused experts come out per expert, Qwen3-Next's in_proj_qkvz / in_proj_ba split as
    engine/checkpoint/hf.py splits them. The parts of the last fused tensor read are kept, since the
    table asks for them one after another."""

    def __init__(self, ckpt: SafetensorsCheckpoint, plan: TensorPlan):
        self.ckpt, self.plan = ckpt, plan
        self.parts: dict[str, np.ndarray] = {}

    def __call__(self, key: str) -> np.ndarray:
        name = self.plan.name(key)
        if name in self.ckpt:
            return self.ckpt.read_f32(name)
        if key in self.plan.tables:  # Flash-Next's n-gram table: its shards, joined (GGUF holds it whole)
            return np.concatenate([self.ckpt.read_f32(shard) for shard in self.plan.tables[key]])
        if key not in self.parts:
            self.parts = self._fused_parts(key)
        return self.parts[key]

    def _fused_parts(self, key: str) -> dict[str, np.ndarray]:
        experts, _, expert_part = key.partition(".experts.")
        if expert_part:  # ...experts.3.up_proj.weight: in experts.gate_up_proj or experts.down_proj
            fused = f"{experts}.experts.{'down_proj' if expert_part.endswith('down_proj.weight') else 'gate_up_proj'}"
            return expert_matrices(fused, self.ckpt.read_f32(self.plan.name(fused)))
        d = key[: key.index("linear_attn.") + len("linear_attn.")]
        parts = {d + name: self.ckpt.read_f32(self.plan.name(d + name)) for name in ("in_proj_qkvz.weight", "in_proj_ba.weight")}
        split_qwen3_next_projections(self.plan.config, parts)
        return parts


def write_gguf_metadata(writer, config: ModelConfig, arch: str, name: str, qtype, mtp: bool) -> None:
    import gguf

    c = config
    mtp_layers = c.mtp_num_hidden_layers if mtp else 0
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[qtype.name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(c.num_hidden_layers + mtp_layers)
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
    recurrent = [kind != FULL_ATTENTION for kind in c.layer_types] + [False] * mtp_layers
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(_full_attention_interval(c))
    writer.add_rope_dimension_count(c.rotary_dim)
    if arch != "qwen3next":
        writer.add_rope_dimension_sections(MROPE_SECTIONS)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)


def write_flash_next_metadata(writer, c: ModelConfig, ckpt: SafetensorsCheckpoint, plan: TensorPlan) -> None:
    """qwen4exp's keys, as llama.cpp's converter writes them (conversion/qwen4exp.py): the hash constants
    as uint64 arrays (a float32 tensor would round the multipliers), every block's compress ratio."""
    import gguf

    f, arch = c.flash, "qwen4exp"
    writer.add_uint32(f"{arch}.hyper_connection.count", f.hc_count)
    writer.add_uint32(f"{arch}.hyper_connection.low_rank", f.hc_lowrank)
    writer.add_uint32(f"{arch}.attention.indexer.head_count", f.indexer_heads)
    writer.add_uint32(f"{arch}.attention.indexer.key_length", f.indexer_head_dim)
    writer.add_uint32(f"{arch}.attention.indexer.top_k", f.indexer_budget)
    blocks = list(c.layer_types) + [FULL_ATTENTION] * (c.mtp_num_hidden_layers if plan.has_mtp else 0)
    writer.add_array(f"{arch}.attention.compress_ratios",
                     [f.indexer_compress_ratio if kind == FULL_ATTENTION else 0 for kind in blocks])
    if not f.ple_layers:
        return
    writer.add_array(f"{arch}.ple.layers", list(f.ple_layers))
    writer.add_uint32(f"{arch}.ple.ngram_size", f.ngram_size)
    writer.add_uint32(f"{arch}.ple.heads_per_ngram", f.heads_per_ngram)
    writer.add_uint32(f"{arch}.ple.conv_kernel", f.ple_conv_kernel)
    writer.add_uint32(f"{arch}.ple.eos_token_id", c.eos_token_ids[0])
    writer.add_uint32(f"{arch}.embedding_length_per_layer_input", f.ple_embed_dim // f.ngram_heads)
    p = plan.name(f"layers.{f.ple_layers[0]}.ple.ple_embedding.")
    for key, tensor in (("layer_multipliers", "layer_multipliers"), ("head_offsets", "ngram_heads_offsets"),
                        ("head_vocab_sizes", "ngram_heads_vocab_sizes")):
        writer.add_key_value(f"{arch}.ple.{key}", [int(v) for v in ckpt.read_ints(p + tensor)], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.UINT64)  # add_array would take them for int32


def _full_attention_interval(c: ModelConfig) -> int:
    full = [i for i, kind in enumerate(c.layer_types) if kind == FULL_ATTENTION]
    return full[0] + 1 if full else c.num_hidden_layers + 1


@dataclass(frozen=True)
class GGUFVocabulary:
    """tokenizer.ggml.*: gpt2-style BPE tokens padded to the vocabulary, types, merges, ids, template."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    eos_id: int | None
    pad_id: int | None
    bos_id: int | None
    chat_template: str | None

    def write(self, writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        writer.add_token_merges(self.merges)
        for token_id, add in ((self.eos_id, writer.add_eos_token_id), (self.pad_id, writer.add_pad_token_id),
                              (self.bos_id, writer.add_bos_token_id)):
            if token_id is not None:
                add(token_id)
        writer.add_add_bos_token(False)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def read_gguf_vocabulary(src: Path, config: ModelConfig) -> GGUFVocabulary:
    """The tokenizer a GGUF file carries, read and checked from SRC's tokenizer files."""
    from gguf import TokenType

    from duet.engine.tokenizer import GGUF_PRE_SPLITS, Tokenizer

    path = src / "tokenizer.json"
    if not path.is_file():
        raise DuetError(f"{src}: has no tokenizer.json, and a GGUF file carries the tokenizer; copy tokenizer.json "
                        "and tokenizer_config.json from the original model into it, or convert with --format int4")
    tokenizer = Tokenizer.from_dir(src, extra_eos_ids=config.eos_token_ids)  # refuses a malformed file in one line
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise DuetError(f"{path}: a {model.get('type')} tokenizer; GGUF conversion takes byte-level BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in data.get("added_tokens", [])}
    vocab.update({content: token["id"] for content, token in added.items()})
    beyond = max(vocab.values(), default=0)
    if beyond >= config.vocab_size:
        raise DuetError(f"{path}: has token id {beyond}, past the model's vocab_size {config.vocab_size}; "
                        "the tokenizer is not this model's")
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    types = [TokenType.UNUSED] * config.vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = (TokenType.CONTROL if added[token].get("special") else TokenType.USER_DEFINED) if token in added \
            else TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def token_id(token: str | None) -> int | None:
        return None if token is None else vocab[token]

    return GGUFVocabulary(tokens, types, merges, pre_tokenizer_name(data.get("pre_tokenizer"), src, GGUF_PRE_SPLITS),
                          token_id(tokenizer.eos_token), token_id(tokenizer.pad_token), token_id(tokenizer.bos_token),
                          tokenizer.chat_template)


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
