"""HF safetensors checkpoints -> Model. The one place that knows checkpoint tensor names.

Names are `model.language_model.*` in multimodal checkpoints (the vision tower `model.visual.*` is
never read), `model.*` in text-only ones, plus `lm_head.weight` and `mtp.*`. Every tensor the model
needs is located and shape-checked from the headers before a byte of weight data is read.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.backend.cpu import DenseLinear
from engine.checkpoint.safetensors import SafetensorsCheckpoint
from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import CheckpointError
from engine.model import MLP, Attention, DecoderLayer, DeltaNet, Model, MoE, MTPHead

Progress = Callable[[int, int], None]  # (bytes read so far, bytes to read)


def load_hf_model(ckpt: SafetensorsCheckpoint, config: ModelConfig, progress: Progress | None = None) -> Model:
    plan = TensorPlan(ckpt, config)
    tensors = plan.read_all(progress)
    return _assemble(config, tensors, plan)


class TensorPlan:
    """Which checkpoint tensors the model needs, with the shape each must have."""

    def __init__(self, ckpt: SafetensorsCheckpoint, config: ModelConfig):
        self.ckpt, self.config = ckpt, config
        names = ckpt.names()
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
        self.expected: dict[str, tuple[int, ...]] = {}
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        self.has_mtp = config.mtp_num_hidden_layers > 0 and "mtp.fc.weight" in ckpt
        self._plan_model()
        self._check_headers()

    def name(self, key: str) -> str:
        """Checkpoint name of a model tensor (`layers.3.mlp.down_proj.weight`), or an `mtp.` name as is."""
        return key if key.startswith(("mtp.", "lm_head.")) else self.prefix + key

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
            if name not in self.ckpt:
                raise CheckpointError(where, f"tensor {name} is missing; the checkpoint is incomplete or not a {self.config.model_type} model")
            info = self.ckpt.info(name)
            if info.shape != shape:
                raise CheckpointError(self.ckpt.file_of(name),
                                      f"tensor {name} has shape {list(info.shape)}, config.json implies {list(shape)}; the files do not belong together")
            if info.dtype not in ("F32", "F16", "BF16"):
                raise CheckpointError(self.ckpt.file_of(name),
                                      f"tensor {name} is {info.dtype}; this reader takes bf16/fp16/fp32 weights")

    def read_all(self, progress: Progress | None) -> dict[str, np.ndarray]:
        total = sum(self.ckpt.info(n).nbytes for n in self.expected)
        done, out = 0, {}
        for name in self.expected:
            out[name] = self.ckpt.read_f32(name)
            done += self.ckpt.info(name).nbytes
            if progress:
                progress(done, total)
        return out


def _assemble(config: ModelConfig, t: dict[str, np.ndarray], plan: TensorPlan) -> Model:
    def get(key: str) -> np.ndarray:
        return t[plan.name(key)]

    layers = [_layer(config, get, f"layers.{i}.", kind, config.moe_layers[i], plan.fused_experts)
              for i, kind in enumerate(config.layer_types)]
    embed = get("embed_tokens.weight")
    lm_head = DenseLinear(embed if config.tie_word_embeddings else get("lm_head.weight"))
    mtp = None
    if plan.has_mtp:
        mtp = MTPHead(
            fc=DenseLinear(get("mtp.fc.weight")),
            norm_embedding=1.0 + get("mtp.pre_fc_norm_embedding.weight"),
            norm_hidden=1.0 + get("mtp.pre_fc_norm_hidden.weight"),
            layer=_layer(config, get, "mtp.layers.0.", FULL_ATTENTION, config.is_moe, plan.fused_experts),
            norm=1.0 + get("mtp.norm.weight"),
        )
    return Model(config, embed, layers, 1.0 + get("norm.weight"), lm_head, mtp)


def _layer(c: ModelConfig, get, p: str, kind: str, moe: bool, fused_experts: bool) -> DecoderLayer:
    mixer = _attention(c, get, p + "self_attn.") if kind == FULL_ATTENTION else _deltanet(c, get, p + "linear_attn.")
    ffn = _moe(c, get, p + "mlp.", fused_experts) if moe else _mlp(get, p + "mlp.")
    # Zero-centred RMSNorm: the stored weight w scales by (1 + w); add the 1 once here.
    return DecoderLayer(mixer, ffn, 1.0 + get(p + "input_layernorm.weight"),
                        1.0 + get(p + "post_attention_layernorm.weight"), c.rms_norm_eps)


def _attention(c: ModelConfig, get, p: str) -> Attention:
    return Attention(
        q_proj=DenseLinear(get(p + "q_proj.weight")),
        k_proj=DenseLinear(get(p + "k_proj.weight")),
        v_proj=DenseLinear(get(p + "v_proj.weight")),
        o_proj=DenseLinear(get(p + "o_proj.weight")),
        q_norm=1.0 + get(p + "q_norm.weight"),
        k_norm=1.0 + get(p + "k_norm.weight"),
        config=c,
    )


def _deltanet(c: ModelConfig, get, p: str) -> DeltaNet:
    if c.fused_linear_projections:
        qkv, z, b, a = _split_qwen3_next(c, get(p + "in_proj_qkvz.weight"), get(p + "in_proj_ba.weight"))
    else:
        qkv, z = get(p + "in_proj_qkv.weight"), get(p + "in_proj_z.weight")
        b, a = get(p + "in_proj_b.weight"), get(p + "in_proj_a.weight")
    return DeltaNet(
        in_qkv=DenseLinear(qkv),
        in_z=DenseLinear(z),
        in_b=DenseLinear(b),
        in_a=DenseLinear(a),
        conv=get(p + "conv1d.weight")[:, 0, :],
        decay_rate=-np.exp(get(p + "A_log")),
        dt_bias=get(p + "dt_bias"),
        norm=get(p + "norm.weight"),
        out_proj=DenseLinear(get(p + "out_proj.weight")),
        config=c,
    )


def _split_qwen3_next(c: ModelConfig, qkvz: np.ndarray, ba: np.ndarray):
    """Qwen3-Next groups rows per key head: [q dk | k dk | v r*dv | z r*dv] and [b r | a r], r = Hv/Hk.

    Regroup into the Qwen3.5 layout (all q, all k, all v; z; b; a). Value head j of key group g
    becomes head g*r + j, which is the repeat-interleave mapping the forward pass assumes.
    """
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, H = hv // hk, c.hidden_size
    grouped = qkvz.reshape(hk, 2 * dk + 2 * r * dv, H)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    qkv = np.concatenate([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
    b, a = np.split(ba.reshape(hk, 2 * r, H), 2, axis=1)
    return qkv, z.reshape(-1, H), b.reshape(-1, H), a.reshape(-1, H)


def _mlp(get, p: str) -> MLP:
    gate_up = np.concatenate([get(p + "gate_proj.weight"), get(p + "up_proj.weight")])
    return MLP(DenseLinear(gate_up), DenseLinear(get(p + "down_proj.weight")))


def _moe(c: ModelConfig, get, p: str, fused: bool) -> MoE:
    if fused:
        gate_up, down = get(p + "experts.gate_up_proj"), get(p + "experts.down_proj")
        experts = [MLP(DenseLinear(gate_up[e]), DenseLinear(down[e])) for e in range(c.num_experts)]
    else:
        experts = [_mlp(get, f"{p}experts.{e}.") for e in range(c.num_experts)]
    return MoE(
        router=DenseLinear(get(p + "gate.weight")),
        experts=experts,
        shared=_mlp(get, p + "shared_expert."),
        shared_gate=DenseLinear(get(p + "shared_expert_gate.weight")),
        top_k=c.num_experts_per_tok,
        normalize=c.norm_topk_prob,
    )
