"""GGUF checkpoints (llama.cpp's format) of the qwen35, qwen35moe and qwen3next architectures.

The file is parsed with the `gguf` package and presented to hf.TensorPlan under the HF names the
model assembly knows, undoing what llama.cpp's converter (convert_hf_to_gguf.py, Qwen3Next and
Qwen3.5 classes) did to each tensor:

    norms            zero-centred norms are stored as 1 + w (not the DeltaNet gated norm, ssm_norm)
    ssm_a            stored as -exp(A_log)
    ssm_conv1d       [channels, kernel], the HF [channels, 1, kernel] squeezed
    V heads          qwen35/qwen35moe store DeltaNet value heads tiled (value head j of key head g at
                     j * Hk + g); HF groups them (g * r + j). Rows of attn_qkv (V part), attn_gate,
                     ssm_beta, ssm_alpha, ssm_a, ssm_dt and conv channels are taken back in grouped
                     order; ssm_out's input columns are reordered on the activation instead
                     (cpu.PermutedInput), since quantized blocks cannot be split
    qwen3next        in_proj_qkvz split into attn_qkv (all q, all k, all v, grouped) and attn_gate (z);
                     in_proj_ba kept as ssm_ba, per key head [b r | a r]; no V reorder. With the
                     projections split this is the Qwen3.5-MoE layout, which is how it loads
    experts          stacked: ffn_{gate,up,down}_exps [E, out, in]; shared expert *_shexp; router
                     ffn_gate_inp; shared expert gate ffn_gate_inp_shexp
    MTP              block n_layer: blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm} plus a
                     full-attention layer's tensors under blk.N

Float tensors (F32, F16, BF16) are widened to fp32; quantized ones stay as the file's blocks
(quant/gguf_blocks.BlockMatrix, memory-mapped) and run on the w4a8 route, or dequantized on bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from engine.weights import InputOrder
from engine.checkpoint.safetensors import TensorInfo, bf16_to_f32
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.errors import CheckpointError
from engine.quant.gguf_blocks import CODECS, SUPPORTED_TYPES, BlockMatrix
from engine.tokenizer import Tokenizer

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_5_moe_text"}
TILED_V_HEADS = {"qwen35", "qwen35moe"}
QUANTIZED_ROUTES = ("w4a8", "bf16")  # the natural route first
FLOAT_ROUTES = ("bf16",)


def find_gguf(path: Path) -> Path | None:
    """path itself if it is a .gguf file; the one .gguf of a folder without config.json; else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise CheckpointError(path, f"holds several GGUF files ({names}); pass --model with one of them")
        return found[0] if found else None
    return None


@dataclass(frozen=True)
class Entry:
    """One model tensor (HF name) and how to make it from the GGUF file."""

    source: str  # GGUF tensor name, for messages
    shape: tuple[int, ...]  # HF shape
    nbytes: int
    quantized: bool
    load: Callable[[], object]


class GGUFCheckpoint:
    """A GGUF file seen as a checkpoint with HF tensor names (the interface TensorPlan reads)."""

    def __init__(self, path: Path):
        self.path = self.model_dir = Path(path)
        self.reader = open_gguf(self.path)
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self._value("general.architecture")
        if self.arch not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise CheckpointError(self.path, f"architecture {self.arch!r} is not supported; duet reads {known}")
        self._check_types()
        self.config = ModelConfig.from_dict(self._config_dict(), str(self.path))
        self.entries = self._entries()
        self.quantized = QuantizedView(self)

    # ---- what TensorPlan asks of a checkpoint

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def info(self, name: str) -> TensorInfo:
        entry = self.entries[name]
        return TensorInfo(name, "F32", entry.shape, 0, entry.nbytes)

    def file_of(self, name: str) -> Path:
        return self.path

    def read_f32(self, name: str) -> np.ndarray:
        return self.entries[name].load()

    def close(self) -> None:
        """Nothing to release: quantized blocks stay memory-mapped for as long as the model uses them."""

    # ---- what the loader asks

    @property
    def block_types(self) -> list[str]:
        return sorted({t.tensor_type.name for t in self.tensors.values() if t.tensor_type in CODECS})

    @property
    def routes(self) -> tuple[str, ...]:
        return QUANTIZED_ROUTES if self.block_types else FLOAT_ROUTES

    @property
    def description(self) -> str:
        return "GGUF " + ("/".join(self.block_types) or "float")

    def tokenizer(self) -> Tokenizer:
        model = self._value("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(self.path, f"tokenizer model {model!r} is not supported; duet reads gpt2-style BPE")
        tokens = self._value("tokenizer.ggml.tokens")
        return Tokenizer.from_gguf_vocab(
            tokens=tokens,
            token_types=self._value("tokenizer.ggml.token_type"),
            merges=self._value("tokenizer.ggml.merges"),
            pre=self._optional("tokenizer.ggml.pre") or "gpt-2",
            bos_id=self._token_id("tokenizer.ggml.bos_token_id", tokens),
            eos_id=self._token_id("tokenizer.ggml.eos_token_id", tokens),
            pad_id=self._token_id("tokenizer.ggml.padding_token_id", tokens),
            extra_eos_ids=[i for i in [self._token_id("tokenizer.ggml.eot_token_id", tokens)] if i is not None],
            chat_template=self._optional("tokenizer.chat_template"),
            source=self.path,
        )

    # ---- metadata

    def _field(self, key: str):
        if key not in self.fields:
            raise CheckpointError(self.path, f"metadata key {key} is missing; the file is not a complete {self.arch} GGUF")
        return self.fields[key]

    def _optional(self, key: str):
        return self.fields[key].contents() if key in self.fields else None

    def _token_id(self, key: str, tokens: list[str]) -> int | None:
        value = self._optional(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
            raise CheckpointError(self.path, f"metadata key {key} is {value!r}, not a token id")
        return value

    def _value(self, key: str):
        return self._field(key).contents()

    def _arch(self, key: str, *default):
        """The value of `{arch}.key`; required unless a default is given."""
        full = f"{self.arch}.{key}"
        if default and full not in self.fields:
            return default[0]
        return self._value(full)

    def _config_dict(self) -> dict:
        """A config.json-style dict from `{arch}.*` keys, for ModelConfig.from_dict."""
        mtp = self._arch("nextn_predict_layers", 0)
        layers = self._arch("block_count") - mtp
        head_dim = self._arch("attention.key_length")
        v_heads = self._arch("ssm.time_step_rank")
        embed = self._tensor("token_embd.weight")
        raw = {
            "model_type": ARCHITECTURES[self.arch],
            "vocab_size": int(embed.shape[1]),
            "hidden_size": self._arch("embedding_length"),
            "num_hidden_layers": layers,
            "layer_types": self._layer_types(layers),
            "num_attention_heads": self._arch("attention.head_count"),
            "num_key_value_heads": self._arch("attention.head_count_kv"),
            "head_dim": head_dim,
            "rope_theta": self._arch("rope.freq_base"),
            "partial_rotary_factor": self._arch("rope.dimension_count") / head_dim,
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon"),
            "linear_num_key_heads": self._arch("ssm.group_count"),
            "linear_num_value_heads": v_heads,
            "linear_key_head_dim": self._arch("ssm.state_size"),
            "linear_value_head_dim": self._arch("ssm.inner_size") // v_heads,
            "linear_conv_kernel_dim": self._arch("ssm.conv_kernel"),
            "intermediate_size": self._arch("feed_forward_length", 0),
            "max_position_embeddings": self._arch("context_length", 262144),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "mtp_num_hidden_layers": mtp,
        }
        if "tokenizer.ggml.eos_token_id" in self.fields:
            raw["eos_token_id"] = self._optional("tokenizer.ggml.eos_token_id")
        if self.arch != "qwen35":
            raw.update(num_experts=self._arch("expert_count"), num_experts_per_tok=self._arch("expert_used_count"),
                       moe_intermediate_size=self._arch("expert_feed_forward_length"),
                       shared_expert_intermediate_size=self._arch("expert_shared_feed_forward_length"),
                       norm_topk_prob=True)
        return raw

    def _layer_types(self, layers: int) -> list[str]:
        recurrent = self._arch("attention.recurrent_layers", [])
        if recurrent:
            return [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers]]
        interval = self._arch("full_attention_interval", 4)
        return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]

    # ---- tensors

    def _check_types(self) -> None:
        for tensor in self.tensors.values():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(t.name for t in SUPPORTED_TYPES)
                raise CheckpointError(self.path, f"tensor {tensor.name} is {tensor.tensor_type.name}, a block type duet "
                                                 f"does not read; supported: {supported}")

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise CheckpointError(self.path, f"tensor {name} is missing; the file is not a complete {self.arch} GGUF")
        return self.tensors[name]

    def _shape(self, name: str) -> tuple[int, ...]:
        """numpy order (the reverse of GGUF's ne), trailing ones of ne dropped."""
        dims = [int(d) for d in self._tensor(name).shape]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        return tuple(reversed(dims))

    def _float(self, name: str, expert: int | None = None) -> np.ndarray:
        """A tensor (or one expert's slice of a stacked one) as fp32 in numpy order."""
        tensor, shape = self._tensor(name), self._shape(name)
        data = tensor.data.reshape(*shape[:-1], -1)
        if expert is not None:
            data, shape = data[expert], shape[1:]
        if tensor.tensor_type == GGMLQuantizationType.F32:
            return np.array(data, dtype=np.float32)
        if tensor.tensor_type == GGMLQuantizationType.F16:
            return data.astype(np.float32)
        if tensor.tensor_type == GGMLQuantizationType.BF16:
            return bf16_to_f32(np.ascontiguousarray(data).view(np.uint16)).reshape(shape)
        return BlockMatrix(tensor.tensor_type, data.reshape(-1, data.shape[-1]), shape[-1]).dequantize().reshape(shape)

    def _matrix(self, name: str, expert: int | None = None):
        """A 2-D weight (one expert's slice of a stacked one): fp32 array, or BlockMatrix of the file's blocks."""
        tensor = self._tensor(name)
        if tensor.tensor_type not in CODECS:
            return self._float(name, expert)
        raw = tensor.data if expert is None else tensor.data[expert]
        return BlockMatrix(tensor.tensor_type, raw, self._shape(name)[-1])

    def _entries(self) -> dict[str, Entry]:
        c = self.config
        out: dict[str, Entry] = {}

        def add(hf: str, source: str, shape, load, quantized=False, share=1):
            out[hf] = Entry(source, tuple(shape), self._tensor(source).n_bytes // share, quantized, load)

        def matrix(hf: str, source: str, expert: int | None = None, rows=None, columns=None):
            shape = self._shape(source)[-2:] if expert is not None else self._shape(source)
            quantized = self._tensor(source).tensor_type in CODECS
            if rows is not None:
                shape = (len(rows), shape[1])
            share = c.num_experts if expert is not None else 1

            def load():
                weight = self._matrix(source, expert)
                if rows is not None:
                    weight = weight[rows] if isinstance(weight, np.ndarray) else weight.take_rows(rows)
                if columns is not None:
                    weight = InputOrder(weight, columns)
                return weight

            add(hf, source, shape, load, quantized, share)

        def vector(hf: str, source: str, transform=lambda v: v, shape=None):
            add(hf, source, shape or self._shape(source), lambda: transform(self._float(source)))

        def norm(hf: str, source: str):
            vector(hf, source, lambda w: w - np.float32(1))  # stored 1 + w

        p = "model."
        matrix(p + "embed_tokens.weight", "token_embd.weight")  # quantized: rows dequantized on lookup
        norm(p + "norm.weight", "output_norm.weight")
        if not c.tie_word_embeddings:
            matrix("lm_head.weight", "output.weight")
        for i, kind in enumerate(c.layer_types):
            self._layer(f"{p}layers.{i}.", f"blk.{i}.", kind, c.moe_layers[i], matrix, vector, norm)
        if c.mtp_num_hidden_layers:
            n = f"blk.{c.num_hidden_layers}."
            matrix("mtp.fc.weight", n + "nextn.eh_proj.weight")
            norm("mtp.pre_fc_norm_embedding.weight", n + "nextn.enorm.weight")
            norm("mtp.pre_fc_norm_hidden.weight", n + "nextn.hnorm.weight")
            norm("mtp.norm.weight", n + "nextn.shared_head_norm.weight")
            self._layer("mtp.layers.0.", n, FULL_ATTENTION, c.is_moe, matrix, vector, norm)
        return out

    def _layer(self, p: str, b: str, kind: str, moe: bool, matrix, vector, norm) -> None:
        c = self.config
        norm(p + "input_layernorm.weight", b + "attn_norm.weight")
        norm(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight")
        if kind == FULL_ATTENTION:
            a = p + "self_attn."
            for hf, source in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                matrix(f"{a}{hf}.weight", f"{b}{source}.weight")
            norm(a + "q_norm.weight", b + "attn_q_norm.weight")
            norm(a + "k_norm.weight", b + "attn_k_norm.weight")
        else:
            self._deltanet(p + "linear_attn.", b, matrix, vector)
        m = p + "mlp."
        if not moe:
            for hf, source in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                matrix(f"{m}{hf}.weight", f"{b}{source}.weight")
            return
        matrix(m + "gate.weight", b + "ffn_gate_inp.weight")
        for e in range(c.num_experts):
            for hf, source in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                matrix(f"{m}experts.{e}.{hf}.weight", f"{b}{source}.weight", expert=e)
        for hf, source in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
            matrix(f"{m}shared_expert.{hf}.weight", f"{b}{source}.weight")
        vector(m + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight", lambda w: w.reshape(1, -1),
               shape=(1, c.hidden_size))

    def _deltanet(self, d: str, b: str, matrix, vector) -> None:
        c = self.config
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        tiled = self.arch in TILED_V_HEADS and hv != hk
        heads = grouped_to_stored_heads(hk, hv) if tiled else np.arange(hv)
        v_rows = head_rows(heads, dv)
        qkv_rows = np.concatenate([np.arange(2 * hk * dk), 2 * hk * dk + v_rows])
        matrix(d + "in_proj_qkv.weight", b + "attn_qkv.weight", rows=qkv_rows)
        matrix(d + "in_proj_z.weight", b + "attn_gate.weight", rows=v_rows)
        if self.arch == "qwen3next":
            r = hv // hk
            per_key_head = np.arange(2 * hv).reshape(hk, 2 * r)  # [b r | a r] per key head
            matrix(d + "in_proj_b.weight", b + "ssm_ba.weight", rows=per_key_head[:, :r].ravel())
            matrix(d + "in_proj_a.weight", b + "ssm_ba.weight", rows=per_key_head[:, r:].ravel())
        else:
            matrix(d + "in_proj_b.weight", b + "ssm_beta.weight", rows=heads)
            matrix(d + "in_proj_a.weight", b + "ssm_alpha.weight", rows=heads)
        vector(d + "conv1d.weight", b + "ssm_conv1d.weight", lambda w: w[qkv_rows][:, None, :],
               shape=(len(qkv_rows), 1, c.linear_conv_kernel_dim))
        vector(d + "A_log", b + "ssm_a", lambda a: np.log(-a[heads]))  # stored -exp(A_log)
        vector(d + "dt_bias", b + "ssm_dt.bias", lambda v: v[heads])
        vector(d + "norm.weight", b + "ssm_norm.weight")
        # ssm_out's input columns are value heads in stored order: gather the model's grouped heads into it.
        columns = head_rows(stored_to_grouped_heads(heads), dv) if tiled else None
        matrix(d + "out_proj.weight", b + "ssm_out.weight", columns=columns)


class QuantizedView:
    """The quantized matrices of a GGUFCheckpoint, as TensorPlan's `quantized` reads them."""

    def __init__(self, ckpt: GGUFCheckpoint):
        self.ckpt = ckpt

    def __contains__(self, name: str) -> bool:
        entry = self.ckpt.entries.get(name)
        return entry is not None and entry.quantized

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        entry = self.ckpt.entries[name]
        if entry.shape != shape:
            raise CheckpointError(self.ckpt.path, f"tensor {entry.source} holds {list(entry.shape)} for {name}, "
                                                  f"the metadata implies {list(shape)}")

    def nbytes(self, name: str) -> int:
        return self.ckpt.entries[name].nbytes

    def read(self, name: str):
        return self.ckpt.entries[name].load()


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


def open_gguf(path: Path) -> GGUFReader:
    """GGUFReader, with a truncated or malformed file reported as one line."""
    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise CheckpointError(path, "file not found; pass --model with a .gguf file") from None
    except ValueError as error:
        if "GGMLQuantizationType" in str(error):
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise CheckpointError(path, f"a tensor has an unknown block type ({error}); supported: {supported}") from None
        raise CheckpointError(path, f"cannot be read as GGUF ({error}); the file is truncated or corrupt, "
                                    "download it again") from None
    except (IndexError, KeyError, OSError) as error:
        raise CheckpointError(path, f"cannot be read as GGUF ({type(error).__name__}); the file is truncated "
                                    "or corrupt, download it again") from None
    return reader

