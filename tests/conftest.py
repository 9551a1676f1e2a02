"""Shared factories: tiny random checkpoints written by transformers itself, and a small tokenizer.

Every checkpoint here is produced by the reference implementation (transformers, torch CPU) with
`save_pretrained`, so tests read exactly the files a user would download.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

TINY_VOCAB = 320  # byte-level BPE needs 256 bytes + merges + specials
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_text_config(**overrides) -> dict:
    """A 5-layer hybrid: DeltaNet x3, attention, DeltaNet; Hv > Hk so heads repeat-interleave."""
    config = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    config.update(overrides)
    return config


def moe_fields(**overrides) -> dict:
    fields = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    fields.update(overrides)
    return fields


def flash_fields(**overrides) -> dict:
    """Flash-Next (qwen4_exp) at toy size: 3 residual streams; PLE on DeltaNet layers 1 and 3 (1-based)
    with 2- and 3-grams, two hashed heads each, tables in 4 shards, history cut at <|im_end|>; a QSA
    indexer that reads its 4 best blocks of 4 tokens plus the tail; the DeltaNet gate a sigmoid."""
    fields = dict(moe_fields(), hc_count=3, hc_lowrank=24, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3,
                  heads_per_ngram=2, ngram_vocab_size_base=100, make_ngram_vocab_size_divisible_by=16,
                  split_ngram_parts=4, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                  indexer_compress_ratio=4, eos_token_id=SPECIALS.index("<|im_end|>"), output_gate_type="sigmoid",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    fields.update(overrides)
    return fields


def randomize(model, seed: int) -> None:
    """Weights large enough that logits spread out (the default init makes every logit ~0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.0, 2.5, generator=gen))
            elif "norm" in name:
                param.copy_(torch.empty(param.shape).uniform_(-0.4, 0.4, generator=gen))
            else:
                fan_in = param.shape[-1] if param.ndim > 1 else 1
                param.copy_(torch.randn(param.shape, generator=gen) * (1.2 / fan_in**0.5))


def build_reference(kind: str, tie: bool = False, seed: int = 0, **overrides):
    """A random transformers model of `kind`: qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, qwen3_next,
    qwen4_exp_text, qwen4_exp (Flash-Next, flash_fields)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = tiny_text_config(tie_word_embeddings=tie, **overrides)
    if kind == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    elif kind == "qwen3_5":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
        model = tf.Qwen3_5ForConditionalGeneration(
            tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie))
    elif kind == "qwen3_5_moe":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
        model = tf.Qwen3_5MoeForConditionalGeneration(
            tf.Qwen3_5MoeConfig(text_config={**text, **moe_fields()}, vision_config=vision, tie_word_embeddings=tie))
    elif kind == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **moe_fields()))
    elif kind == "qwen4_exp_text":
        model = tf.Qwen4ExpForCausalLM(tf.Qwen4ExpTextConfig(**{**text, **flash_fields(), **overrides}))
    elif kind == "qwen4_exp":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
        model = tf.Qwen4ExpForConditionalGeneration(
            tf.Qwen4ExpConfig(text_config={**text, **flash_fields(), **overrides}, vision_config=vision, tie_word_embeddings=tie))
    elif kind == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**text, **moe_fields(), decoder_sparse_step=1,
                                                            mlp_only_layers=[1], norm_topk_prob=True))
    else:
        raise ValueError(kind)
    randomize(model, seed)
    return model.eval()


def run_generate(lm, prompt, options, drafter=None):
    """generate() to its end: (every token, the Finished event)."""
    from duet.engine import Tokens, generate

    tokens, finished = [], None
    for event in generate(lm, prompt, options, drafter=drafter):
        if isinstance(event, Tokens):
            tokens.extend(event.token_ids)
        else:
            finished = event
    return tokens, finished


def split_fused_experts(model_dir: Path) -> None:
    """Rewrite fused `experts.gate_up_proj`/`down_proj` as per-expert tensors, as hub checkpoints store them."""
    from safetensors.numpy import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    out = {}
    for name, value in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, inner = name[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = np.ascontiguousarray(value[e, :inner])
                out[f"{base}{e}.up_proj.weight"] = np.ascontiguousarray(value[e, inner:])
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = np.ascontiguousarray(value[e])
        else:
            out[name] = value
    save_file(out, path, metadata={"format": "pt"})


def write_tokenizer(model_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer trained on a little generated English, with a ChatML template."""
    (model_dir / "tokenizer.json").write_text(_trained_tokenizer(vocab_size))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))


@functools.cache
def _trained_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text, trained once per run (training is deterministic; every model gets the same)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the quick brown fox jumps over lazy dog and then runs far away from home in light".split()
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, 12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok.to_str(pretty=True)  # the bytes Tokenizer.save writes


def add_random_mtp_head(model_dir: Path, ref, seed: int) -> dict:
    """Write a random MTP head into a saved checkpoint, built from transformers' own Qwen3_5 layers (a
    Qwen3_5Moe layer for a MoE model, its experts stored as the trunk's are: fused or one per expert).

    Returns the torch modules (fc, norms, layer, rotary) so a test can compute the reference.
    """
    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35moe

    text = ref.config
    moe = getattr(text, "num_experts", 0) > 0
    config_class, layer_class = ((tf.Qwen3_5MoeTextConfig, q35moe.Qwen3_5MoeDecoderLayer) if moe
                                 else (tf.Qwen3_5TextConfig, q35.Qwen3_5DecoderLayer))
    mtp_config = config_class(**{**text.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    parts = {
        "layer": layer_class(mtp_config, 0),
        "norms": torch.nn.ModuleDict({k: q35.Qwen3_5RMSNorm(text.hidden_size) for k in ("emb", "hid", "out")}),
        "fc": torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False),
    }
    for module in parts.values():
        randomize(module, seed)
    parts["rotary"] = q35.Qwen3_5TextRotaryEmbedding(mtp_config)
    tensors = load_file(model_dir / "model.safetensors")
    trunk_split = moe and not any(name.endswith("experts.gate_up_proj") for name in tensors)
    norms = parts["norms"]
    tensors.update({"mtp.fc.weight": parts["fc"].weight, "mtp.pre_fc_norm_embedding.weight": norms["emb"].weight,
                    "mtp.pre_fc_norm_hidden.weight": norms["hid"].weight, "mtp.norm.weight": norms["out"].weight})
    tensors.update({f"mtp.layers.0.{k}": v for k, v in parts["layer"].state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, model_dir / "model.safetensors",
              metadata={"format": "pt"})
    if trunk_split:
        split_fused_experts(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return parts


def add_random_flash_mtp_head(model_dir: Path, ref, seed: int) -> dict:
    """Write a random Flash-Next MTP head (llama.cpp's qwen4exp layout: mtp.fc_embedding, mtp.fc_hidden,
    mtp.hyper_connection_mixer, one QSA layer) into a saved qwen4_exp checkpoint, built from
    transformers' own Qwen4Exp classes. Returns the torch modules so a test can compute the reference."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen4_exp import modeling_qwen4_exp as q4

    text = ref.config.get_text_config()
    H, hc = text.hidden_size, text.hc_count
    mtp_config = tf.Qwen4ExpTextConfig(**{**text.to_dict(), "num_hidden_layers": 1, "layer_types": ["indexed_attention"],
                                          "ple_layer_ids": []})
    parts = {
        "layer": q4.Qwen4ExpTextDecoderLayer(mtp_config, 0),
        "norm_embedding": q4.Qwen4ExpTextRMSNorm(H),
        "norm_hidden": q4.Qwen4ExpTextRMSNorm(hc * H, group_size=H),
        "fc_embedding": torch.nn.Linear(H, H, bias=False),
        "fc_hidden": torch.nn.Linear(H, H, bias=False),
        "mixer": q4.Qwen4ExpTextGatedResidual(mtp_config, use_combine=False),
    }
    for module in parts.values():
        randomize(module, seed)
    parts["rotary"] = q4.Qwen4ExpTextRotaryEmbedding(mtp_config)
    tensors = load_file(model_dir / "model.safetensors")
    for name in ("norm_embedding", "norm_hidden"):
        tensors[f"mtp.pre_fc_{name}.weight"] = parts[name].weight
    for name in ("fc_embedding", "fc_hidden"):
        tensors[f"mtp.{name}.weight"] = parts[name].weight
    tensors.update({f"mtp.hyper_connection_mixer.{k}": v for k, v in parts["mixer"].state_dict().items()})
    tensors.update({f"mtp.layers.0.{k}": v for k, v in parts["layer"].state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, model_dir / "model.safetensors",
              metadata={"format": "pt"})
    split_fused_experts(model_dir)  # the layer's state_dict has them fused; the trunk was saved per expert
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return parts


def interruptible() -> None:
    """Popen preexec_fn: Ctrl-C on, in the child. A runner started in the background (`cmd &` in a
    script) ignores SIGINT, its children inherit that, and Python then never installs its handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def save_reference(model, model_dir: Path, with_tokenizer: bool = True) -> Path:
    model.save_pretrained(model_dir)
    if with_tokenizer:
        write_tokenizer(model_dir)
    return model_dir


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_model) -> Path:
    """A complete tiny qwen3_5_text folder (weights, config, tokenizer): what the CLI loads. A fresh
    copy of `tiny_model` (the same seed), free to damage, without building the model again."""
    return Path(shutil.copytree(tiny_model, tmp_path / "tiny"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The same tiny model built once per run, for tests that only read it."""
    return save_reference(build_reference("qwen3_5_text"), tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def endless_model(tiny_model, tmp_path_factory):
    """The tiny model without a stop token: its replies run to max_tokens unless stopped."""
    folder = tmp_path_factory.mktemp("endless") / "endless"
    shutil.copytree(tiny_model, folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.fixture
def stable_topk(monkeypatch):
    """torch's top-k with ties broken toward the lower index, as duet breaks them. Which of equal
    scores torch.topk returns is an accident of its selection algorithm (over 35,895 random tied cases,
    lower index first matched its pick in 3,794, higher first in 3,133), and QSA's relu-summed block
    scores tie at 0 often
    (a block every indexer head scores below 0): the block chosen at a tie is the model's undefined
    choice, not a numerical difference, so a parity test fixes it on both sides."""
    import torch

    def topk(input, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    monkeypatch.setattr(torch, "topk", topk)
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, k, dim=-1, largest=True, sorted=True: topk(self, k, dim, largest))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(params=["compiled", "numpy"])
def sampler_path(request, monkeypatch):
    """Run a test on the sampler's compiled kernels (engine/backend/compiled_sampling.py, the default)
    and again on engine/sampling.py's numpy code, the reference they reproduce."""
    import duet.engine.sampling as sampling

    if request.param == "numpy":
        monkeypatch.setattr(sampling, "_compiled", None)
    return request.param
