"""HF safetensors checkpoints: which tensors a model needs, checked from the headers, then read.

Names are `model.language_model.*` in multimodal checkpoints (the vision tower `model.visual.*` is
never read), `model.*` in text-only ones, plus `lm_head.weight` and `mtp.*`. Every tensor the model
needs is located and shape-checked from the headers before a byte of weight data is read. The
result is engine/weights.ModelWeights, by model key; Qwen3-Next's fused DeltaNet projections come
out split as Qwen3.5 stores them, so the assembler sees one layout.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import FULL_ATTENTION, ModelConfig
from duet.engine.errors import CheckpointError
from duet.engine.quant.w4 import GROUP
from duet.engine.weights import HEAD_KEY, BF16Matrix, ModelWeights, take_rows

Progress = Callable[[int, int], None]  # (bytes read so far, bytes to read)


def read_weights(ckpt: SafetensorsCheckpoint, config: ModelConfig, progress: Progress | None = None,
                 quantized=None, host_tables: bool = False) -> ModelWeights:
    """Every tensor the model needs, read once, by model key.

    quantized: the checkpoint's INT4 modules (engine/checkpoint/quantized.py), read instead of
    `.weight`; host_tables: check, before reading, that the head is float, which rescoring needs.
    """
    plan = TensorPlan(ckpt, config, quantized)
    if host_tables:
        plan.check_host_tables()
    tensors = plan.read_all(progress)
    if config.fused_linear_projections:
        split_qwen3_next_projections(config, tensors)
    return ModelWeights(config, tensors, plan.has_mtp, plan.fused_experts)


def checkpoint_name(key: str, prefix: str = "model.") -> str:
    """Checkpoint name of a model tensor (`layers.3.mlp.down_proj.weight`): prefixed, but `mtp.` and
    `lm_head.` names as they are."""
    return key if key.startswith(("mtp.", "lm_head.")) else prefix + key


class TensorPlan:
    """Which checkpoint tensors the model needs, with the shape each must have."""

    def __init__(self, ckpt: SafetensorsCheckpoint, config: ModelConfig, quantized=None):
        self.ckpt, self.config = ckpt, config
        self.quantized = quantized if quantized is not None else {}
        names = ckpt.names()
        self.prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
        self.expected: dict[str, tuple[int, ...]] = {}  # checkpoint name -> shape
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        self.has_mtp = config.mtp_num_hidden_layers > 0 and ("mtp.fc.weight" in ckpt or "mtp.fc.weight" in self.quantized)
        self._plan_model()
        self._check_headers()

    def name(self, key: str) -> str:
        return checkpoint_name(key, self.prefix)

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

    def _read_float(self, name: str):
        """A bf16 matrix as its bits (BF16Matrix: Linears and embeddings read them as stored, half
        the bytes of fp32); everything else as fp32."""
        info = self.ckpt.info(name)
        if info.dtype == "BF16" and len(info.shape) == 2:
            return BF16Matrix(self.ckpt.read_bits(name))
        return self.ckpt.read_f32(name)

    def read_all(self, progress: Progress | None) -> dict:
        """By model key: fp32 arrays, bf16 matrices as BF16Matrix, and quantized weights (W4Weight)
        for the checkpoint's INT4 modules."""
        total = sum(self.nbytes(n) for n in self.expected)
        done, out = 0, {}
        for name in self.expected:
            key = name.removeprefix(self.prefix)  # the model key: name() undone
            out[key] = self.quantized.read(name) if name in self.quantized else self._read_float(name)
            done += self.nbytes(name)
            if progress:
                progress(done, total)
        return out


def split_qwen3_next_projections(c: ModelConfig, tensors: dict) -> None:
    """Replace each DeltaNet layer's in_proj_qkvz / in_proj_ba by Qwen3.5's in_proj_qkv, _z, _b, _a."""
    (qkv_rows, z_rows), (b_rows, a_rows) = qwen3_next_rows(c)
    for key in [k for k in tensors if k.endswith("linear_attn.in_proj_qkvz.weight")]:
        p = key[: -len("in_proj_qkvz.weight")]
        qkvz, ba = tensors.pop(key), tensors.pop(p + "in_proj_ba.weight")
        for name, source, rows in (("qkv", qkvz, qkv_rows), ("z", qkvz, z_rows), ("b", ba, b_rows), ("a", ba, a_rows)):
            tensors[f"{p}in_proj_{name}.weight"] = take_rows(source, rows)


def qwen3_next_rows(c: ModelConfig):
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
