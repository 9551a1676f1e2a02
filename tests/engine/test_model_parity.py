"""Our numpy forward against transformers on CPU, live, for every supported model type."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import add_random_mtp_head, build_reference, save_reference, split_fused_experts
from duet.engine import GenerateOptions, Tokens, generate, load_model
from duet.engine.backend import MAX_ROWS
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint

# Flash-Next's QSA scores tie at 0 often; transformers' top-k picks among ties by accident (conftest.stable_topk)
pytestmark = pytest.mark.usefixtures("stable_topk")
PROMPT_LEN = 150  # more than two DeltaNet chunks (64 in transformers, 32 in ours), a multiple of neither
DECODE_STEPS = 24

CASES = [
    ("qwen3_5_text", False, False),
    ("qwen3_5_text", True, False),  # tied head
    ("qwen3_5", False, False),  # multimodal: text_config nested, vision tower present but unread
    ("qwen3_5_moe_text", False, False),  # fused experts
    ("qwen3_5_moe_text", True, True),  # per-expert tensors, tied
    ("qwen3_5_moe", False, True),  # multimodal MoE
    ("qwen3_next", False, True),  # fused in_proj_qkvz / in_proj_ba, per-expert, a dense layer
    ("qwen4_exp_text", False, True),  # Flash-Next: hyper-connections, PLE n-grams, QSA; saved per expert
    ("qwen4_exp", True, True),  # multimodal Flash-Next, tied
]


def reference_logits(ref, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(ids)[None]).logits[0].float().numpy()


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    scale = np.abs(theirs).max()
    assert scale > 1.0, "reference logits too flat to compare"
    assert np.abs(ours - theirs).max() <= 1e-3 * scale


def load_ours(model_dir):
    return load_model(model_dir, tokenizer=False, backend="cpu").model


@pytest.mark.parametrize("kind,tie,per_expert", CASES)
def test_prefill_and_decode_logits_match_transformers(tmp_path, kind, tie, per_expert):
    ref = build_reference(kind, tie=tie, seed=3)
    save_reference(ref, tmp_path, with_tokenizer=False)
    if per_expert:
        split_fused_experts(tmp_path)
    model = load_ours(tmp_path)
    ids = np.random.default_rng(1).integers(0, ref.config.get_text_config().vocab_size, PROMPT_LEN + DECODE_STEPS)
    ids[[40, 41, 90, PROMPT_LEN + 3]] = 2  # <|im_end|>: Flash-Next's n-gram history stops at it
    expected = reference_logits(ref, ids)

    state = model.new_state()
    prefill = model.logits(model.forward(state, ids[:PROMPT_LEN]))
    assert_close(prefill, expected[:PROMPT_LEN])
    for i in range(PROMPT_LEN, len(ids)):
        step = model.logits(model.forward(state, ids[i : i + 1]))[0]
        assert_close(step, expected[i])


@pytest.mark.parametrize("kind,layers", [("qwen3_5_text", 5), ("qwen3_5_text", 4), ("qwen3_5_moe_text", 4),
                                         ("qwen4_exp_text", 4), ("qwen4_exp_text", 5)],
                         ids=["deltanet-last", "attention-last", "moe-attention-last", "flash-qsa-last", "flash-deltanet-last"])
@pytest.mark.parametrize("prompt_len", [9, PROMPT_LEN], ids=["rows", "chunked"])
def test_a_prefill_of_the_last_row_only_matches_and_leaves_the_same_caches(tmp_path, kind, layers, prompt_len):
    ref = build_reference(kind, seed=5, num_hidden_layers=layers)
    save_reference(ref, tmp_path, with_tokenizer=False)
    model = load_ours(tmp_path)
    ids = np.random.default_rng(2).integers(0, ref.config.get_text_config().vocab_size, prompt_len + 4)
    expected = reference_logits(ref, ids)

    every, last = model.new_state(), model.new_state()
    every_row = model.forward(every, ids[:prompt_len])
    last_row = model.forward(last, ids[:prompt_len], last_only=True)
    assert last_row.shape == (1, every_row.shape[1])  # [1, H]; Flash-Next's streams [1, hc * H]
    assert_close(model.logits(last_row)[0], expected[prompt_len - 1])
    if prompt_len <= MAX_ROWS:  # each row computed on its own either way
        assert np.array_equal(last_row, every_row[-1:])
    for i in range(prompt_len, len(ids)):  # every cache took every row: the steps after agree bit for bit
        step = model.logits(model.forward(last, ids[i : i + 1]))
        assert np.array_equal(step, model.logits(model.forward(every, ids[i : i + 1])))
        assert_close(step[0], expected[i])


@pytest.mark.parametrize("kind,seed", [("qwen3_5_text", 5), ("qwen3_next", 5), ("qwen4_exp_text", 6)])
def test_64_greedy_tokens_identical(tmp_path, kind, seed):
    """Greedy generate with the default drafts (n-gram: these have no MTP head), so every verify's
    rollback of DeltaNet, conv, KV (and Flash-Next's PLE and indexer) state is in the comparison."""
    ref = build_reference(kind, seed=seed)
    save_reference(ref, tmp_path)
    lm = load_model(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, 40)]
    ours = []
    for event in generate(lm, prompt, GenerateOptions(max_tokens=64)):
        if isinstance(event, Tokens):
            ours.extend(event.token_ids)
    eos = sorted(lm.tokenizer.eos_ids)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos[0])
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == 64 and len(ours) == 64, "pick a seed whose greedy run does not hit eos"
    assert ours == theirs


def test_vision_tower_is_never_read(tmp_path):
    """Corrupt every vision tensor's bytes: the text model must still load and match."""
    ref = build_reference("qwen3_5", seed=7)
    save_reference(ref, tmp_path, with_tokenizer=False)
    ckpt = SafetensorsCheckpoint(tmp_path)
    visual = [ckpt.info(n) for n in ckpt.names() if n.startswith("model.visual.")]
    assert visual
    with open(tmp_path / "model.safetensors", "r+b") as handle:
        for info in visual:
            handle.seek(info.begin)
            handle.write(b"\xff" * info.nbytes)  # NaN bit patterns
    model = load_ours(tmp_path)
    ids = np.arange(70) % 300
    assert_close(model.logits(model.forward(model.new_state(), ids)), reference_logits(ref, ids))


def test_sharded_checkpoint_matches_single_file(tmp_path):
    ref = build_reference("qwen3_5_text", seed=9)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    model = load_ours(tmp_path / "sharded")
    ids = np.arange(30) % 300
    assert_close(model.logits(model.forward(model.new_state(), ids)), reference_logits(ref, ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints(tmp_path, dtype):
    """bf16/fp16 files are widened to fp32 exactly: compare with the same rounded weights in fp32."""
    ref = build_reference("qwen3_5_text", seed=11)
    ref.to(dtype).save_pretrained(tmp_path)
    ref.to(torch.float32)
    model = load_ours(tmp_path)
    ids = np.arange(80) % 300
    assert_close(model.logits(model.forward(model.new_state(), ids)), reference_logits(ref, ids))


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_mtp_head_matches_a_reference_built_from_transformers_layers(tmp_path, kind):
    """The MTP head: fc([norm_e(embed(x_{t+1})); norm_h(h_t)]) -> full-attention layer -> norm -> lm_head;
    a MoE model's MTP layer is a MoE layer (routed experts and the gated shared expert).

    transformers ignores mtp.*, so the reference is assembled from its own Qwen3_5 layer classes.
    """
    ref = build_reference(kind, seed=13)
    ref.save_pretrained(tmp_path)
    parts = add_random_mtp_head(tmp_path, ref, seed=17)
    fc, norms, layer, rotary = parts["fc"], parts["norms"], parts["layer"], parts["rotary"]

    ids = np.random.default_rng(4).integers(0, 300, 90)
    with torch.no_grad():
        hidden = ref.model(torch.tensor(ids)[None]).last_hidden_state  # post final norm
        x = fc(torch.cat([norms["emb"](ref.model.embed_tokens(torch.tensor(ids[1:])[None])), norms["hid"](hidden[:, :-1])], -1))
        positions = torch.arange(1, len(ids))[None]
        mask = torch.full((len(ids) - 1, len(ids) - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=rotary(x, positions), attention_mask=mask, position_ids=positions)
        expected = ref.lm_head(norms["out"](x))[0].numpy()

    model = load_ours(tmp_path)
    assert model.mtp is not None
    main_hidden = model.forward(model.new_state(), ids)
    mtp_state = model.new_mtp_state()
    prefill = model.logits(model.mtp_forward(mtp_state, ids[1:60], main_hidden[:59]))
    steps = [model.logits(model.mtp_forward(mtp_state, ids[i + 1 : i + 2], main_hidden[i : i + 1]))[0]
             for i in range(59, len(ids) - 1)]
    assert_close(np.concatenate([prefill, np.stack(steps)]), expected)
