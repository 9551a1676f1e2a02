"""The bundled demo model: parity with transformers, a trained MTP head, the default, bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from duet.app.cli import main
from duet.app.settings import bundled_demo_model
from duet.engine import Finished, GenerateOptions, Tokens, generate, load_model

HELD_OUT = json.loads((Path(__file__).parents[1] / "data" / "demo_heldout.json").read_text())["texts"]


@pytest.fixture(scope="module")
def demo():
    return load_model(bundled_demo_model())


def test_logits_match_transformers(demo):
    from transformers import Qwen3_5ForCausalLM

    ref = Qwen3_5ForCausalLM.from_pretrained(bundled_demo_model(), dtype=torch.float32).eval()
    ids = demo.tokenizer.encode(HELD_OUT[0])[:150]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    state = demo.model.new_state()
    prefill = demo.model.logits(demo.model.forward(state, ids[:100]))
    steps = [demo.model.logits(demo.model.forward(state, ids[i : i + 1]))[0] for i in range(100, len(ids))]
    ours = np.concatenate([prefill, np.stack(steps)])
    assert np.abs(ours - expected).max() <= 1e-3 * np.abs(expected).max()


def test_mtp_first_draft_agrees_with_the_greedy_token_on_held_out_text(demo):
    """Teacher-forced: MTP's draft for x_{t+2} from (x_{t+1}, h_t) against the model's argmax at t+1."""
    model = demo.model
    agree = total = 0
    for text in HELD_OUT[:12]:
        ids = demo.tokenizer.encode(text)[:256]
        hidden = model.forward(model.new_state(), ids)
        greedy = np.argmax(model.logits(hidden), axis=-1)  # greedy[t] predicts x_{t+1}
        drafts = np.argmax(model.logits(model.mtp_forward(model.new_mtp_state(), ids[1:], hidden[:-1])), axis=-1)
        agree += int(np.sum(drafts[:-1] == greedy[1:-1]))  # drafts[t] predicts x_{t+2}, as greedy[t + 1]
        total += len(drafts) - 1
    assert agree / total >= 0.40


def test_greedy_mtp_drafts_commit_more_than_1_4_tokens_a_cycle_and_change_nothing(demo):
    prompts = ["And God said unto Moses,", "Blessed are the poor in spirit:"]
    for prompt in prompts:
        ids = demo.tokenizer.encode(demo.tokenizer.render_chat([{"role": "user", "content": prompt}]))
        runs = {}
        for draft in ("none", "mtp"):
            events = list(generate(demo, ids, GenerateOptions(max_tokens=64, draft=draft)))
            tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
            runs[draft] = (tokens, events[-1])
        assert runs["mtp"][0] == runs["none"][0]
        finished = runs["mtp"][1]
        assert isinstance(finished, Finished) and finished.stats.tokens_per_cycle > 1.4


def test_headless_without_model_uses_the_demo(capsys):
    capsys.readouterr()
    assert main(["--headless", "In the beginning", "--max-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "demo" and result["stats"]["generated_tokens"] >= 1


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_demo_model_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, damage):
    copy = tmp_path / "demo"
    shutil.copytree(bundled_demo_model(), copy)
    weights = copy / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    monkeypatch.setattr("duet.app.headless.bundled_demo_model", lambda: copy)
    capsys.readouterr()
    assert main(["--headless", "In the beginning"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(copy) in err and "Traceback" not in err


@pytest.mark.parametrize("folder,route,max_kl", [
    ("demo_int4", "w4a16", 0.02),
    ("demo_int4", "w4a8", 0.02),
    ("demo_gguf/demo-q8_0.gguf", "w4a8", 0.002),
])
def test_shipped_conversions_keep_the_model(demo, folder, route, max_kl):
    from duet.engine.backend.cpu_ops import softmax

    converted = load_model(bundled_demo_model().parent / folder, route=route)
    assert converted.model.mtp is not None and converted.route == route
    ids = demo.tokenizer.encode(HELD_OUT[1])[:200]
    p = softmax(demo.model.logits(demo.model.forward(demo.model.new_state(), ids)).astype(np.float64))
    q = softmax(converted.model.logits(converted.model.forward(converted.model.new_state(), ids)).astype(np.float64))
    kl = np.sum(p * (np.log(p) - np.log(q)), axis=-1).mean()
    assert 0 < kl < max_kl
