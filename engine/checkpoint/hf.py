"""HF safetensors checkpoints: which tensors a model needs, checked from the headers, then read.

Names are `model.language_model.*` in multimodal checkpoints (the vision tower `model.visual.*` is
never read), `model.*` in text-only ones, plus `lm_head.weight` and `mtp.*`. Every tensor the model
needs is located and shape-checked from the headers before a byte of weight data is read. The
result is engine/weights.ModelWeights, by model key; Qwen3-Next's fused DeltaNet projections come
out split as Qwen3.5 stores them, so the assembler sees one layout. Flash-Next's n-gram tables stay
in their files (engine/weights.ShardedRows) and their int64 hash constants are read exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import FULL_ATTENTION, ModelConfig
from duet.engine.errors import CheckpointError
from duet.engine.quant.w4 import GROUP
from duet.engine.weights import HEAD_KEY, BF16Matrix, ModelWeights, ShardedRows, take_rows

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
        self.integers: dict[str, tuple[int, ...]] = {}  # integer tensors (Flash-Next's hash constants) -> shape
        self.tables: dict[str, list[str]] = {}  # model key of a sharded row table -> its shards' names
        self.fused_experts = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        fc = "mtp.fc.weight" if config.flash is None else "mtp.fc_embedding.weight"  # Flash-Next splits fc in two
        self.has_mtp = config.mtp_num_hidden_layers > 0 and (fc in ckpt or fc in self.quantized)
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
        if c.flash is None:
            self.need("norm.weight", H)
        else:  # the streams are mixed into one by a last hyper-connection in place of the final norm
            self._plan_hyper_connection("hyper_connection_mixer.", inject=False)
        if not c.tie_word_embeddings:
            self.need("lm_head.weight", V, H)
        for i, kind in enumerate(c.layer_types):
            self._plan_layer(f"layers.{i}.", kind, c.moe_layers[i])
            if c.flash is not None and i in c.flash.ple_layers:
                self._plan_ple(f"layers.{i}.ple.")
        if self.has_mtp and c.flash is None:
            for key in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
                self.need(key, H)
            self.need("mtp.fc.weight", H, 2 * H)
            self._plan_layer("mtp.layers.0.", FULL_ATTENTION, c.is_moe)
        elif self.has_mtp:  # Flash-Next: fed the trunk's streams, ends in a mixer of its own
            self.need("mtp.pre_fc_norm_embedding.weight", H)
            self.need("mtp.pre_fc_norm_hidden.weight", c.flash.hc_count * H)
            self.need("mtp.fc_embedding.weight", H, H)
            self.need("mtp.fc_hidden.weight", H, H)
            self._plan_hyper_connection("mtp.hyper_connection_mixer.", inject=False)
            self._plan_layer("mtp.layers.0.", FULL_ATTENTION, True)

    def _plan_layer(self, p: str, kind: str, moe: bool) -> None:
        c = self.config
        H = c.hidden_size
        if c.flash is None:
            self.need(p + "input_layernorm.weight", H)
            self.need(p + "post_attention_layernorm.weight", H)
        else:
            self._plan_hyper_connection(p + "attn_hyper_connection.")
            self._plan_hyper_connection(p + "mlp_hyper_connection.")
        if kind == FULL_ATTENTION:
            heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            a = p + "self_attn."
            self.need(a + "q_proj.weight", 2 * heads * hd, H)
            self.need(a + "k_proj.weight", kv * hd, H)
            self.need(a + "v_proj.weight", kv * hd, H)
            self.need(a + "o_proj.weight", H, heads * hd)
            self.need(a + "q_norm.weight", hd)
            self.need(a + "k_norm.weight", hd)
            if c.flash is not None:
                f = c.flash
                self.need(a + "indexer.index_qk_proj.weight", (f.indexer_heads + 1) * f.indexer_head_dim, H)
                self.need(a + "indexer.q_layernorm.weight", f.indexer_head_dim)
                self.need(a + "indexer.k_layernorm.weight", f.indexer_head_dim)
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

    def _plan_hyper_connection(self, p: str, inject: bool = True) -> None:
        c = self.config
        streams, wide = c.flash.hc_count, c.flash.hc_count * c.hidden_size
        self.need(p + "hc_norm.weight", wide)
        self.need(p + "input_mix_weight_down.weight", c.flash.hc_lowrank, wide)
        self.need(p + "input_mix_weight_up.weight", wide, c.flash.hc_lowrank)
        if inject:
            self.need(p + "block_inject_weight.weight", streams, wide)

    def _plan_ple(self, p: str) -> None:
        c, f = self.config, self.config.flash
        H, wide = c.hidden_size, f.hc_count * c.hidden_size
        self.need(p + "key_proj.weight", wide, f.ple_embed_dim)
        self.need(p + "value_proj.weight", H, f.ple_embed_dim)
        for norm in ("norm_key", "norm_query", "norm_conv"):
            self.need(f"{p}{norm}.weight", wide)
        self.need(p + "conv1d.weight", wide, 1, f.ple_conv_kernel)
        e = p + "ple_embedding."
        self.integers[self.name(e + "layer_multipliers")] = (f.ngram_size,)
        self.integers[self.name(e + "ngram_heads_vocab_sizes")] = (f.ngram_heads,)
        self.integers[self.name(e + "ngram_heads_offsets")] = (f.ngram_heads,)
        table = e + "ngram_embedding.weight"
        whole = self.name(table)
        shards = [self.name(f"{e}ngram_embedding.shard_{j}.weight") for j in range(f.split_ngram_parts)]
        self.tables[table] = [whole] if whole in self.ckpt else shards

    @property
    def ngram_rows(self) -> int:
        """Rows of the (first) n-gram table, its shards together; 0 without PLE."""
        shards = next(iter(self.tables.values()), [])
        return sum(self.ckpt.info(name).shape[0] for name in shards)

    def _check_tables(self) -> None:
        """The n-gram tables: every shard present, float, with the head width; hash constants integer."""
        f = self.config.flash
        width = f.ple_embed_dim // f.ngram_heads if f and f.ple_layers else 0
        for names in self.tables.values():
            for name in names:
                if name not in self.ckpt:
                    raise CheckpointError(self.ckpt.model_dir, f"tensor {name} is missing; the n-gram table is stored in "
                                          f"{len(names)} shards (split_ngram_parts) and the checkpoint is incomplete")
                info = self.ckpt.info(name)
                if len(info.shape) != 2 or info.shape[1] != width or info.shape[0] < 1 or \
                        info.dtype != self.ckpt.info(names[0]).dtype or info.dtype not in ("F32", "F16", "BF16"):
                    raise CheckpointError(self.ckpt.file_of(name), f"tensor {name} is {info.dtype} {list(info.shape)}; an n-gram "
                                          f"table shard is float [rows, {width}], all of one type; the files do not belong together")
        for name, shape in self.integers.items():
            if name not in self.ckpt:
                raise CheckpointError(self.ckpt.model_dir, f"tensor {name} is missing; the checkpoint is incomplete")
            info = self.ckpt.info(name)
            if info.shape != shape or info.dtype != "I64":
                raise CheckpointError(self.ckpt.file_of(name), f"tensor {name} is {info.dtype} {list(info.shape)}, "
                                      f"expected I64 {list(shape)}; the files do not belong together")

    def _check_headers(self) -> None:
        self._check_tables()
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
        for name in self.integers:
            out[name.removeprefix(self.prefix)] = self.ckpt.read_ints(name)
        for key, names in self.tables.items():
            out[key] = ShardedRows(tuple(self.ckpt.mapped(n) for n in names), bf16=self.ckpt.info(names[0]).dtype == "BF16")
            check_ngram_constants(self.ckpt.file_of(names[0]), key, out)
        return out


def check_ngram_constants(source, table_key: str, tensors: dict) -> None:
    """A PLE layer's hash constants against its table: every head's rows inside it, multipliers odd and
    positive (they are, as splitmix64 derives them), so a lookup can never read outside the table."""
    p = table_key.removesuffix("ngram_embedding.weight")
    sizes, offsets = tensors[p + "ngram_heads_vocab_sizes"], tensors[p + "ngram_heads_offsets"]
    multipliers, rows = tensors[p + "layer_multipliers"], tensors[table_key].shape[0]
    if (sizes < 1).any() or (offsets < 0).any() or (offsets + sizes > rows).any():
        raise CheckpointError(source, f"{p}: the n-gram heads' vocabularies run outside the table's {rows} rows; "
                                      "the file is corrupt, re-download the model")
    if (multipliers <= 0).any() or not (multipliers & 1).all():
        raise CheckpointError(source, f"{p}layer_multipliers are not odd positive integers; the file is corrupt, "
                                      "re-download the model")


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
