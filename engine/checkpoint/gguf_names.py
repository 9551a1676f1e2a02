"""The one table between model keys and GGUF names, for llama.cpp's qwen35, qwen35moe, qwen3next and qwen4exp.

Both directions read it: the GGUF reader (gguf.py) takes each model tensor out of its GGUF tensor,
`duet convert` (app/convert.py) puts it in, and both readers (gguf.py and headers.py) make the
ModelConfig from the same `{arch}.*` keys.

A GGUF file is a list of `GGUFTensor`s: a name, a shape in numpy order (outermost first, the reverse
of GGUF's ne), and the model tensors it holds (`Link`s, by the model keys of engine/weights.py:
`layers.3.mlp.up_proj.weight`, `lm_head.weight`, `mtp.fc.weight`). A link undoes what llama.cpp's
converter (convert_hf_to_gguf.py, its Qwen3Next and Qwen3.5 classes) did to the tensor:

    values    zero-centred norms are stored as 1 + w (not the DeltaNet gated norm, ssm_norm);
              A_log as ssm_a = -exp(A_log); conv taps [C, 1, K] squeezed to ssm_conv1d [C, K]
    rows      qwen35/qwen35moe tile DeltaNet value heads (value head j of key head g at j * Hk + g)
              where HF groups them (g * r + j): the V rows of attn_qkv, attn_gate, ssm_beta,
              ssm_alpha, ssm_a, ssm_dt and the conv channels are taken back in grouped order;
              qwen3next keeps in_proj_b and in_proj_a in one ssm_ba, per key head [b r | a r]
    columns   ssm_out's inputs are value heads in the file's (tiled) order: the model gathers its
              input into that order (engine/weights.InputOrder), since quantized blocks cannot be split
    expert    ffn_{gate,up,down}_exps stack the experts [E, out, in]; shared expert *_shexp, router
              ffn_gate_inp, shared-expert gate ffn_gate_inp_shexp
    MTP       block n_layer: blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm} and a full-attention
              layer's tensors under blk.N
    qwen4exp  (Flash-Next, llama.cpp's conversion/qwen4exp.py) no layer or output norms: hyper-connections
              hc_{attn,ffn}_{norm,down,up,inject} per block and output_hc_{norm,down,up}; index_qk_proj
              split into indexer.q_proj and indexer.k_proj (each holds rows of one model tensor); PLE's
              ple_key/value/norm_*/conv1d and one n-gram table, per_layer_token_embd, its hash constants
              as `{arch}.ple.*` keys; MTP eh_proj holding fc_embedding and fc_hidden as column blocks.
              llama.cpp's format has one table: one PLE layer.

qwen3next: Qwen3-Next checkpoints fuse in_proj_qkvz and in_proj_ba per key head; llama.cpp splits
in_proj_qkvz into attn_qkv (all q, all k, all v, value heads grouped) and attn_gate (z), which is the
Qwen3.5 layout. So a qwen3next file is presented as `qwen3_5_moe_text` with Qwen3.5's model keys,
in_proj_b and in_proj_a being rows of ssm_ba. Presenting it as `qwen3_next` would mean re-fusing
attn_qkv and attn_gate into one in_proj_qkvz, which quantized files (llama-quantize gives attn_qkv its
own block type) cannot do; HF Qwen3-Next checkpoints reach the same keys through
engine/checkpoint/hf.py's qwen3_next_rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from duet.engine.checkpoint.hf import qwen3_next_rows
from duet.engine.config import FULL_ATTENTION, LINEAR_ATTENTION, MAX_SIZE, ModelConfig, checked, shown
from duet.engine.errors import CheckpointError
from duet.engine.weights import InputOrder, take_columns, take_rows

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_5_moe_text",
                 "qwen4exp": "qwen4_exp_text"}
GGUF_ARCHITECTURE = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe",
                     "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next", "qwen4_exp": "qwen4exp",
                     "qwen4_exp_text": "qwen4exp"}  # model_type -> arch
TILED_V_HEADS = {"qwen35", "qwen35moe", "qwen4exp"}
MOE_ARCHITECTURES = {"qwen35moe", "qwen3next", "qwen4exp"}
NGRAM_TABLE = "per_layer_token_embd.weight"


# --------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class Values:
    """What the converter did to each value (and the model tensor's shape) on the way into the file."""

    to_gguf: Callable[[np.ndarray], np.ndarray]
    from_gguf: Callable[[np.ndarray], np.ndarray]
    model_shape: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda shape: shape


AS_STORED = Values(lambda w: w, lambda w: w)
ONE_PLUS = Values(lambda w: w + np.float32(1), lambda w: w - np.float32(1))  # zero-centred norms
NEG_EXP = Values(lambda a: -np.exp(a), lambda a: np.log(-a))  # ssm_a = -exp(A_log)
SQUEEZED = Values(lambda w: w[:, 0, :], lambda w: w[:, None, :], lambda s: (s[0], 1, s[1]))  # conv [C, 1, K]


@dataclass(frozen=True, eq=False)
class Link:
    """Model tensor `key` inside a GGUF tensor `stored`, each part where given:

        stored[expert][rows][:, cols] == values.to_gguf(model[part_of])[:, input_order]

    `part_of`: the GGUF tensor holds only these rows of the model tensor, the others hold the rest."""

    key: str
    values: Values = AS_STORED
    expert: int | None = None
    rows: np.ndarray | None = None
    input_order: np.ndarray | None = None
    cols: slice | None = None
    part_of: slice | None = None

    def model_shape(self, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of what this link reads (a part's rows only, for `part_of`)."""
        shape = stored_shape[1:] if self.expert is not None else stored_shape
        if self.rows is not None:
            shape = (len(self.rows), *shape[1:])
        if self.cols is not None:
            shape = (shape[0], self.cols.stop - self.cols.start)
        return self.values.model_shape(shape)

    def from_gguf(self, stored):
        """The model tensor (or its part) from its GGUF tensor (one expert's part of a stacked one): an
        fp32 array, or the file's blocks (rows or columns taken, inputs as InputOrder) for a quantized matrix."""
        if self.rows is not None:
            stored = take_rows(stored, self.rows)
        if self.cols is not None:
            stored = take_columns(stored, self.cols)
        model = self.values.from_gguf(stored)
        return model if self.input_order is None else InputOrder(model, self.input_order)

    def to_gguf(self, model: np.ndarray) -> np.ndarray:
        """The model tensor's values as they go into the GGUF tensor (at `expert`, `rows`, `cols`)."""
        stored = self.values.to_gguf(model if self.part_of is None else model[self.part_of])
        return stored if self.input_order is None else stored[:, self.input_order]


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of the file: name, shape (numpy order) and the model tensors it holds. `float32`:
    llama.cpp's converter keeps it f32 (vectors, conv taps, router gates), and it is read as fp32."""

    name: str
    shape: tuple[int, ...]
    links: tuple[Link, ...]
    float32: bool = False

    def from_model(self, get: Callable[[str], np.ndarray]) -> np.ndarray:
        """This tensor's fp32 data, `get(key)` giving each model tensor it holds."""
        first = self.links[0]
        if len(self.links) == 1 and first.expert is None and first.rows is None and first.cols is None:
            return np.asarray(first.to_gguf(get(first.key)), np.float32)
        data = np.empty(self.shape, np.float32)
        for link in self.links:
            part = data if link.expert is None else data[link.expert]
            part = part if link.cols is None else part[:, link.cols]
            part[slice(None) if link.rows is None else link.rows] = link.to_gguf(get(link.key))
        return data


def gguf_tensors(c: ModelConfig, arch: str, mtp: bool, ngram_rows: int = 0) -> list[GGUFTensor]:
    """Every tensor of the `arch` GGUF file of model c, in the order duet's converter writes them;
    `mtp`: with the MTP block; `ngram_rows`: Flash-Next's n-gram table's rows (not in the config)."""
    if arch == "qwen4exp":
        return _flash_next(c, mtp, ngram_rows)
    H = c.hidden_size
    tensors = [_whole("token_embd.weight", (c.vocab_size, H), "embed_tokens.weight"),
               _norm("output_norm.weight", H, "norm.weight")]
    if not c.tie_word_embeddings:
        tensors.append(_whole("output.weight", (c.vocab_size, H), "lm_head.weight"))
    for i, kind in enumerate(c.layer_types):
        tensors += _block(c, arch, f"blk.{i}.", f"layers.{i}.", kind, c.moe_layers[i])
    if mtp:
        n = f"blk.{c.num_hidden_layers}."
        tensors += [_whole(n + "nextn.eh_proj.weight", (H, 2 * H), "mtp.fc.weight"),
                    _norm(n + "nextn.enorm.weight", H, "mtp.pre_fc_norm_embedding.weight"),
                    _norm(n + "nextn.hnorm.weight", H, "mtp.pre_fc_norm_hidden.weight"),
                    _norm(n + "nextn.shared_head_norm.weight", H, "mtp.norm.weight")]
        tensors += _block(c, arch, n, "mtp.layers.0.", FULL_ATTENTION, c.is_moe)
    return tensors


def _whole(name: str, shape: tuple[int, ...], key: str, values: Values = AS_STORED, float32: bool = False,
           **placement) -> GGUFTensor:
    """A GGUF tensor holding one model tensor."""
    return GGUFTensor(name, shape, (Link(key, values, **placement),), float32)


def _norm(name: str, size: int, key: str) -> GGUFTensor:
    return _whole(name, (size,), key, ONE_PLUS, float32=True)


def _block(c: ModelConfig, arch: str, b: str, p: str, kind: str, moe: bool) -> list[GGUFTensor]:
    H = c.hidden_size
    tensors = [_norm(b + "attn_norm.weight", H, p + "input_layernorm.weight"),
               _norm(b + "post_attention_norm.weight", H, p + "post_attention_layernorm.weight")]
    tensors += _attention(c, b, p + "self_attn.") if kind == FULL_ATTENTION else _deltanet(c, arch, b, p + "linear_attn.")
    m = p + "mlp."
    if not moe:
        return tensors + _mlp(b, "", m, c.intermediate_size, H)
    return tensors + _moe(c, b, m)


def _attention(c: ModelConfig, b: str, a: str) -> list[GGUFTensor]:
    H, heads, kv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return [_whole(b + "attn_q.weight", (2 * heads * hd, H), a + "q_proj.weight"),  # q and its gate
            _whole(b + "attn_k.weight", (kv * hd, H), a + "k_proj.weight"),
            _whole(b + "attn_v.weight", (kv * hd, H), a + "v_proj.weight"),
            _whole(b + "attn_output.weight", (H, heads * hd), a + "o_proj.weight"),
            _norm(b + "attn_q_norm.weight", hd, a + "q_norm.weight"),
            _norm(b + "attn_k_norm.weight", hd, a + "k_norm.weight")]


def _moe(c: ModelConfig, b: str, m: str) -> list[GGUFTensor]:
    H, E, inner = c.hidden_size, c.num_experts, c.moe_intermediate_size
    tensors = [_whole(b + "ffn_gate_inp.weight", (E, H), m + "gate.weight", float32=True)]
    for proj, shape in (("gate", (inner, H)), ("up", (inner, H)), ("down", (H, inner))):
        links = tuple(Link(f"{m}experts.{e}.{proj}_proj.weight", expert=e) for e in range(E))
        tensors.append(GGUFTensor(f"{b}ffn_{proj}_exps.weight", (E, *shape), links))
    tensors += _mlp(b, "_shexp", m + "shared_expert.", c.shared_expert_intermediate_size, H)
    tensors.append(_whole(b + "ffn_gate_inp_shexp.weight", (1, H), m + "shared_expert_gate.weight", float32=True))
    return tensors


def _flash_next(c: ModelConfig, mtp: bool, ngram_rows: int) -> list[GGUFTensor]:
    H, f = c.hidden_size, c.flash
    if len(f.ple_layers) > 1:
        raise ValueError(f"llama.cpp's qwen4exp holds one n-gram table, and this model has PLE on {len(f.ple_layers)} layers")
    tensors = [_whole("token_embd.weight", (c.vocab_size, H), "embed_tokens.weight")]
    if not c.tie_word_embeddings:
        tensors.append(_whole("output.weight", (c.vocab_size, H), "lm_head.weight"))
    tensors += _hyper_connection(c, "output_hc_", "hyper_connection_mixer.", inject=False)
    for i, kind in enumerate(c.layer_types):
        tensors += _flash_block(c, f"blk.{i}.", f"layers.{i}.", kind, i in f.ple_layers)
    for i in f.ple_layers:
        tensors.append(_whole(NGRAM_TABLE, (ngram_rows, f.ple_embed_dim // f.ngram_heads),
                              f"layers.{i}.ple.ple_embedding.ngram_embedding.weight"))
    if mtp:
        n = f"blk.{c.num_hidden_layers}."
        tensors.append(GGUFTensor(n + "nextn.eh_proj.weight", (H, 2 * H), (  # eh_proj [e ; h_s] per stream s
            Link("mtp.fc_embedding.weight", cols=slice(0, H)), Link("mtp.fc_hidden.weight", cols=slice(H, 2 * H)))))
        tensors += [_norm(n + "nextn.enorm.weight", H, "mtp.pre_fc_norm_embedding.weight"),
                    _norm(n + "nextn.hnorm.weight", f.hc_count * H, "mtp.pre_fc_norm_hidden.weight")]
        tensors += _hyper_connection(c, n + "nextn.hc_head_", "mtp.hyper_connection_mixer.", inject=False)
        tensors += _flash_block(c, n, "mtp.layers.0.", FULL_ATTENTION, ple=False)
    return tensors


def _hyper_connection(c: ModelConfig, g: str, p: str, inject: bool = True) -> list[GGUFTensor]:
    f = c.flash
    wide = f.hc_count * c.hidden_size
    tensors = [_norm(g + "norm.weight", wide, p + "hc_norm.weight"),
               _whole(g + "down.weight", (f.hc_lowrank, wide), p + "input_mix_weight_down.weight"),
               _whole(g + "up.weight", (wide, f.hc_lowrank), p + "input_mix_weight_up.weight")]
    return tensors + ([_whole(g + "inject.weight", (f.hc_count, wide), p + "block_inject_weight.weight")] if inject else [])


def _flash_block(c: ModelConfig, b: str, p: str, kind: str, ple: bool) -> list[GGUFTensor]:
    H, f = c.hidden_size, c.flash
    tensors = _hyper_connection(c, b + "hc_attn_", p + "attn_hyper_connection.")
    tensors += _hyper_connection(c, b + "hc_ffn_", p + "mlp_hyper_connection.")
    if kind == FULL_ATTENTION:
        a, q_rows = p + "self_attn.", f.indexer_heads * f.indexer_head_dim
        tensors += _attention(c, b, a)
        tensors += [  # llama.cpp splits index_qk_proj into the queries and the key
            _whole(b + "indexer.q_proj.weight", (q_rows, H), a + "indexer.index_qk_proj.weight", part_of=slice(0, q_rows)),
            _whole(b + "indexer.k_proj.weight", (f.indexer_head_dim, H), a + "indexer.index_qk_proj.weight",
                   part_of=slice(q_rows, q_rows + f.indexer_head_dim)),
            _norm(b + "indexer.q_norm.weight", f.indexer_head_dim, a + "indexer.q_layernorm.weight"),
            _norm(b + "indexer.k_norm.weight", f.indexer_head_dim, a + "indexer.k_layernorm.weight")]
    else:
        tensors += _deltanet(c, "qwen4exp", b, p + "linear_attn.")
    tensors += _moe(c, b, p + "mlp.")
    if ple:
        wide, e = f.hc_count * H, p + "ple."
        tensors += [_whole(b + "ple_key.weight", (wide, f.ple_embed_dim), e + "key_proj.weight"),
                    _whole(b + "ple_value.weight", (H, f.ple_embed_dim), e + "value_proj.weight"),
                    *(_norm(f"{b}ple_{n}.weight", wide, f"{e}{n}.weight") for n in ("norm_key", "norm_query", "norm_conv")),
                    _whole(b + "ple_conv1d.weight", (wide, f.ple_conv_kernel), e + "conv1d.weight", SQUEEZED)]
    return tensors


def _mlp(b: str, suffix: str, m: str, inner: int, H: int) -> list[GGUFTensor]:
    return [_whole(f"{b}ffn_gate{suffix}.weight", (inner, H), m + "gate_proj.weight"),
            _whole(f"{b}ffn_up{suffix}.weight", (inner, H), m + "up_proj.weight"),
            _whole(f"{b}ffn_down{suffix}.weight", (H, inner), m + "down_proj.weight")]


def _deltanet(c: ModelConfig, arch: str, b: str, d: str) -> list[GGUFTensor]:
    H, hk, hv, dk, dv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
        c.linear_value_head_dim
    qk, channels = 2 * hk * dk, 2 * hk * dk + hv * dv
    if arch in TILED_V_HEADS and hv != hk:
        heads = grouped_to_stored_heads(hk, hv)  # model head i is the file's head heads[i]
        v_rows = head_rows(heads, dv)
        qkv_rows = np.concatenate([np.arange(qk), qk + v_rows])
        input_order = head_rows(stored_to_grouped_heads(heads), dv)
    else:
        heads = v_rows = qkv_rows = input_order = None
    tensors = [_whole(b + "attn_qkv.weight", (channels, H), d + "in_proj_qkv.weight", rows=qkv_rows),
               _whole(b + "attn_gate.weight", (hv * dv, H), d + "in_proj_z.weight", rows=v_rows)]
    if arch == "qwen3next":
        _, (b_rows, a_rows) = qwen3_next_rows(c)  # [b r | a r] per key head, as in HF's in_proj_ba
        tensors.append(GGUFTensor(b + "ssm_ba.weight", (2 * hv, H), (Link(d + "in_proj_b.weight", rows=b_rows),
                                                                     Link(d + "in_proj_a.weight", rows=a_rows))))
    else:
        tensors += [_whole(b + "ssm_beta.weight", (hv, H), d + "in_proj_b.weight", rows=heads),
                    _whole(b + "ssm_alpha.weight", (hv, H), d + "in_proj_a.weight", rows=heads)]
    kernel = c.linear_conv_kernel_dim
    return tensors + [
        _whole(b + "ssm_conv1d.weight", (channels, kernel), d + "conv1d.weight", SQUEEZED, True, rows=qkv_rows),
        _whole(b + "ssm_a", (hv,), d + "A_log", NEG_EXP, True, rows=heads),
        _whole(b + "ssm_dt.bias", (hv,), d + "dt_bias", float32=True, rows=heads),
        _whole(b + "ssm_norm.weight", (dv,), d + "norm.weight", float32=True),
        _whole(b + "ssm_out.weight", (H, hv * dv), d + "out_proj.weight", input_order=input_order),
    ]


def grouped_to_stored_heads(hk: int, hv: int) -> np.ndarray:
    """For each value head in grouped order (g * r + j), its index in tiled order (j * hk + g)."""
    r = hv // hk
    g, j = np.divmod(np.arange(hv), r)
    return j * hk + g


def stored_to_grouped_heads(grouped_to_stored: np.ndarray) -> np.ndarray:
    """The inverse permutation: for each stored head, its grouped index."""
    inverse = np.empty_like(grouped_to_stored)
    inverse[grouped_to_stored] = np.arange(len(grouped_to_stored))
    return inverse


def head_rows(heads: np.ndarray, size: int) -> np.ndarray:
    """Row indices of whole heads of `size` rows, in the order of `heads`."""
    return (heads[:, None] * size + np.arange(size)).ravel()


# --------------------------------------------------------------------------------------------
# Metadata

# config.json field -> `{arch}.` key, for the fields that are one key each (REFERENCE.md section 2)
CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rope_theta": "rope.freq_base",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "linear_num_key_heads": "ssm.group_count",
    "linear_num_value_heads": "ssm.time_step_rank",
    "linear_key_head_dim": "ssm.state_size",
    "linear_conv_kernel_dim": "ssm.conv_kernel",
    "intermediate_size": "feed_forward_length",
    "max_position_embeddings": "context_length",
    "mtp_num_hidden_layers": "nextn_predict_layers",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}
# What llama.cpp itself cannot load without; every other key has llama.cpp's default.
REQUIRED_KEYS = ("block_count", "embedding_length", "attention.head_count", "ssm.conv_kernel", "ssm.state_size",
                 "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")
REQUIRED_MOE_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length",
                     "expert_shared_feed_forward_length")
EOS_KEY = "tokenizer.ggml.eos_token_id"


# `{arch}.` keys that are no config.json field -> the field whose bounds they take
OTHER_KEYS = {"block_count": "num_hidden_layers", "ssm.inner_size": "linear_value_head_dim",
              "full_attention_interval": "full_attention_interval", "rope.dimension_count": "head_dim"}
# qwen4exp's keys (llama.cpp's qwen4exp converter) -> config.json field
FLASH_KEYS = {
    "hyper_connection.count": "hc_count",
    "hyper_connection.low_rank": "hc_lowrank",
    "attention.indexer.head_count": "indexer_n_heads",
    "attention.indexer.key_length": "indexer_head_dim",
    "attention.indexer.top_k": "indexer_budget",
    "attention.compress_ratios": "indexer_compress_ratio",  # per block, 0 for DeltaNet: the widest is QSA's
    "ple.ngram_size": "ngram_size",
    "ple.heads_per_ngram": "heads_per_ngram",
    "ple.conv_kernel": "ple_conv_kernel_size",
}
REQUIRED_FLASH_KEYS = ("hyper_connection.count", "hyper_connection.low_rank", "attention.indexer.head_count",
                       "attention.indexer.key_length", "attention.indexer.top_k", "attention.compress_ratios")
# the PLE layer's int64 hash constants, kept as uint64 arrays: key -> model tensor (of layers.N.ple.ple_embedding.)
NGRAM_CONSTANT_KEYS = {"ple.layer_multipliers": "layer_multipliers", "ple.head_vocab_sizes": "ngram_heads_vocab_sizes",
                       "ple.head_offsets": "ngram_heads_offsets"}
REMEDY = "download it again or convert it again"


def gguf_config(metadata: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]], source) -> ModelConfig:
    """The ModelConfig of a GGUF file from its keys (`general.architecture`, `{arch}.*`, the eos token)
    and its tensors' shapes in numpy order (the vocabulary, whether the head is tied). Every key is
    checked for type and bounds (config.py's INT_FIELDS, FLOAT_FIELDS) before any arithmetic on it."""
    arch = metadata.get("general.architecture")
    check_architecture(arch, source)
    fields = {name: field for field, name in CONFIG_KEYS.items()} | OTHER_KEYS | FLASH_KEYS

    def key(name: str):
        """The key's value, checked; a per-layer array gives its widest entry. None if absent."""
        value = metadata.get(f"{arch}.{name}")
        if value is None:
            return None
        if isinstance(value, list):
            numeric = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if not value or len(numeric) < len(value):
                raise CheckpointError(source, f"metadata key {arch}.{name} is {shown(value)}, not a number or a "
                                              f"per-layer array of numbers; the file is corrupt, {REMEDY}")
            value = max(numeric)
        return checked(value, fields[name], source, f"metadata key {arch}.{name}", REMEDY)

    def bad(names: str, problem: str) -> CheckpointError:
        return CheckpointError(source, f"metadata {names} {problem}; the file is corrupt, {REMEDY}")

    required = REQUIRED_KEYS + (REQUIRED_MOE_KEYS if arch in MOE_ARCHITECTURES else ())
    required += REQUIRED_FLASH_KEYS if arch == "qwen4exp" else ()
    missing = [f"{arch}.{name}" for name in required if metadata.get(f"{arch}.{name}") is None]
    missing += ["tensor token_embd.weight"] if "token_embd.weight" not in shapes else []
    if missing:
        raise CheckpointError(source, f"metadata lacks {', '.join(missing)}; the file is not a complete {arch} GGUF")
    raw = {field: value for field, name in CONFIG_KEYS.items() if (value := key(name)) is not None}
    raw["model_type"] = ARCHITECTURES[arch]
    blocks, mtp = key("block_count"), raw.get("mtp_num_hidden_layers", 0)  # block_count counts the MTP blocks
    if blocks <= mtp:
        raise bad(f"key {arch}.block_count", f"is {blocks}, which leaves no layers besides its {mtp} MTP block(s)")
    raw["num_hidden_layers"] = layers = blocks - mtp
    raw["layer_types"] = _layer_types(metadata.get(f"{arch}.attention.recurrent_layers"),
                                      key("full_attention_interval") or 4, layers)
    embedding = shapes["token_embd.weight"]
    if len(embedding) != 2 or not 1 <= embedding[0] <= MAX_SIZE:
        raise CheckpointError(source, f"tensor token_embd.weight has shape {shown(list(embedding))}, not [vocabulary, "
                                      f"width] with a vocabulary from 1 to {MAX_SIZE}; the file is corrupt, {REMEDY}")
    raw["vocab_size"] = embedding[0]
    raw["tie_word_embeddings"] = "output.weight" not in shapes
    inner, value_heads = key("ssm.inner_size"), raw["linear_num_value_heads"]
    if inner % value_heads:
        raise bad(f"keys {arch}.ssm.inner_size and {arch}.ssm.time_step_rank",
                  f"are {inner} and {value_heads}: the first is no multiple of the second")
    raw["linear_value_head_dim"] = inner // value_heads
    if "head_dim" not in raw and raw["hidden_size"] % raw["num_attention_heads"]:
        raise bad(f"keys {arch}.embedding_length and {arch}.attention.head_count",
                  f"are {raw['hidden_size']} and {raw['num_attention_heads']}, and there is no "
                  f"{arch}.attention.key_length: the first is no multiple of the second")
    head_dim = raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    rotary = key("rope.dimension_count") or head_dim  # llama.cpp: all of it
    if rotary > head_dim:
        raise bad(f"key {arch}.rope.dimension_count", f"is {rotary}, more than the head dimension {head_dim}")
    raw["partial_rotary_factor"] = rotary / head_dim
    if EOS_KEY in metadata:
        raw["eos_token_id"] = metadata[EOS_KEY]
    if arch == "qwen4exp":
        raw |= _flash_next_fields(metadata, key, layers, source)
    return ModelConfig.from_dict(raw, str(source))


def _flash_next_fields(metadata: Mapping[str, object], key, layers: int, source) -> dict:
    """config.json's Flash-Next fields from qwen4exp keys; llama.cpp runs its DeltaNet gate as a sigmoid."""
    raw = {field: value for name, field in FLASH_KEYS.items() if (value := key(name)) is not None}
    raw |= {"output_gate_type": "sigmoid", "split_ngram_parts": 1}
    ple = metadata.get("qwen4exp.ple.layers")
    if ple is None:
        return raw
    if not isinstance(ple, list) or not all(type(i) is int and 0 <= i < layers for i in ple):
        raise CheckpointError(source, f"metadata key qwen4exp.ple.layers is {shown(ple)}, not a list of layer numbers "
                                      f"below {layers}; the file is corrupt, {REMEDY}")
    row = checked(metadata.get("qwen4exp.embedding_length_per_layer_input"), "ple_embed_dim", source,
                  "metadata key qwen4exp.embedding_length_per_layer_input", REMEDY)
    eos = metadata.get("qwen4exp.ple.eos_token_id")
    if type(eos) is not int or eos < 0:
        raise CheckpointError(source, f"metadata key qwen4exp.ple.eos_token_id is {shown(eos)}, not a token id; "
                                      f"the file is corrupt, {REMEDY}")
    tokenizer_eos = metadata.get(EOS_KEY)
    raw["eos_token_id"] = [eos] + ([tokenizer_eos] if isinstance(tokenizer_eos, int) and tokenizer_eos != eos else [])
    raw["ple_layer_ids"] = [i + 1 for i in ple]
    raw["ple_embed_dim"] = row * (raw.get("ngram_size", 3) - 1) * raw.get("heads_per_ngram", 8)
    return raw


def ngram_constants(metadata: Mapping[str, object], c: ModelConfig, source) -> dict[str, np.ndarray]:
    """The PLE layer's hash constants (int64) by model key, from their uint64 array keys, checked."""
    if not c.flash or not c.flash.ple_layers:
        return {}
    lengths = {"ple.layer_multipliers": c.flash.ngram_size}
    p = f"layers.{c.flash.ple_layers[0]}.ple.ple_embedding."
    out = {}
    for name, tensor in NGRAM_CONSTANT_KEYS.items():
        value, length = metadata.get(f"qwen4exp.{name}"), lengths.get(name, c.flash.ngram_heads)
        if not isinstance(value, list) or len(value) != length or \
                not all(type(v) is int and 0 <= v < 1 << 63 for v in value):
            raise CheckpointError(source, f"metadata key qwen4exp.{name} is {shown(value)}, not {length} integers "
                                          f"from 0 to 2^63; the file is corrupt, {REMEDY}")
        out[p + tensor] = np.array(value, np.int64)
    return out


def check_architecture(arch, source) -> None:
    if not isinstance(arch, str) or arch not in ARCHITECTURES:  # a list is no dict key
        raise CheckpointError(source, f"GGUF architecture {shown(arch)} (key general.architecture) is not supported; "
                                      f"duet reads {', '.join(ARCHITECTURES)}")


def _layer_types(recurrent: list | None, interval: int, layers: int) -> list[str]:
    """From the per-block recurrent flags (MTP blocks included, so cut to the layers), else every
    interval-th layer full attention."""
    if isinstance(recurrent, list) and len(recurrent) >= layers:
        return [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers]]
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
