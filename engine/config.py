"""ModelConfig: the geometry of a Qwen3.5-family hybrid model, read from config.json.

One plain dataclass for every supported model type. Multimodal checkpoints (`qwen3_5`,
`qwen3_5_moe`, `qwen4_exp`) nest the text model under `text_config`; the vision part is ignored.
Flash-Next (`qwen4_exp`) adds its hyper-connection, n-gram (PLE) and QSA indexer geometry in
`ModelConfig.flash` (REFERENCE.md section 7).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from duet.engine.errors import CheckpointError

DENSE_TYPES = {"qwen3_5", "qwen3_5_text"}
MOE_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
FLASH_TYPES = {"qwen4_exp", "qwen4_exp_text"}
SUPPORTED_TYPES = DENSE_TYPES | MOE_TYPES | FLASH_TYPES
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"  # Flash-Next's name for its full attention, read through a QSA indexer

# Bounds on what a config may declare. Nothing released comes near them: the deepest models have about
# 128 layers (Llama 3.1 405B: 126), the largest vocabulary is 262 144 (Gemma 3), the widest matrix
# 53 248 (Llama 3.1 405B's feed-forward), the most experts 512 (Qwen3-Next), the longest context 10M
# tokens (Llama 4 Scout). Past them a value is corruption, and believing it would build per-layer tables
# or index arrays of its size (2^40 layer types: a hang) before a single tensor is checked.
MAX_LAYERS = 1 << 12
MAX_SIZE = 1 << 20
MAX_POSITIONS = 1 << 32
# config.json field -> (least, most) of its integer value; 0 where "none" is a valid answer
INT_FIELDS = {
    "vocab_size": (1, MAX_SIZE), "hidden_size": (1, MAX_SIZE), "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, MAX_SIZE), "num_key_value_heads": (1, MAX_SIZE), "head_dim": (1, MAX_SIZE),
    "linear_num_key_heads": (1, MAX_SIZE), "linear_num_value_heads": (1, MAX_SIZE),
    "linear_key_head_dim": (1, MAX_SIZE), "linear_value_head_dim": (1, MAX_SIZE),
    "linear_conv_kernel_dim": (1, MAX_SIZE), "intermediate_size": (0, MAX_SIZE), "num_experts": (0, MAX_SIZE),
    "num_experts_per_tok": (0, MAX_SIZE), "moe_intermediate_size": (0, MAX_SIZE),
    "shared_expert_intermediate_size": (0, MAX_SIZE), "max_position_embeddings": (1, MAX_POSITIONS),
    "mtp_num_hidden_layers": (0, MAX_LAYERS), "full_attention_interval": (1, MAX_LAYERS),
    "decoder_sparse_step": (1, MAX_LAYERS),
    # Flash-Next: hyper-connection streams, PLE n-gram embeddings, the QSA indexer
    "hc_count": (2, 64), "hc_lowrank": (1, MAX_SIZE), "ple_embed_dim": (1, MAX_SIZE),
    "ple_conv_kernel_size": (1, 64), "ngram_size": (2, 16), "heads_per_ngram": (1, 1024),
    "split_ngram_parts": (1, 1 << 16), "indexer_n_heads": (1, MAX_SIZE), "indexer_kv_heads": (1, 1),
    "indexer_head_dim": (1, MAX_SIZE), "indexer_budget": (1, MAX_POSITIONS), "indexer_compress_ratio": (1, MAX_POSITIONS),
}
# float field -> (bound it must exceed, most): finite, least < value <= most
FLOAT_FIELDS = {"rope_theta": (0.0, 1e30), "partial_rotary_factor": (0.0, 1.0), "rms_norm_eps": (0.0, 0.5)}


@dataclass(frozen=True)
class FlashNextConfig:
    """What Flash-Next (`qwen4_exp`) adds to the hybrid geometry. Its hash constants (multipliers, head
    vocabularies and offsets) are read from the checkpoint, as the model was trained with them."""

    hc_count: int  # residual streams
    hc_lowrank: int  # rank of each hyper-connection's input mixer
    ple_layers: tuple[int, ...]  # 0-based DeltaNet layers that add hashed n-gram embeddings
    ple_embed_dim: int  # the concatenated n-gram heads' width
    ple_conv_kernel: int  # taps of the PLE's dilated depthwise conv (dilation ngram_size)
    ngram_size: int  # n-grams of 2..ngram_size tokens
    heads_per_ngram: int
    split_ngram_parts: int  # shards each HF n-gram table is stored in
    indexer_heads: int  # QSA indexer query heads (one key head)
    indexer_head_dim: int
    indexer_budget: int  # tokens of complete blocks a query reads
    indexer_compress_ratio: int  # tokens pooled into one index block

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # feed-forward: dense, or routed experts plus a gated shared expert
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    output_gate: str = "silu"  # the DeltaNet gated norm's activation on z (Flash-Next may use sigmoid)
    flash: FlashNextConfig | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_linear_projections(self) -> bool:
        """Qwen3-Next stores DeltaNet inputs as in_proj_qkvz / in_proj_ba, grouped per key head."""
        return self.model_type == "qwen3_next"

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        return _parse(raw, source)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(path, "config.json is missing; point --model at a folder with config.json") from None
        except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a 5000-digit integer, arrays 10^5 deep
            reason = f" ({exc})" if isinstance(exc, json.JSONDecodeError) else ""
            raise CheckpointError(path, f"config.json is not valid JSON{reason}; re-download the model") from None
        if not isinstance(raw, dict):
            raise CheckpointError(path, "config.json must hold a JSON object; re-download the model")
        return _parse(raw, str(path))


def _parse(raw: dict, source: str) -> ModelConfig:
    top_type = raw.get("model_type")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    model_type = text.get("model_type", top_type)
    if _supported(top_type) and not _supported(model_type):
        model_type = top_type
    if not _supported(model_type):
        known = ", ".join(sorted(SUPPORTED_TYPES))
        raise CheckpointError(source, f"unknown model_type {shown(model_type)}; duet runs {known}")

    def need(key: str):
        if key not in text:
            raise CheckpointError(source, f"missing {key!r}; the file is not a complete {model_type} config")
        return checked(text[key], key, source)

    def opt(key: str, default):
        return checked(text[key], key, source) if text.get(key) is not None else default

    layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    layer_types = _layer_types(text, layers, opt("full_attention_interval", 4), source)
    rope = _rope(text, source)
    flash_type = model_type in FLASH_TYPES
    num_experts = opt("num_experts", 512 if flash_type else 0)  # transformers' Qwen4ExpTextConfig defaults
    moe_layers = _moe_layers(text, model_type, layers, num_experts, source)

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    flash = _flash_next(text, layer_types, hidden, need, opt, source) if flash_type else None
    if flash is not None:
        layer_types = tuple(FULL_ATTENTION if kind == INDEXED_ATTENTION else kind for kind in layer_types)

    config = ModelConfig(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=opt("num_key_value_heads", heads),
        head_dim=opt("head_dim", hidden // heads),
        rope_theta=rope[0],
        partial_rotary_factor=rope[1],
        linear_num_key_heads=opt("linear_num_key_heads", 16),
        linear_num_value_heads=opt("linear_num_value_heads", 32),
        linear_key_head_dim=opt("linear_key_head_dim", 128),
        linear_value_head_dim=opt("linear_value_head_dim", 128),
        linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4),
        intermediate_size=opt("intermediate_size", 0),
        num_experts=num_experts,
        num_experts_per_tok=opt("num_experts_per_tok", 10 if flash_type else 0),
        moe_intermediate_size=opt("moe_intermediate_size", 512 if flash_type else 0),
        shared_expert_intermediate_size=opt("shared_expert_intermediate_size", 512 if flash_type else 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        moe_layers=moe_layers,
        rms_norm_eps=opt("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=opt("max_position_embeddings", 262144),
        mtp_num_hidden_layers=opt("mtp_num_hidden_layers", 0),
        eos_token_ids=eos_ids,
        output_gate=_output_gate(text, source) if flash_type else "silu",
        flash=flash,
    )
    _check_geometry(config, source)
    return config


def _supported(model_type) -> bool:
    return isinstance(model_type, str) and model_type in SUPPORTED_TYPES  # a list is no set member


def shown(value, limit: int = 60) -> str:
    """repr(value), cut: a message quotes a hostile value (a 4000-digit integer, a long list) in one short line."""
    if isinstance(value, int) and value.bit_length() > 128:  # repr of a 5000-digit int raises ValueError
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def checked(value, field: str, source: str, name: str | None = None, remedy: str = "re-download the model"):
    """`value` of config field `field` (INT_FIELDS or FLOAT_FIELDS), checked for type and bounds; a
    CheckpointError naming `name` (the key as the file spells it, default the field) otherwise."""
    name = name or repr(field)
    if field in FLOAT_FIELDS:
        least, most = FLOAT_FIELDS[field]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= most else math.inf  # float(10**400) would overflow
            if least < number <= most:
                return number
        raise CheckpointError(source, f"{name} is {shown(value)}, not a number above {least:g} and at most {most:g}; "
                                      f"the file is corrupt, {remedy}")
    least, most = INT_FIELDS[field]
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= most:
        return value
    raise CheckpointError(source, f"{name} is {shown(value)}, not an integer from {least} to {most}; "
                                  f"the file is corrupt, {remedy}")


def _layer_types(text: dict, layers: int, interval: int, source: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or \
            not all(t in (FULL_ATTENTION, LINEAR_ATTENTION, INDEXED_ATTENTION) for t in types):  # `in` a tuple: no hashing
        raise CheckpointError(source, f"layer_types must list {layers} entries of {FULL_ATTENTION}/{LINEAR_ATTENTION}"
                                      f" ({INDEXED_ATTENTION} in Flash-Next)")
    return tuple(types)


def _output_gate(text: dict, source: str) -> str:
    gate = text.get("output_gate_type") or text.get("hidden_act") or "silu"
    if gate not in ("silu", "sigmoid"):
        raise CheckpointError(source, f"output_gate_type {shown(gate)} is not supported; duet runs silu and sigmoid")
    return gate


def _flash_next(text: dict, layer_types: tuple[str, ...], hidden: int, need, opt, source: str) -> FlashNextConfig:
    """Flash-Next's fields, with transformers' defaults where a config leaves one out."""
    ple_ids = text.get("ple_layer_ids") or []
    if not isinstance(ple_ids, list) or not all(type(i) is int and 1 <= i <= len(layer_types) for i in ple_ids):
        raise CheckpointError(source, f"ple_layer_ids is {shown(ple_ids)}, not a list of layer numbers from 1 to "
                                      f"{len(layer_types)}; the file is corrupt, re-download the model")
    ple_layers = tuple(sorted({i - 1 for i in ple_ids}))
    if any(layer_types[i] != LINEAR_ATTENTION for i in ple_layers):
        raise CheckpointError(source, "ple_layer_ids names a layer that is not linear attention; PLE runs on "
                                      "DeltaNet layers only")
    flash = FlashNextConfig(
        hc_count=opt("hc_count", 4), hc_lowrank=opt("hc_lowrank", 320), ple_layers=ple_layers,
        ple_embed_dim=opt("ple_embed_dim", hidden), ple_conv_kernel=opt("ple_conv_kernel_size", 4),
        ngram_size=opt("ngram_size", 3), heads_per_ngram=opt("heads_per_ngram", 8),
        split_ngram_parts=opt("split_ngram_parts", 512), indexer_heads=need("indexer_n_heads"),
        indexer_head_dim=need("indexer_head_dim"), indexer_budget=need("indexer_budget"),
        indexer_compress_ratio=need("indexer_compress_ratio"))
    opt("indexer_kv_heads", 1)  # checked: QSA has one key head
    if flash.indexer_budget % flash.indexer_compress_ratio:
        raise CheckpointError(source, "indexer_budget is not a multiple of indexer_compress_ratio")
    if ple_layers and flash.ple_embed_dim % flash.ngram_heads:
        raise CheckpointError(source, f"ple_embed_dim {flash.ple_embed_dim} is not a multiple of the "
                                      f"{flash.ngram_heads} n-gram heads")
    return flash


def _rope(text: dict, source: str) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from rope_parameters (transformers 5), rope_scaling or top-level keys."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(source, "rope_parameters must be a JSON object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(source, f"rope type {shown(rope_type)} is not supported; "
                                      "duet runs default (partial) RoPE")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return checked(theta, "rope_theta", source), checked(factor, "partial_rotary_factor", source)


def _moe_layers(text: dict, model_type: str, layers: int, num_experts: int, source: str) -> tuple[bool, ...]:
    if model_type in DENSE_TYPES or num_experts == 0:
        return (False,) * layers
    if model_type == "qwen3_next":
        step = checked(text.get("decoder_sparse_step") or 1, "decoder_sparse_step", source)
        dense = text.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(type(i) is int for i in dense):
            raise CheckpointError(source, f"mlp_only_layers is {shown(dense)}, not a list of layer numbers; "
                                          "the file is corrupt, re-download the model")
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return (True,) * layers


def _check_geometry(c: ModelConfig, source: str) -> None:
    problems = []
    if c.head_dim < 1:
        problems.append("hidden_size is smaller than num_attention_heads, and no head_dim is given")
    if c.num_attention_heads % max(c.num_key_value_heads, 1):
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if c.linear_num_value_heads % max(c.linear_num_key_heads, 1):
        problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
    if c.rotary_dim % 2 or c.rotary_dim > c.head_dim or (c.head_dim and not c.rotary_dim):
        problems.append("partial_rotary_factor gives an odd, zero or oversized rotary dimension")
    if c.is_moe and not (0 < c.num_experts_per_tok <= c.num_experts):
        problems.append("num_experts_per_tok must be between 1 and num_experts")
    if not c.is_moe and c.intermediate_size <= 0:
        problems.append("intermediate_size is missing")
    if c.flash is not None:
        if not c.is_moe:
            problems.append("Flash-Next needs num_experts")
        if c.rotary_dim > c.flash.indexer_head_dim:
            problems.append("the rotary dimension does not fit the QSA indexer head")
        if c.flash.ple_layers and not c.eos_token_ids:
            problems.append("PLE layers need eos_token_id (n-gram history stops at it)")
    if problems:
        raise CheckpointError(source, "; ".join(problems))
