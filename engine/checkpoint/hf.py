"""HF safetensors checkpoints -> Model. The one place that knows checkpoint tensor names.

Names are `model.language_model.*` in multimodal checkpoints (the vision tower `model.visual.*` is
never read), `model.*` in text-only ones, plus `lm_head.weight` and `mtp.*`. Every tensor the model
needs is located and shape-checked from the headers before a byte of weight data is read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.backend.cpu import ConcatOutputs, stacked_linear
from engine.checkpoint.safetensors import SafetensorsCheckpoint
from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import CheckpointError
from engine.heads import RescoredHead, ShortlistHead, shortlist_ids
from engine.quant.w4 import GROUP
from engine.model import MLP, Attention, DecoderLayer, DeltaNet, Model, MoE, MTPHead

Progress = Callable[[int, int], None]  # (bytes read so far, bytes to read)
HEAD_KEY = {True: "embed_tokens.weight", False: "lm_head.weight"}  # by tie_word_embeddings


def load_hf_model(ckpt: SafetensorsCheckpoint, config: ModelConfig, progress: Progress | None = None,
                  route: str = "bf16", quantized=None) -> Model:
    """quantized: the checkpoint's INT4 modules (engine/checkpoint/quantized.py), read instead of `.weight`."""
    return read_weights(ckpt, config, progress, quantized).assemble(route)


def read_weights(ckpt: SafetensorsCheckpoint, config: ModelConfig, progress: Progress | None = None,
                 quantized=None, host_tables: bool = False) -> ModelWeights:
    """Every tensor the model needs, read once; `assemble` builds a Model for any route the weights run.

    host_tables: check, before reading, that the head is float, which rescoring needs.
    """
    plan = TensorPlan(ckpt, config, quantized)
    if host_tables:
        plan.check_host_tables()
    return ModelWeights(config, plan.read_all(progress), plan)


class ModelWeights:
    """The weights as read from the checkpoint (fp32 arrays, packed quantized matrices)."""

    def __init__(self, config: ModelConfig, tensors: dict, plan: TensorPlan):
        self.config, self.tensors, self.plan = config, tensors, plan

    def assemble(self, route: str, host_tables: bool = False) -> Model:
        """A Model whose linears run `route`; arrays are shared with these weights, not copied.

        host_tables: the output head ranks with an int4 copy and rescores with the bf16 rows
        (engine/heads.py); the checkpoint's head must then be float.
        """
        return _assemble(self.config, self.tensors, self.plan, route, host_tables)


class TensorPlan:
    """Which checkpoint tensors the model needs, with the shape each must have."""

    def __init__(self, ckpt: SafetensorsCheckpoint, config: ModelConfig, quantized=None):
        self.ckpt, self.config = ckpt, config
        self.quantized = quantized if quantized is not None else {}
        names = ckpt.names()
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
        self.expected: dict[str, tuple[int, ...]] = {}
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        self.has_mtp = config.mtp_num_hidden_layers > 0 and ("mtp.fc.weight" in ckpt or "mtp.fc.weight" in self.quantized)
        self._plan_model()
        self._check_headers()

    def name(self, key: str) -> str:
        """Checkpoint name of a model tensor (`layers.3.mlp.down_proj.weight`), or an `mtp.` name as is."""
        return key if key.startswith(("mtp.", "lm_head.")) else self.prefix + key

    def head_name(self) -> str:
        return self.name(HEAD_KEY[self.config.tie_word_embeddings])

    def check_host_tables(self) -> None:
        """Host tables rank with a W4 copy of a float head: refuse what cannot make one, before any read."""
        head = self.head_name()
        if head in self.quantized:
            raise CheckpointError(self.ckpt.file_of(head), f"--host-tables rescores with the float head, but {head} "
                                  "is stored quantized here; run without --host-tables")
        if self.config.hidden_size % GROUP:
            raise CheckpointError(self.ckpt.file_of(head), f"--host-tables needs a hidden size that is a multiple of "
                                  f"{GROUP} for its int4 head (this model's is {self.config.hidden_size}); run without it")

    def need(self, key: str, *shape: int) -> None:
        self.expected[self.name(key)] = tuple(shape)

    def _plan_model(self) -> None:
        c = self.config
        V, H = c.vocab_size, c.hidden_size
        self.need("embed_tokens.weight", V, H)
        self.need("norm.weight", H)
        if not c.tie_word_embeddings:
            self.need("lm_head.weight", V, H)
        for i, kind in enumerate(c.layer_types):
            self._plan_layer(f"layers.{i}.", kind, c.moe_layers[i])
        if self.has_mtp:
            for key in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
                self.need(key, H)
            self.need("mtp.fc.weight", H, 2 * H)
            self._plan_layer("mtp.layers.0.", FULL_ATTENTION, c.is_moe)

    def _plan_layer(self, p: str, kind: str, moe: bool) -> None:
        c = self.config
        H = c.hidden_size
        self.need(p + "input_layernorm.weight", H)
        self.need(p + "post_attention_layernorm.weight", H)
        if kind == FULL_ATTENTION:
            heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            a = p + "self_attn."
            self.need(a + "q_proj.weight", 2 * heads * hd, H)
            self.need(a + "k_proj.weight", kv * hd, H)
            self.need(a + "v_proj.weight", kv * hd, H)
            self.need(a + "o_proj.weight", H, heads * hd)
            self.need(a + "q_norm.weight", hd)
            self.need(a + "k_norm.weight", hd)
        else:
            hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
            channels = 2 * hk * dk + hv * dv
            d = p + "linear_attn."
            if c.fused_linear_projections:
                self.need(d + "in_proj_qkvz.weight", channels + hv * dv, H)
                self.need(d + "in_proj_ba.weight", 2 * hv, H)
            else:
                self.need(d + "in_proj_qkv.weight", channels, H)
                self.need(d + "in_proj_z.weight", hv * dv, H)
                self.need(d + "in_proj_b.weight", hv, H)
                self.need(d + "in_proj_a.weight", hv, H)
            self.need(d + "conv1d.weight", channels, 1, c.linear_conv_kernel_dim)
            self.need(d + "A_log", hv)
            self.need(d + "dt_bias", hv)
            self.need(d + "norm.weight", dv)
            self.need(d + "out_proj.weight", H, hv * dv)
        if moe:
            self._plan_moe(p + "mlp.")
        else:
            self._plan_mlp(p + "mlp.", c.intermediate_size)

    def _plan_mlp(self, p: str, inner: int) -> None:
        H = self.config.hidden_size
        self.need(p + "gate_proj.weight", inner, H)
        self.need(p + "up_proj.weight", inner, H)
        self.need(p + "down_proj.weight", H, inner)

    def _plan_moe(self, p: str) -> None:
        c = self.config
        E, H, inner = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.need(p + "gate.weight", E, H)
        if self.fused_experts:
            self.need(p + "experts.gate_up_proj", E, 2 * inner, H)
            self.need(p + "experts.down_proj", E, H, inner)
        else:
            for e in range(E):
                self._plan_mlp(f"{p}experts.{e}.", inner)
        self._plan_mlp(p + "shared_expert.", c.shared_expert_intermediate_size)
        self.need(p + "shared_expert_gate.weight", 1, H)

    def _check_headers(self) -> None:
        where = self.ckpt.model_dir
        for name, shape in self.expected.items():
            if name in self.quantized:
                self.quantized.check(name, shape)
                continue
            if name not in self.ckpt:
                raise CheckpointError(where, f"tensor {name} is missing; the checkpoint is incomplete or not a {self.config.model_type} model")
            info = self.ckpt.info(name)
            if info.shape != shape:
                raise CheckpointError(self.ckpt.file_of(name),
                                      f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)}; the files do not belong together")
            if info.dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(self.ckpt.file_of(name),
                                      f"tensor {name} is {info.dtype}; this reader takes bf16/fp16/fp32 weights")

    def nbytes(self, name: str) -> int:
        return self.quantized.nbytes(name) if name in self.quantized else self.ckpt.info(name).nbytes

    def read_all(self, progress: Progress | None) -> dict:
        """fp32 arrays, and quantized weights (W4Weight) for the checkpoint's INT4 modules."""
        total = sum(self.nbytes(n) for n in self.expected)
        done, out = 0, {}
        for name in self.expected:
            out[name] = self.quantized.read(name) if name in self.quantized else self.ckpt.read_f32(name)
            done += self.nbytes(name)
            if progress:
                progress(done, total)
        return out


class Weights:
    """Model tensors by key (`layers.3.mlp.down_proj.weight`); `linear` builds a matrix's Linear for the route."""

    def __init__(self, tensors: dict, plan: TensorPlan, route: str):
        self.tensors, self.plan, self.route = tensors, plan, route

    def __call__(self, key: str) -> np.ndarray:
        return self.tensors[self.plan.name(key)]

    def part(self, key: str, expert: int | None = None, rows: np.ndarray | slice | None = None):
        """A matrix, that of one expert of a fused tensor, or some of its rows (indices, or a slice:
        a view of float weights)."""
        matrix = self(key) if expert is None else self(key)[expert]
        if rows is None:
            return matrix
        return matrix[rows] if isinstance(matrix, np.ndarray) else matrix.take_rows(np.arange(matrix.shape[0])[rows])

    def linear(self, *keys: str, expert: int | None = None, rows: np.ndarray | slice | None = None):
        """One Linear over the matrices of keys stacked by rows (each as `part` takes it)."""
        return self.stack([self.part(key, expert, rows) for key in keys])

    def stack(self, parts: list):
        return stacked_linear(parts, self.route)


def _assemble(config: ModelConfig, t: dict, plan: TensorPlan, route: str = "bf16", host_tables: bool = False) -> Model:
    get = Weights(t, plan, route)
    layers = [_layer(config, get, f"layers.{i}.", kind, config.moe_layers[i], plan.fused_experts)
              for i, kind in enumerate(config.layer_types)]
    embed = get("embed_tokens.weight")
    lm_head, draft_head = _heads(config, get, host_tables)
    mtp = None
    if plan.has_mtp:
        mtp = MTPHead(
            fc=get.linear("mtp.fc.weight"),
            norm_embedding=1.0 + get("mtp.pre_fc_norm_embedding.weight"),
            norm_hidden=1.0 + get("mtp.pre_fc_norm_hidden.weight"),
            layer=_layer(config, get, "mtp.layers.0.", FULL_ATTENTION, config.is_moe, plan.fused_experts),
            norm=1.0 + get("mtp.norm.weight"),
        )
    return Model(config, embed, layers, 1.0 + get("norm.weight"), lm_head, mtp, draft_head)


def _heads(c: ModelConfig, get: Weights, host_tables: bool):
    """The output head, and the draft head over the vocabulary shortlist (None: drafts rank all of it).

    With host tables the head must be float (read_weights refuses a quantized one before reading).
    """
    key = HEAD_KEY[c.tie_word_embeddings]
    ids = shortlist_ids(c.vocab_size, c.eos_token_ids)
    if host_tables:
        head = RescoredHead(get(key))
        return head, None if ids is None else ShortlistHead(head.draft_rows(ids), ids, c.vocab_size)
    head = get.linear(key)
    if ids is None:
        return head, None
    block = np.count_nonzero(ids == np.arange(len(ids)))  # the leading ids 0..block-1, then the stop tokens
    parts = [get.linear(key, rows=slice(0, block))] + ([get.linear(key, rows=ids[block:])] if block < len(ids) else [])
    return head, ShortlistHead(parts[0] if len(parts) == 1 else ConcatOutputs(parts), ids, c.vocab_size)


def _layer(c: ModelConfig, get, p: str, kind: str, moe: bool, fused_experts: bool) -> DecoderLayer:
    mixer = _attention(c, get, p + "self_attn.") if kind == FULL_ATTENTION else _deltanet(c, get, p + "linear_attn.")
    ffn = _moe(c, get, p + "mlp.", fused_experts) if moe else _mlp(get, p + "mlp.")
    # Zero-centred RMSNorm: the stored weight w scales by (1 + w); add the 1 once here.
    return DecoderLayer(mixer, ffn, 1.0 + get(p + "input_layernorm.weight"),
                        1.0 + get(p + "post_attention_layernorm.weight"), c.rms_norm_eps)


def _attention(c: ModelConfig, get, p: str) -> Attention:
    return Attention(
        q_proj=get.linear(p + "q_proj.weight"),
        k_proj=get.linear(p + "k_proj.weight"),
        v_proj=get.linear(p + "v_proj.weight"),
        o_proj=get.linear(p + "o_proj.weight"),
        q_norm=1.0 + get(p + "q_norm.weight"),
        k_norm=1.0 + get(p + "k_norm.weight"),
        config=c,
    )


def _deltanet(c: ModelConfig, get, p: str) -> DeltaNet:
    if c.fused_linear_projections:
        (qkv_rows, z_rows), (b_rows, a_rows) = _qwen3_next_rows(c)
        qkvz, ba = p + "in_proj_qkvz.weight", p + "in_proj_ba.weight"
        in_proj = get.stack([get.part(qkvz, rows=qkv_rows), get.part(qkvz, rows=z_rows),
                             get.part(ba, rows=b_rows), get.part(ba, rows=a_rows)])
    else:
        in_proj = get.linear(*(f"{p}in_proj_{name}.weight" for name in ("qkv", "z", "b", "a")))
    return DeltaNet(
        in_proj=in_proj,
        conv=get(p + "conv1d.weight")[:, 0, :],
        decay_rate=-np.exp(get(p + "A_log")),
        dt_bias=get(p + "dt_bias"),
        norm=get(p + "norm.weight"),
        out_proj=get.linear(p + "out_proj.weight"),
        config=c,
    )


def _qwen3_next_rows(c: ModelConfig):
    """Qwen3-Next groups rows per key head: [q dk | k dk | v r*dv | z r*dv] and [b r | a r], r = Hv/Hk.

    Row indices that regroup them into the Qwen3.5 layout: ((all q, all k, all v), z) and (b, a).
    Value head j of key group g becomes head g*r + j, the repeat-interleave mapping the forward
    pass assumes.
    """
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk
    grouped = np.arange(hk * (2 * dk + 2 * r * dv)).reshape(hk, -1)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    b, a = np.split(np.arange(2 * hv).reshape(hk, 2 * r), 2, axis=1)
    return (np.concatenate([q.ravel(), k.ravel(), v.ravel()]), z.ravel()), (b.ravel(), a.ravel())


def _mlp(get, p: str) -> MLP:
    return MLP(get.linear(p + "gate_proj.weight", p + "up_proj.weight"), get.linear(p + "down_proj.weight"))


def _moe(c: ModelConfig, get, p: str, fused: bool) -> MoE:
    if fused:
        experts = [MLP(get.linear(p + "experts.gate_up_proj", expert=e), get.linear(p + "experts.down_proj", expert=e))
                   for e in range(c.num_experts)]
    else:
        experts = [_mlp(get, f"{p}experts.{e}.") for e in range(c.num_experts)]
    return MoE(
        router=get.linear(p + "gate.weight"),
        experts=experts,
        shared=_mlp(get, p + "shared_expert."),
        shared_gate=get.linear(p + "shared_expert_gate.weight"),
        top_k=c.num_experts_per_tok,
        normalize=c.norm_topk_prob,
    )
