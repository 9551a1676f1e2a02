"""ModelConfig: the geometry of a Qwen3.5-family hybrid model, read from config.json.

One plain dataclass for every supported model type. Multimodal checkpoints (`qwen3_5`,
`qwen3_5_moe`) nest the text model under `text_config`; the vision part is ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from duet.engine.errors import CheckpointError

DENSE_TYPES = {"qwen3_5", "qwen3_5_text"}
MOE_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
SUPPORTED_TYPES = DENSE_TYPES | MOE_TYPES
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(path, f"config.json is not valid JSON ({exc}); re-download the model") from None
        if not isinstance(raw, dict):
            raise CheckpointError(path, "config.json must hold a JSON object; re-download the model")
        return _parse(raw, str(path))


def _parse(raw: dict, source: str) -> ModelConfig:
    top_type = raw.get("model_type")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    model_type = text.get("model_type", top_type)
    if top_type in SUPPORTED_TYPES and model_type not in SUPPORTED_TYPES:
        model_type = top_type
    if model_type not in SUPPORTED_TYPES:
        known = ", ".join(sorted(SUPPORTED_TYPES))
        raise CheckpointError(source, f"unknown model_type {model_type!r}; duet runs {known}")

    def need(key: str, kind=int):
        if key not in text:
            raise CheckpointError(source, f"missing {key!r}; the file is not a complete {model_type} config")
        return _typed(text[key], kind, key, source)

    def opt(key: str, default, kind=int):
        return _typed(text[key], kind, key, source) if text.get(key) is not None else default

    layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    layer_types = _layer_types(text, layers, source)
    rope = _rope(text, source)
    num_experts = opt("num_experts", 0)
    moe_layers = _moe_layers(text, model_type, layers, num_experts)

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))

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
        num_experts_per_tok=opt("num_experts_per_tok", 0),
        moe_intermediate_size=opt("moe_intermediate_size", 0),
        shared_expert_intermediate_size=opt("shared_expert_intermediate_size", 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        moe_layers=moe_layers,
        rms_norm_eps=opt("rms_norm_eps", 1e-6, float),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=opt("max_position_embeddings", 262144),
        mtp_num_hidden_layers=opt("mtp_num_hidden_layers", 0),
        eos_token_ids=eos_ids,
    )
    _check_geometry(config, source)
    return config


def _typed(value, kind, key: str, source: str):
    if kind is int and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise CheckpointError(source, f"{key!r} has the invalid value {value!r}; re-download the model")


def _layer_types(text: dict, layers: int, source: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise CheckpointError(source, f"layer_types must list {layers} entries of {FULL_ATTENTION}/{LINEAR_ATTENTION}")
    return tuple(types)


def _rope(text: dict, source: str) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from rope_parameters (transformers 5), rope_scaling or top-level keys."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(source, "rope_parameters must be a JSON object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(source, f"rope type {rope_type!r} is not supported; duet runs default (partial) RoPE")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return _typed(theta, float, "rope_theta", source), _typed(factor, float, "partial_rotary_factor", source)


def _moe_layers(text: dict, model_type: str, layers: int, num_experts: int) -> tuple[bool, ...]:
    if model_type in DENSE_TYPES or num_experts == 0:
        return (False,) * layers
    if model_type == "qwen3_next":
        step = text.get("decoder_sparse_step", 1) or 1
        dense = set(text.get("mlp_only_layers") or [])
        return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return (True,) * layers


def _check_geometry(c: ModelConfig, source: str) -> None:
    problems = []
    if c.num_attention_heads % max(c.num_key_value_heads, 1):
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if c.linear_num_value_heads % max(c.linear_num_key_heads, 1):
        problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
    if c.rotary_dim % 2 or c.rotary_dim > c.head_dim:
        problems.append("partial_rotary_factor gives an odd or oversized rotary dimension")
    if c.is_moe and not (0 < c.num_experts_per_tok <= c.num_experts):
        problems.append("num_experts_per_tok must be between 1 and num_experts")
    if not c.is_moe and c.intermediate_size <= 0:
        problems.append("intermediate_size is missing")
    if problems:
        raise CheckpointError(source, "; ".join(problems))
