"""Stored tensors (engine/weights.py) -> a Model whose Linears run one route on one backend.

The one place that knows which model keys make which layer. Readers have already named every
tensor by model key and undone their format's layouts, so nothing here depends on the file the
weights came from. A route switch builds the Linears again from the same stored tensors.
"""

from __future__ import annotations

import numpy as np

from duet.engine.backend.cpu_ops import CPU
from duet.engine.config import FULL_ATTENTION, ModelConfig
from duet.engine.flash_next import (PLE, FlashLayer, FlashMTPHead, FlashNextModel, HyperConnection, IndexedAttention,
                                     Indexer, NGramHash, flash_op_set)
from duet.engine.heads import RescoredHead, shortlist_ids
from duet.engine.model import MLP, Attention, DecoderLayer, DeltaNet, Model, MoE, MTPHead
from duet.engine.weights import HEAD_KEY, ModelWeights, row_runs, take_rows



def assemble(weights: ModelWeights, route: str, host_tables: bool = False, ops=CPU,
             experts_on_card: np.ndarray | None = None) -> Model:
    """A Model whose linears run `route` on the op set `ops` (engine/backend/cpu_ops.py: on the CPU,
    float arrays are shared with `weights`, not copied).

    host_tables: the output head ranks with an int4 copy and rescores with the bf16 rows
    (engine/heads.py); the checkpoint's head must then be float (the reader checked it).
    experts_on_card: bool [layers, experts], where ops is the GPU's: the routed experts it holds; the
    others are the CPU's Linears, run on the host (engine/experts.py). None: all on ops.
    """
    c = weights.config
    if c.flash is not None:
        return _flash_next(c, Linears(weights, route, flash_op_set(ops), experts_on_card), host_tables)
    get = Linears(weights, route, ops, experts_on_card)
    layers = [_layer(c, get, f"layers.{i}.", kind, c.moe_layers[i], i) for i, kind in enumerate(c.layer_types)]
    lm_head, draft_head = _heads(c, get, host_tables)
    mtp = None
    if weights.has_mtp:
        mtp = MTPHead(
            fc=get.linear("mtp.fc.weight"),
            norm_embedding=get.norm("mtp.pre_fc_norm_embedding.weight"),
            norm_hidden=get.norm("mtp.pre_fc_norm_hidden.weight"),
            layer=_layer(c, get, "mtp.layers.0.", FULL_ATTENTION, c.is_moe),
            norm=get.norm("mtp.norm.weight"),
        )
    embed = ops.embedding(weights("embed_tokens.weight"), lm_head if c.tie_word_embeddings else None)
    return Model(c, embed, layers, get.norm("norm.weight"), lm_head, mtp, draft_head, ops)


class Linears:
    """The stored tensors of one model, the route their Linears run, the op set they run on and
    which routed experts it holds (bool [layers, experts]; None: all)."""

    def __init__(self, weights: ModelWeights, route: str, ops, experts_on_card: np.ndarray | None = None):
        self.weights, self.route, self.ops, self.experts_on_card = weights, route, ops, experts_on_card

    def __call__(self, key: str) -> np.ndarray:
        return self.weights(key)

    def vector(self, values: np.ndarray):
        return self.ops.vector(values)

    def norm(self, key: str):
        """A zero-centred RMSNorm's scale: the stored weight w scales by (1 + w); the 1 is added once here."""
        return self.ops.vector(1.0 + self(key))

    def part(self, key: str, expert: int | None = None, rows: np.ndarray | slice | None = None):
        """A matrix, that of one expert of a fused [E, ...] tensor, or some of its rows."""
        matrix = self(key) if expert is None else self(key)[expert]
        return matrix if rows is None else take_rows(matrix, rows)

    def linear(self, *keys: str, expert: int | None = None, rows: np.ndarray | slice | None = None):
        """One Linear over the matrices of keys stacked by rows (each as `part` takes it)."""
        return self.stack([self.part(key, expert, rows) for key in keys])

    def stack(self, parts: list):
        return stacked_linear(parts, self.route, self.ops)


def stacked_linear(parts: list, route: str, ops=CPU):
    """One Linear over matrices stacked by rows: a run of one storage form is one product, and
    runs of different forms run side by side."""
    linears = [ops.linear(run, route) for run in row_runs(parts)]
    return linears[0] if len(linears) == 1 else ops.concat_outputs(linears)


def _heads(c: ModelConfig, get: Linears, host_tables: bool):
    """The output head, and the draft head over the vocabulary shortlist (None: drafts rank all of it)."""
    key = HEAD_KEY[c.tie_word_embeddings]
    ids = shortlist_ids(c.vocab_size, c.eos_token_ids)
    ops = get.ops
    rescored = RescoredHead(get(key)) if host_tables else None
    head = get.linear(key) if rescored is None else ops.host_head(rescored)
    if ids is None:
        return head, None
    if rescored is not None:  # drafting reads the int4 copy's rows, as on the card
        parts = [ops.shortlist_part(head, rescored.ranking.weight, ids, "w4a16")]
    else:  # the leading ids 0..block-1 (a view of a float head's rows), then the stop tokens
        block = np.count_nonzero(ids == np.arange(len(ids)))
        row_sets = [slice(0, block)] + ([ids[block:]] if block < len(ids) else [])
        parts = [ops.shortlist_part(head, get(key), rows, get.route) for rows in row_sets]
    return head, ops.shortlist_head(parts[0] if len(parts) == 1 else ops.concat_outputs(parts), ids, c.vocab_size)


def _layer(c: ModelConfig, get: Linears, p: str, kind: str, moe: bool, index: int | None = None) -> DecoderLayer:
    """Layer `index` of the trunk (None: the MTP head's)."""
    mixer = _attention(c, get, p + "self_attn.") if kind == FULL_ATTENTION else _deltanet(c, get, p + "linear_attn.")
    ffn = _moe(c, get, p + "mlp.", index) if moe else _mlp(get, p + "mlp.")
    return DecoderLayer(mixer, ffn, get.norm(p + "input_layernorm.weight"), get.norm(p + "post_attention_layernorm.weight"),
                        c.rms_norm_eps, get.ops)


def _attention(c: ModelConfig, get: Linears, p: str) -> Attention:
    return Attention(
        qkv_proj=get.linear(*(f"{p}{name}_proj.weight" for name in ("q", "k", "v"))),
        o_proj=get.linear(p + "o_proj.weight"),
        q_norm=get.norm(p + "q_norm.weight"),
        k_norm=get.norm(p + "k_norm.weight"),
        config=c,
        ops=get.ops,
    )


def _deltanet(c: ModelConfig, get: Linears, p: str) -> DeltaNet:
    return DeltaNet(
        in_proj=get.linear(*(f"{p}in_proj_{name}.weight" for name in ("qkv", "z", "b", "a"))),
        conv=get.vector(get(p + "conv1d.weight")[:, 0, :]),
        decay_rate=get.vector(-np.exp(get(p + "A_log"))),
        dt_bias=get.vector(get(p + "dt_bias")),
        norm=get.vector(get(p + "norm.weight")),
        out_proj=get.linear(p + "out_proj.weight"),
        config=c,
        ops=get.ops,
    )


def _mlp(get: Linears, p: str) -> MLP:
    return MLP(get.linear(p + "gate_proj.weight", p + "up_proj.weight"), get.linear(p + "down_proj.weight"), get.ops)


def _moe(c: ModelConfig, get: Linears, p: str, layer: int | None) -> MoE:
    return MoE(
        router=get.linear(p + "gate.weight"),
        experts=[routed_expert(get, p, e, layer) for e in range(c.num_experts)],
        shared=_mlp(get, p + "shared_expert."),
        shared_gate=get.linear(p + "shared_expert_gate.weight"),
        top_k=c.num_experts_per_tok,
        normalize=c.norm_topk_prob,
        ops=get.ops,
    )


def routed_expert(get: Linears, p: str, e: int, layer: int | None) -> MLP:
    """Expert e of the MoE at p in trunk layer `layer` (None: the MTP head's, always with the rest):
    on get's op set where that holds it; else the CPU's Linears, which the op set runs on the host
    (ops.host_expert): rows go down, outputs come back, the expert's weights stay in host RAM."""
    on_card = get.experts_on_card is None or layer is None or bool(get.experts_on_card[layer, e])
    here = get if on_card else Linears(get.weights, get.route, CPU)
    if get.weights.fused_experts:
        mlp = MLP(here.linear(p + "experts.gate_up_proj", expert=e), here.linear(p + "experts.down_proj", expert=e), here.ops)
    else:
        mlp = _mlp(here, f"{p}experts.{e}.")
    return mlp if on_card else get.ops.host_expert(mlp)


def _flash_next(c: ModelConfig, get: Linears, host_tables: bool) -> FlashNextModel:
    layers = [_flash_layer(c, get, f"layers.{i}.", kind, i in c.flash.ple_layers, i) for i, kind in enumerate(c.layer_types)]
    lm_head, draft_head = _heads(c, get, host_tables)
    embed = get.ops.embedding(get("embed_tokens.weight"), lm_head if c.tie_word_embeddings else None)
    mixer = _hyper_connection(c, get, "hyper_connection_mixer.", inject=False)
    mtp = None
    if get.weights.has_mtp:
        layer = _flash_layer(c, get, "mtp.layers.0.", FULL_ATTENTION, ple=False)
        mtp = FlashMTPHead(get.linear("mtp.fc_embedding.weight"), get.linear("mtp.fc_hidden.weight"),
                           get.norm("mtp.pre_fc_norm_embedding.weight"), get.norm("mtp.pre_fc_norm_hidden.weight"), layer,
                           _hyper_connection(c, get, "mtp.hyper_connection_mixer.", inject=False))
    return FlashNextModel(c, embed, layers, mixer, lm_head, mtp, draft_head, get.ops)


def _flash_layer(c: ModelConfig, get: Linears, p: str, kind: str, ple: bool, index: int | None = None) -> FlashLayer:
    """Layer `index` of the trunk (None: the MTP head's)."""
    if kind == FULL_ATTENTION:
        mixer = IndexedAttention(_attention(c, get, p + "self_attn."), _indexer(c, get, p + "self_attn.indexer."))
    else:
        mixer = _deltanet(c, get, p + "linear_attn.")
    return FlashLayer(mixer, _moe(c, get, p + "mlp.", index), _hyper_connection(c, get, p + "attn_hyper_connection."),
                      _hyper_connection(c, get, p + "mlp_hyper_connection."), get.ops, _ple(c, get, p + "ple.") if ple else None)


def _hyper_connection(c: ModelConfig, get: Linears, p: str, inject: bool = True) -> HyperConnection:
    return HyperConnection(
        norm=get.norm(p + "hc_norm.weight"),
        down=get.linear(p + "input_mix_weight_down.weight"),
        up=get.linear(p + "input_mix_weight_up.weight"),
        inject=get.linear(p + "block_inject_weight.weight") if inject else None,
        hc=c.flash.hc_count,
        eps=c.rms_norm_eps,
        ops=get.ops,
    )


def _indexer(c: ModelConfig, get: Linears, p: str) -> Indexer:
    f = c.flash
    return Indexer(get.linear(p + "index_qk_proj.weight"), get.norm(p + "q_layernorm.weight"),
                   get.norm(p + "k_layernorm.weight"), f.indexer_heads, f.indexer_compress_ratio, f.block_topk, c, get.ops)


def _ple(c: ModelConfig, get: Linears, p: str) -> PLE:
    f, e = c.flash, p + "ple_embedding."
    ngrams = NGramHash(get(e + "ngram_embedding.weight"), get(e + "layer_multipliers"), get(e + "ngram_heads_vocab_sizes"),
                       get(e + "ngram_heads_offsets"), f.heads_per_ngram, c.eos_token_ids[0])
    return PLE(
        ngrams=ngrams,
        key_proj=get.linear(p + "key_proj.weight"),
        value_proj=get.linear(p + "value_proj.weight"),
        norm_key=get.norm(p + "norm_key.weight"),
        norm_query=get.norm(p + "norm_query.weight"),
        norm_conv=get.norm(p + "norm_conv.weight"),
        conv=get.vector(get(p + "conv1d.weight")[:, 0, :]),
        dilation=f.ngram_size,
        hc=f.hc_count,
        eps=c.rms_norm_eps,
        ops=get.ops,
    )
