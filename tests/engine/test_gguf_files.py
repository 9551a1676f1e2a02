"""GGUF files written by llama.cpp's own converter load and match transformers, live.

The files in tests/engine/data were converted from tiny random models (see data/README.md); each
test rebuilds the same transformers model from its seed. The converter stores 2-D weights in f16,
so the reference runs with those weights rounded to f16 too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import add_random_mtp_head, build_reference, moe_fields, randomize, save_reference, tiny_text_config
from engine import load_model

DATA = Path(__file__).parent / "data"


def qwen3_next_reference(seed: int):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.Qwen3NextConfig(**tiny_text_config(), **moe_fields(), decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True)
    model = tf.Qwen3NextForCausalLM(config)
    randomize(model, seed)
    return model.eval()


KEPT_F32 = ("conv1d", "mlp.gate.weight", "shared_expert_gate")  # matrices the converter leaves in f32


def round_matrices_to_f16(*modules) -> None:
    """What `--outtype f16` stores: matrices in f16, except conv taps and router gates."""
    with torch.no_grad():
        for module in modules:
            for name, param in module.named_parameters():
                if param.ndim >= 2 and not any(part in name for part in KEPT_F32):
                    param.copy_(param.half().float())


def logits(ref, ids) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(ids)[None]).logits[0].numpy()


def assert_close(ours, theirs, rel=2e-3):
    assert np.abs(ours - theirs).max() <= rel * np.abs(theirs).max()


@pytest.mark.parametrize("name,build", [
    ("llamacpp_qwen35moe_f16.gguf", lambda: build_reference("qwen3_5_moe_text", seed=21)),
    ("llamacpp_qwen3next_f16.gguf", lambda: qwen3_next_reference(21)),
])
def test_llamacpp_moe_files_match_transformers(name, build):
    ref = build()
    round_matrices_to_f16(ref)
    lm = load_model(DATA / name)
    ids = np.random.default_rng(1).integers(0, 320, 90)
    ours = lm.model.logits(lm.model.forward(lm.model.new_state(), ids))
    assert_close(ours, logits(ref, ids))
    assert lm.route == "bf16" and lm.routes == ("bf16",)


def test_llamacpp_qwen35_file_with_mtp_matches_transformers(tmp_path):
    """Hv > Hk, so V heads are tiled in the file; the MTP head is block n_layer's nextn tensors."""
    ref = build_reference("qwen3_5_text", seed=21)
    save_reference(ref, tmp_path)
    parts = add_random_mtp_head(tmp_path, ref, seed=22)
    round_matrices_to_f16(ref, parts["fc"], parts["layer"])
    lm = load_model(DATA / "llamacpp_qwen35_mtp_f16.gguf")
    model = lm.model
    ids = np.random.default_rng(4).integers(0, 300, 70)
    hidden = model.forward(model.new_state(), ids)
    assert_close(model.logits(hidden), logits(ref, ids))

    fc, norms, layer, rotary = parts["fc"], parts["norms"], parts["layer"], parts["rotary"]
    with torch.no_grad():
        h = ref.model(torch.tensor(ids)[None]).last_hidden_state
        x = fc(torch.cat([norms["emb"](ref.model.embed_tokens(torch.tensor(ids[1:])[None])), norms["hid"](h[:, :-1])], -1))
        positions = torch.arange(1, len(ids))[None]
        mask = torch.full((len(ids) - 1, len(ids) - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions)
        expected = ref.lm_head(norms["out"](x))[0].numpy()
    mtp = model.logits(model.mtp_forward(model.new_mtp_state(), ids[1:], hidden[:-1]))
    assert_close(mtp, expected)


def test_tokenizer_and_template_from_gguf_metadata(tmp_path):
    """tokenizer.ggml.* rebuilds the tokenizer the converter read: same ids, stop tokens, chat template."""
    from engine.tokenizer import Tokenizer

    save_reference(build_reference("qwen3_5_text", seed=21), tmp_path)
    original = Tokenizer.from_dir(tmp_path)
    ours = load_model(DATA / "llamacpp_qwen35_mtp_f16.gguf").tokenizer
    chat = [{"role": "user", "content": "the lazy dog runs far away from home"}]
    text = original.render_chat(chat)
    assert ours.render_chat(chat) == text
    assert ours.encode(text) == original.encode(text)
    assert ours.eos_ids == original.eos_ids and ours.eos_token == "<|im_end|>"
    assert ours.decode(ours.encode(text)) == text
