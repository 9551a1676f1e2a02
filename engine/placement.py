"""Placement: the bytes one cycle reads, what a card must hold, and the longest context that fits.

Everything is computed from tensor headers and the config (engine.checkpoint.headers): no weight is
read and nothing is allocated. Two products:

- the bill of bytes of one cycle (REFERENCE.md sections 5 and 6): the decoder weights by kind, the
  lm_head, the DeltaNet and conv state read and written, the KV cache read at a context, and, with
  `depth` drafts, the MTP head run `depth` times plus what the verify records for a rollback. It is the
  G of the ceiling tok/s <= eta * B / G * tau and the denominator of every GPU benchmark;
- the memory plan for a card: weights, KV cache at a context for a KV type, DeltaNet and conv state
  with what a rollback replays, workspace, with the bf16 tables on the card or in host memory, and
  the longest context that fits for each KV type.

Flash-Next (qwen4_exp): its hyper-connections and PLE projections are decoder weights; its n-gram
tables are host tables (never on the card: a pass gathers ngram_heads rows a token from each); its
QSA layers read the indexer's pooled block keys over the whole context but the KV rows of the
selected blocks and the tail only; its PLE conv history is state beside DeltaNet's conv.

Quantized tensors count as stored (packed 4-bit words plus their scales and zeros). With `w4`, the
float linears are counted as the engine's W4 repack would hold them: 4-bit levels plus a bf16 scale
per W4_GROUP inputs, except DeltaNet's small per-head gate inputs (in_proj_a/b), routers, norms and
conv, which stay 16-bit. A checkpoint with quantized decoder weights is planned with `w4` (its MTP
head and lm_head are repacked by the engine); a float checkpoint is planned as stored, on the bf16
route, and what its W4 repack would need is offered as a way to fit.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass

from duet.engine.backend import MAX_ROWS
from duet.engine.cache import Q4_GROUP, RECENT_ROWS, SINK_ROWS
from duet.engine.checkpoint.headers import CheckpointHeaders
from duet.engine.checkpoint.safetensors import TensorInfo
from duet.engine.choices import KVCache
from duet.engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from duet.engine.errors import CheckpointError
from duet.engine.heads import RESCORE_CANDIDATES, shortlist_rows

GB, GiB, MiB = 10**9, 1 << 30, 1 << 20

# Conventions of this engine (choices, not facts of a checkpoint).
W4_GROUP = 128  # W4 layout: 4-bit levels, one bf16 scale per 128 inputs (DESIGN.md, Routes)
KV_Q8_GROUP = 32  # q8 KV: int8 values with an fp16 scale per 32 (q4: engine.cache.Q4_GROUP, the same)
EXACT_ROW_BYTES = 2  # quantized KV keeps its sink and recent rows exact, 16-bit
STATE_BYTES = 4  # DeltaNet recurrent state and conv history are fp32
PREFILL_CHUNK = 512  # prompt tokens a prefill step takes; the activation workspace scales with it
RUNTIME_RESERVE = 512 * MiB  # CUDA context, cuBLAS/NVRTC modules and allocator slack, never ours to use
DEFAULT_ETA = 0.84  # share of peak bandwidth reached: the seed's 57.8 tok/s x 13.55 GB over 936 GB/s
DEFAULT_DEPTH = 3  # MTP drafts a cycle when the checkpoint has an MTP head (the seed's "three times")
KV_TYPES = tuple(KVCache)  # bf16, q8, q4: the order plans try them in

INDEX_KEY_BYTES = 2  # QSA indexer keys, raw and pooled, are kept 16-bit like the KV rows they pick

# Kinds of tensor. The first eight make up the decoder weights.
ATTENTION, DELTANET, MLP, EXPERTS, SHARED, NORMS = (
    "attention", "DeltaNet", "MLP", "routed experts", "shared experts and routers", "norms and conv")
HYPER, PLE = "hyper-connections", "PLE projections"  # Flash-Next
DECODER_KINDS = (ATTENTION, DELTANET, MLP, EXPERTS, SHARED, NORMS, HYPER, PLE)
EMBEDDING, HEAD, MTP, VISION, METADATA, OTHER = "embedding", "lm_head", "MTP head", "vision tower", "metadata", "other"
NGRAM = "n-gram tables"  # Flash-Next's PLE tables: host tables
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
SMALL_PARAMS = {"conv1d", "A_log", "dt_bias", "ssm_conv1d", "ssm_a", "ssm_dt"}
KEEP_16BIT = ("in_proj_a.", "in_proj_b.", "in_proj_ba.", "ssm_alpha.", "ssm_beta.", "ssm_ba.")  # [Hv, H] gate inputs
ROUTERS = (".gate.", "shared_expert_gate.", "ffn_gate_inp")
NGRAM_CONSTANTS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Card:
    name: str
    vram: int  # bytes
    bandwidth: float  # bytes per second


RTX_3090 = Card("RTX 3090", 24 * GiB, 936e9)


def detect_card() -> Card | None:
    """The first CUDA device, asked through CuPy; None without CuPy (which is then never imported) or a device."""
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        import cupy

        runtime = cupy.cuda.runtime
        if runtime.getDeviceCount() < 1:
            return None
        name = runtime.getDeviceProperties(0)["name"].decode()
        free, total = runtime.memGetInfo()
        # Memory clock (attribute 36, kHz) x 2 transfers a clock x bus width (attribute 37, bits) / 8.
        bandwidth = 2 * runtime.deviceGetAttribute(36, 0) * 1e3 * runtime.deviceGetAttribute(37, 0) / 8
        return Card(name, total, bandwidth or RTX_3090.bandwidth)
    except (ImportError, OSError, RuntimeError):
        return None


# --- what each tensor is, and what the engine keeps of it ---------------------------------------------

def tensor_kind(name: str, config: ModelConfig) -> str:
    """The kind of a checkpoint tensor, HF (`model.language_model.layers.3.mlp.up_proj.weight`) or GGUF
    (`blk.3.ffn_up.weight`) name."""
    if name.endswith(".weight_shape") or name.endswith(NGRAM_CONSTANTS):
        return METADATA  # the unpacked shape compressed-tensors keeps; PLE hash constants (read once, at load)
    if ".ngram_embedding." in name or name.startswith("per_layer_token_embd"):
        return NGRAM
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")):
        return VISION
    layer = LAYER.search(name)
    if name.startswith("mtp.") or ".nextn." in name or (layer and int(layer[1]) >= config.num_hidden_layers):
        return MTP  # GGUF stores the MTP layer as block num_hidden_layers
    if layer:
        return _layer_kind(layer[2], config.layer_types[int(layer[1])])
    if "embed_tokens" in name or name.startswith("token_embd"):
        return EMBEDDING
    if name.startswith("lm_head.") or name.startswith("output."):
        return HEAD
    if name.startswith(("hyper_connection_mixer.", "model.hyper_connection_mixer.", "model.language_model.hyper_connection_mixer.",
                        "output_hc_")):
        return HYPER  # Flash-Next's head mixer, in place of the final norm
    if name.endswith("norm.weight"):
        return NORMS  # the final norm
    return OTHER


def _layer_kind(rest: str, layer_type: str) -> str:
    parts = rest.split(".")
    if parts[0].endswith("hyper_connection") or parts[0].startswith("hc_"):
        return HYPER
    if parts[0] == "ple" or parts[0].startswith("ple_"):
        return PLE
    if any(p.endswith("norm") or p in SMALL_PARAMS for p in parts):
        return NORMS
    if "experts" in parts or any(p.endswith("_exps") for p in parts):
        return EXPERTS
    if any(p in ("gate", "shared_expert", "shared_expert_gate") or p.startswith("ffn_gate_inp") or p.endswith("_shexp")
           for p in parts):
        return SHARED
    if parts[0] == "mlp" or parts[0].startswith("ffn_"):
        return MLP
    return ATTENTION if layer_type == FULL_ATTENTION else DELTANET


def w4_candidate(t: TensorInfo, kind: str) -> bool:
    """A float linear that the engine's W4 route holds as 4-bit levels plus group scales."""
    return (t.dtype in FLOAT_DTYPES and len(t.shape) >= 2 and t.shape[-1] % W4_GROUP == 0
            and kind in (ATTENTION, DELTANET, MLP, EXPERTS, SHARED, HEAD, MTP)
            and not any(k in t.name for k in KEEP_16BIT + ROUTERS))


def w4_bytes(shape: tuple[int, ...]) -> int:
    """[..., N, K] at 4 bits plus a bf16 scale per W4_GROUP of K."""
    rows, k = math.prod(shape[:-1]), shape[-1]
    return rows * (k // 2 + k // W4_GROUP * 2)


def held_bytes(t: TensorInfo, kind: str, w4: bool) -> int:
    """Bytes the engine keeps of a tensor: as stored, or its W4 repack."""
    if kind == METADATA:
        return 0
    return w4_bytes(t.shape) if w4 and w4_candidate(t, kind) else t.nbytes


def is_quantized(headers: CheckpointHeaders) -> bool:
    """True when the decoder's weights are stored quantized (packed int4 words, GGUF blocks)."""
    return any(t.dtype not in FLOAT_DTYPES and tensor_kind(t.name, headers.config) in DECODER_KINDS
               for t in headers.tensors.values())


def describe_format(headers: CheckpointHeaders) -> str:
    names = headers.tensors
    if headers.format == "gguf":
        by_type: dict[str, int] = {}
        for t in names.values():
            by_type[t.dtype] = by_type.get(t.dtype, 0) + t.nbytes
        return "GGUF " + ", ".join(sorted(by_type, key=by_type.get, reverse=True)[:3])
    packed = next((t for n, t in names.items() if n.endswith(".weight_packed")), None)
    scale = packed and names.get(packed.name.removesuffix("packed") + "scale")
    if scale is not None:
        group = packed.shape[-1] * 8 // scale.shape[-1]  # 8 nibbles a packed int32
        return f"compressed-tensors int4, {scale.dtype.lower()} scale per {group}"
    if any(n.endswith(".qweight") for n in names):
        return "GPTQ int4"
    floats = [t.dtype for t in names.values() if t.dtype in FLOAT_DTYPES]
    return max(set(floats), key=floats.count).lower() if floats else "unknown"


@dataclass(frozen=True)
class Weights:
    """What the engine keeps of each part of a checkpoint, in bytes."""

    w4: bool
    decoder: dict[str, int]  # DECODER_KINDS -> bytes, all routed experts included
    experts_per_layer: int
    moe_layers: int
    int4_head: bool  # the head a pass reads is an int4 copy of a bf16 head, rescored with bf16 rows
    head_read: int  # what a pass reads of the head
    head_held: int  # what the head adds to the card beyond the embedding (0 for a tied head read as is)
    rescoring_head: int  # a separate bf16 head kept only to rescore candidates (untied, int4_head)
    embedding: int
    host_tables: int  # what --host-tables moves off the card: the embedding (one row a token) and the rescoring head
    mtp: int  # the MTP head without its routed experts
    mtp_experts: int
    vision: int
    unread: int  # metadata and tensors duet does not use
    vocab: int
    ngram_tables: int = 0  # Flash-Next: every PLE layer's n-gram table, in host memory
    ngram_token: int = 0  # what one token gathers from them: ngram_heads rows of each

    @property
    def expert(self) -> int:
        """One routed expert of one layer, all its projections, averaged over the layers."""
        return self.decoder[EXPERTS] // max(1, self.moe_layers * self.experts_per_layer)

    @property
    def shortlist(self) -> int:
        """The draft head: shortlist_rows of the head as a pass reads it."""
        return self.head_read * shortlist_rows(self.vocab) // self.vocab


def weights_of(headers: CheckpointHeaders, w4: bool) -> Weights:
    config, parts = headers.config, {k: 0 for k in (*DECODER_KINDS, EMBEDDING, MTP, VISION, METADATA, OTHER)}
    mtp_experts, head, ngram_row = 0, None, {}
    for t in headers.tensors.values():
        kind = tensor_kind(t.name, config)
        if kind == NGRAM:  # a table (or a shard of one): bytes of one row, by its layer
            parts[NGRAM] = parts.get(NGRAM, 0) + t.nbytes
            ngram_row[t.name.partition(".ngram_embedding.")[0]] = t.nbytes // max(1, t.shape[0])
        elif kind == HEAD:
            head = t
        elif kind == MTP and (".experts." in t.name or "_exps" in t.name):
            mtp_experts += held_bytes(t, kind, w4)
        else:
            parts[kind] += held_bytes(t, kind, w4)
    tied = head is None
    head = head or _embedding(headers)
    int4_head = w4 and w4_candidate(head, HEAD)
    head_read = w4_bytes(head.shape) if int4_head else head.nbytes
    rescoring = head.nbytes if int4_head and not tied else 0
    embedding_is_read_head = tied and not int4_head
    return Weights(
        w4=w4,
        decoder={k: parts[k] for k in DECODER_KINDS},
        experts_per_layer=config.num_experts,
        moe_layers=sum(config.moe_layers),
        int4_head=int4_head,
        head_read=head_read,
        head_held=0 if embedding_is_read_head else head_read,
        rescoring_head=rescoring,
        embedding=parts[EMBEDDING],
        host_tables=(0 if embedding_is_read_head else parts[EMBEDDING]) + rescoring,
        mtp=parts[MTP],
        mtp_experts=mtp_experts,
        vision=parts[VISION],
        unread=parts[METADATA] + parts[OTHER],
        vocab=config.vocab_size,
        ngram_tables=parts.get(NGRAM, 0),
        ngram_token=config.flash.ngram_heads * sum(ngram_row.values()) if config.flash else 0,
    )


def _embedding(headers: CheckpointHeaders) -> TensorInfo:
    for t in headers.tensors.values():
        if tensor_kind(t.name, headers.config) == EMBEDDING:
            return t
    raise CheckpointError(headers.source, "has no embedding tensor (embed_tokens or token_embd); the checkpoint is incomplete")


# --- state and KV cache ------------------------------------------------------------------------------

def deltanet_state_bytes(c: ModelConfig) -> int:
    """One copy of every DeltaNet layer's recurrent state S [Hv, dk, dv] in fp32."""
    layers = c.layer_types.count(LINEAR_ATTENTION)
    return layers * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * STATE_BYTES


def rollback_bytes(c: ModelConfig, rows: int) -> int:
    """What a verify of `rows` rows records on the card for a rollback to any row (deltanet.cu): every
    DeltaNet layer's state before it and, a row and value head, its k | v | beta | e^g. (The conv history
    is a ring of positions: no copy.) A rollback replays the kept rows from them."""
    layers = c.layer_types.count(LINEAR_ATTENTION)
    row = layers * c.linear_num_value_heads * (c.linear_key_head_dim + c.linear_value_head_dim + 2) * STATE_BYTES
    return deltanet_state_bytes(c) + rows * row


def conv_state_bytes(c: ModelConfig) -> int:
    """One copy of every DeltaNet layer's conv history: the last kernel - 1 inputs of the qkv channels;
    and Flash-Next's PLE conv history: (kernel - 1) x dilation rows of the hc streams."""
    layers = c.layer_types.count(LINEAR_ATTENTION)
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    ple = 0
    if c.flash:
        f = c.flash
        ple = len(f.ple_layers) * (f.ple_conv_kernel - 1) * f.ngram_size * f.hc_count * c.hidden_size
    return (layers * (c.linear_conv_kernel_dim - 1) * channels + ple) * STATE_BYTES


def kv_row_bytes(c: ModelConfig, kv: str) -> float:
    """Keys and values of one token in one attention layer. q8 and q4 carry an fp16 scale per group."""
    values = 2 * c.num_key_value_heads * c.head_dim
    per_value = {"bf16": 2, "q8": 1 + 2 / KV_Q8_GROUP, "q4": 0.5 + 2 / Q4_GROUP}[kv]
    return values * per_value


def kv_exact_rows(kv: str) -> int:
    """Rows a quantized cache also keeps exact: the sink, and a ring of the recent window plus one
    verify pass (engine.cache.Q4KVCache's layout)."""
    return 0 if kv == "bf16" else SINK_ROWS + RECENT_ROWS + MAX_ROWS


def kv_token_bytes(c: ModelConfig, kv: str) -> float:
    """What one token adds to one attention layer's cache: its keys and values and, with QSA, its
    indexer key and its share of a pooled block key."""
    index = (1 + 1 / c.flash.indexer_compress_ratio) * c.flash.indexer_head_dim * INDEX_KEY_BYTES if c.flash else 0
    return kv_row_bytes(c, kv) + index


def kv_cache_bytes(c: ModelConfig, kv: str, context: int, layers: int) -> int:
    """The cache `layers` attention layers hold for `context` tokens (quantized rows for all of them)."""
    exact = kv_exact_rows(kv) * 2 * c.num_key_value_heads * c.head_dim * EXACT_ROW_BYTES
    return math.ceil(layers * (context * kv_token_bytes(c, kv) + exact))


def kv_read_bytes(c: ModelConfig, kv: str, context: int, layers: int, rows: int = 1) -> int:
    """What one pass of `rows` rows through `layers` attention layers reads of a `context`-token cache:
    the sink and recent rows exact, the rest quantized. QSA reads every pooled block key but of the KV
    only each row's selection, its top blocks and the tail: at most indexer_budget + ratio - 1 rows a row."""
    read, index = context, 0
    if c.flash:
        f = c.flash
        read = min(context, rows * (f.indexer_budget + f.indexer_compress_ratio - 1))
        index = (context // f.indexer_compress_ratio + f.indexer_compress_ratio) * f.indexer_head_dim * INDEX_KEY_BYTES
    exact_rows = 0 if kv == "bf16" else min(read, SINK_ROWS + RECENT_ROWS)
    exact = exact_rows * 2 * c.num_key_value_heads * c.head_dim * EXACT_ROW_BYTES
    return math.ceil(layers * ((read - exact_rows) * kv_row_bytes(c, kv) + exact + index))


def attention_layers(c: ModelConfig) -> int:
    return c.layer_types.count(FULL_ATTENTION)


def drafting_layers(weights: Weights, c: ModelConfig, depth: int) -> int:
    """MTP layers that draft (and keep a KV cache of their own)."""
    return c.mtp_num_hidden_layers if depth and (weights.mtp or weights.mtp_experts) else 0


def workspace_bytes(c: ModelConfig, rows: int) -> int:
    """fp32 activations of one prefill chunk (the widest projection output and four hidden-size buffers)
    plus fp32 logits of the verify rows. Attention runs in tiles over the cache, so nothing here grows
    with the context."""
    widest = max(2 * c.intermediate_size,
                 2 * c.num_experts_per_tok * c.moe_intermediate_size + 2 * c.shared_expert_intermediate_size,
                 2 * c.linear_num_key_heads * c.linear_key_head_dim + 2 * c.linear_num_value_heads * c.linear_value_head_dim,
                 2 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim)
    residual = c.hidden_size * (c.flash.hc_count if c.flash else 1)  # Flash-Next's residual is hc streams wide
    return PREFILL_CHUNK * (widest + 4 * residual) * 4 + rows * c.vocab_size * 4


# --- the bill of bytes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bill:
    """Bytes one cycle reads from the card: `depth` MTP drafts, then one verify pass of 1 + depth rows."""

    context: int
    kv: str
    depth: int
    decoder: dict[str, int]  # by kind; routed experts: only those the rows route to
    lm_head: int
    lookups: int  # the rows' embedding rows, the bf16 rows of their rescored candidates and their n-gram rows
    deltanet_state: int  # read once and written once
    conv_state: int  # read once and written once
    kv_cache: int  # the attention layers' KV at `context`
    drafting: int  # depth x (MTP layer + shortlist head)
    drafting_kv: int  # depth x the MTP layer's KV at `context`
    rollback: int  # what a verify of more than one row records for a rollback (rollback_bytes)
    not_read: dict[str, int]  # what a cycle leaves untouched

    @property
    def decoder_weights(self) -> int:
        return sum(self.decoder.values())

    @property
    def verify_pass(self) -> int:
        """The pass without drafting: weights, head, state, and the KV cache."""
        return self.decoder_weights + self.lm_head + self.lookups + self.deltanet_state + self.conv_state + self.kv_cache

    @property
    def total(self) -> int:
        return self.verify_pass + self.drafting + self.drafting_kv + self.rollback


def routed_share(c: ModelConfig, rows: int) -> float:
    """Share of a layer's routed experts that `rows` tokens read when no two rows share one (an upper bound)."""
    return min(1.0, rows * c.num_experts_per_tok / c.num_experts) if c.num_experts else 0.0


def bill_of_bytes(weights: Weights, c: ModelConfig, context: int = 0, kv: str = "bf16", depth: int = 0) -> Bill:
    rows = 1 + depth
    decoder = dict(weights.decoder)
    decoder[EXPERTS] = round(weights.decoder[EXPERTS] * routed_share(c, rows))
    drafters = drafting_layers(weights, c, depth)
    # Each draft runs the MTP layer on one row (its routed experts: top-k of E) and ranks the shortlist.
    draft_step = weights.mtp + round(weights.mtp_experts * routed_share(c, 1)) + weights.shortlist if drafters else 0
    embed_row = weights.embedding // weights.vocab
    rescored = rows * RESCORE_CANDIDATES * c.hidden_size * 2 if weights.int4_head else 0
    state, conv = deltanet_state_bytes(c), conv_state_bytes(c)
    return Bill(
        context=context, kv=kv, depth=depth, decoder=decoder,
        lm_head=weights.head_read,
        lookups=(rows + (depth if drafters else 0)) * embed_row + rescored + rows * weights.ngram_token,
        deltanet_state=2 * state,
        conv_state=2 * conv,
        kv_cache=kv_read_bytes(c, kv, context, attention_layers(c), rows),
        drafting=depth * draft_step,
        drafting_kv=depth * kv_read_bytes(c, kv, context, drafters),
        rollback=rollback_bytes(c, rows) if depth else 0,
        not_read=_not_read(weights, c, rows, drafters),
    )


def _not_read(weights: Weights, c: ModelConfig, rows: int, drafters: int) -> dict[str, int]:
    parts = {
        "embedding (a row a token is read)": weights.embedding,
        "bf16 rescoring head (the candidates' rows are read)": weights.rescoring_head,
        "routed experts no row routes to": round(weights.decoder[EXPERTS] * (1 - routed_share(c, rows))),
        "n-gram tables (a few rows a token, from host memory)": weights.ngram_tables,
        "MTP head (no drafts)": 0 if drafters else weights.mtp + weights.mtp_experts,
        "vision tower": weights.vision,
        "metadata and tensors duet does not use": weights.unread,
    }
    return {k: v for k, v in parts.items() if v}


def ceiling_tok_s(bill: Bill, card: Card, eta: float = DEFAULT_ETA, tau: float = 1.0) -> float:
    """tok/s <= eta * B / G * tau: G bytes a cycle, B the card's bandwidth, tau tokens committed a cycle."""
    return eta * card.bandwidth / bill.total * tau


# --- the memory plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    card: Card
    context: int
    kv: str
    host_tables: bool
    depth: int
    on_card: dict[str, int]  # what the card holds, by part (routed experts: as many as fit)
    on_host: dict[str, int]  # bf16 tables under --host-tables; routed experts that do not fit the card
    experts_on_card: float | None  # MoE: share of the routed experts on the card

    @property
    def used(self) -> int:
        return sum(self.on_card.values())

    @property
    def fits(self) -> bool:
        return self.used <= self.card.vram


def memory_plan(weights: Weights, c: ModelConfig, card: Card, context: int, kv: str = "bf16",
                host_tables: bool = False, depth: int = 0) -> Plan:
    fixed = _fixed_parts(weights, c, kv, host_tables, depth)
    fixed[f"KV cache, {kv}"] = kv_cache_bytes(c, kv, context, attention_layers(c) + drafting_layers(weights, c, depth))
    on_host = _host_tables(weights) if host_tables else {}
    if weights.ngram_tables:  # always a host table: a token reads a few rows of tens of GB
        on_host[NGRAM] = weights.ngram_tables
    experts = weights.decoder[EXPERTS]
    share = None
    if experts:
        room = card.vram - sum(fixed.values())
        on_card = experts if room >= experts else max(0, room) // weights.expert * weights.expert
        share = on_card / experts
        fixed["routed experts"] = on_card
        if on_card < experts:
            on_host["routed experts off the card"] = experts - on_card
    return Plan(card, context, kv, host_tables, depth, fixed, on_host, share)


def _fixed_parts(weights: Weights, c: ModelConfig, kv: str, host_tables: bool, depth: int) -> dict[str, int]:
    """Everything on the card except the KV cache and the routed experts."""
    drafters = drafting_layers(weights, c, depth)
    copies = 1 + (kv == KVCache.BF16)  # the state, and a chat's checkpoint where the reply's turn starts (engine.generate.PromptCache)
    parts = {
        "decoder weights": sum(v for k, v in weights.decoder.items() if k != EXPERTS),
        "lm_head": weights.head_held,
        "embedding": weights.embedding - (_host_tables(weights).get("embedding", 0) if host_tables else 0),
        "bf16 rescoring head": 0 if host_tables else weights.rescoring_head,
        "MTP head and draft shortlist": weights.mtp + weights.mtp_experts + weights.shortlist if drafters else 0,
        "DeltaNet and conv state": copies * (deltanet_state_bytes(c) + conv_state_bytes(c)) + rollback_bytes(c, MAX_ROWS),
        "workspace": workspace_bytes(c, 1 + depth),
        "runtime reserve": RUNTIME_RESERVE,
    }
    return {k: v for k, v in parts.items() if v}


def _host_tables(weights: Weights) -> dict[str, int]:
    parts = {"embedding": weights.host_tables - weights.rescoring_head, "bf16 rescoring head": weights.rescoring_head}
    return {k: v for k, v in parts.items() if v}


def max_context(weights: Weights, c: ModelConfig, card: Card, kv: str, host_tables: bool, depth: int) -> int:
    """The longest context whose cache fits beside everything else (routed experts offloaded as needed),
    up to the model's max_position_embeddings; 0 when nothing fits."""
    fixed = sum(_fixed_parts(weights, c, kv, host_tables, depth).values())
    layers = attention_layers(c) + drafting_layers(weights, c, depth)
    room = card.vram - fixed - kv_cache_bytes(c, kv, 0, layers)
    if room < 0:
        return 0
    if not layers:  # no attention layer: nothing grows with the context
        return c.max_position_embeddings
    return min(c.max_position_embeddings, int(room // (layers * kv_token_bytes(c, kv))))


# --- everything `duet models info` shows ------------------------------------------------------------

MIN_USEFUL_CONTEXT = 4096  # a shorter context is not offered as a way to fit


@dataclass(frozen=True)
class Settings:
    context: int
    kv: str = "bf16"
    host_tables: bool = False
    depth: int = 0
    w4: bool = False


@dataclass(frozen=True)
class Alternative:
    """Settings that fit where the asked ones do not, and the card memory they use."""

    settings: Settings
    used: int


@dataclass(frozen=True)
class Assessment:
    settings: Settings
    weights: Weights
    bill: Bill
    plan: Plan
    max_context: dict[str, dict[bool, int]]  # kv type -> host tables off/on -> tokens
    ceiling_tok_s: float
    eta: float
    tau: float
    w4_repack: Weights | None  # a float checkpoint: what the engine's W4 route would hold
    alternatives: list[Alternative]


def assess(headers: CheckpointHeaders, card: Card, context: int | None = None, kv: str = "bf16",
           host_tables: bool = False, depth: int | None = None, eta: float = DEFAULT_ETA, tau: float = 1.0) -> Assessment:
    """The bill, the plan and the context budget of a checkpoint on a card. Defaults: the model's
    longest context, and DEFAULT_DEPTH drafts when there is an MTP head."""
    c = headers.config
    quantized = is_quantized(headers)
    weights = weights_of(headers, w4=quantized)
    has_mtp = bool(weights.mtp or weights.mtp_experts) and c.mtp_num_hidden_layers > 0
    settings = Settings(c.max_position_embeddings if context is None else context, kv, host_tables,
                        (DEFAULT_DEPTH if has_mtp else 0) if depth is None else depth, quantized)
    bill = bill_of_bytes(weights, c, settings.context, kv, settings.depth)
    plan = memory_plan(weights, c, card, settings.context, kv, host_tables, settings.depth)
    w4_repack = None if quantized else weights_of(headers, w4=True)
    return Assessment(
        settings=settings, weights=weights, bill=bill, plan=plan,
        max_context={k: {h: max_context(weights, c, card, k, h, settings.depth) for h in (False, True)} for k in KV_TYPES},
        ceiling_tok_s=ceiling_tok_s(bill, card, eta, tau), eta=eta, tau=tau, w4_repack=w4_repack,
        alternatives=[] if plan.fits else alternatives(weights, w4_repack, c, card, settings),
    )


def alternatives(weights: Weights, w4_repack: Weights | None, c: ModelConfig, card: Card, asked: Settings) -> list[Alternative]:
    """One change at a time that fits (a shorter context, a smaller KV type, host tables, the W4
    repack), then q4 KV with host tables when no single change does."""
    def plan_of(s: Settings) -> Plan:
        return memory_plan(w4_repack if s.w4 and w4_repack else weights, c, card, s.context, s.kv, s.host_tables, s.depth)

    tries = [Settings(asked.context, kv, asked.host_tables, asked.depth, asked.w4) for kv in KV_TYPES[KV_TYPES.index(asked.kv) + 1:]]
    if not asked.host_tables and weights.host_tables:
        tries.append(Settings(asked.context, asked.kv, True, asked.depth, asked.w4))
    if w4_repack:
        tries.append(Settings(asked.context, asked.kv, asked.host_tables, asked.depth, True))
    found = [Alternative(s, plan_of(s).used) for s in tries if plan_of(s).fits]
    if not found:
        both = Settings(asked.context, "q4", True, asked.depth, w4_repack is not None or asked.w4)
        found = [Alternative(both, plan_of(both).used)] if plan_of(both).fits else []
    shorter = max_context(weights, c, card, asked.kv, asked.host_tables, asked.depth) // 256 * 256
    if shorter >= MIN_USEFUL_CONTEXT:
        s = Settings(shorter, asked.kv, asked.host_tables, asked.depth, asked.w4)
        found.insert(0, Alternative(s, plan_of(s).used))
    return found
