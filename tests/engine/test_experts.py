"""Routed experts between card and RAM (engine/experts.py), on a tiny Flash-Next with 7 of 12 experts
routed a token: the hit rate is the share of transformers' own routes that land on the card, the
census counts transformers' routes, `--moe-skip` skips exactly the routes its rule names (checked
by a transformers run whose experts skip them), and exact acceptance refuses it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build_reference, save_reference
from duet.app.cli import main
from duet.engine import DuetError, GenerateOptions, Tokens, generate, load_model
from duet.engine.errors import CheckpointError
from duet.engine.experts import CENSUS_FILE, FIRST_ROUTES_KEPT, take_census

pytestmark = pytest.mark.usefixtures("stable_topk")  # the router's and QSA's ties picked as ours
EXPERTS, ROUTED, LAYERS = 12, 7, 5


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    ref = build_reference("qwen4_exp_text", seed=31, num_experts=EXPERTS, num_experts_per_tok=ROUTED)
    return ref, save_reference(ref, tmp_path_factory.mktemp("experts") / "m")


def transformers_routes(ref, ids, skip=None):
    """Per layer, the routes (indices [T, k], falling weight) and weights transformers' routers give
    `ids`; with `skip(layer, indices, weights) -> bool [T, k]`, those routes' experts add nothing."""
    routes, hooks = {}, []
    for i, layer in enumerate(ref.model.layers):
        def record(module, args, out, i=i):
            routes[i] = (out[2].numpy(), out[1].numpy())
        hooks.append(layer.mlp.gate.register_forward_hook(record))
        if skip is not None:
            def drop(module, args, i=i):
                hidden, index, weights = args
                return hidden, index, torch.where(torch.from_numpy(skip(i, index.numpy(), weights.numpy())), 0.0, weights)
            hooks.append(layer.mlp.experts.register_forward_pre_hook(drop))
    try:
        with torch.no_grad():
            logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return routes, logits


def test_the_hit_rate_is_the_share_of_routes_on_the_card(moe):
    ref, path = moe
    lm = load_model(path, tokenizer=False)
    routing = lm.place_experts(on_card=25)  # no census: each layer's lowest-numbered experts, 5 or 6 of 12
    assert routing.on_card.sum() == 25 and routing.on_card[:, :5].all() and not routing.on_card[:, 6:].any()
    ids = np.random.default_rng(3).integers(0, 320, 60)
    model = lm.model
    model.forward(model.new_state(), ids)
    routes, _ = transformers_routes(ref, ids)
    on_card = sum(int(routing.on_card[i][index].sum()) for i, (index, _) in routes.items())
    assert routing.hits == on_card and routing.hits + routing.misses == LAYERS * len(ids) * ROUTED
    assert routing.skipped == 0


def test_the_census_counts_transformers_routes_and_chooses_the_card(moe, tmp_path):
    ref, path = moe
    lm = load_model(path)
    text = "the quick brown fox jumps over the lazy dog and then runs far away from home in light " * 4
    ids = lm.tokenizer.encode(text)
    counts, tokens = take_census(lm, ids, chunk=16)  # chunks: every prefill call of the text counts
    routes, _ = transformers_routes(ref, ids)
    expected = np.zeros((LAYERS, EXPERTS), np.int64)
    for i, (index, _) in routes.items():
        np.add.at(expected[i], index.ravel(), 1)
    assert tokens == len(ids) and np.array_equal(counts, expected)

    assert main(["models", "census", str(path), "--text", str(_write(tmp_path / "text.txt", text))]) == 0
    census = json.loads((path / CENSUS_FILE).read_text())
    assert census["tokens"] == len(ids) and census["counts"] == expected.tolist()
    routing = load_model(path, tokenizer=False).place_experts(on_card=20)
    top = np.argsort(-expected.ravel(), kind="stable")[:20]  # the 20 most-routed (layer, expert) pairs
    assert np.array_equal(np.flatnonzero(routing.on_card.ravel()), np.sort(top))
    (path / CENSUS_FILE).unlink()


def test_a_census_of_another_model_is_one_line(moe, tmp_path):
    _, path = moe
    (path / CENSUS_FILE).write_text(json.dumps({"counts": [[1, 2], [3, 4]]}))
    try:
        with pytest.raises(CheckpointError, match=r"census of shape \[2, 2\], this model routes 5 layers of 12 experts"):
            load_model(path, tokenizer=False)
    finally:
        (path / CENSUS_FILE).unlink()


def skipped_by_rule(on_card: np.ndarray, budget: float):
    """The rule, from llamAmpere's words: per row, off-card routes past the first five, lowest router
    weight first, skipped while their summed weight stays within the budget."""
    def skip(layer: int, index: np.ndarray, weights: np.ndarray) -> np.ndarray:
        out = np.zeros(index.shape, bool)
        for row in range(index.shape[0]):
            spent = 0.0
            for slot in reversed(range(FIRST_ROUTES_KEPT, index.shape[1])):
                if on_card[layer, index[row, slot]]:
                    continue
                if spent + weights[row, slot] > budget:
                    break
                spent += weights[row, slot]
                out[row, slot] = True
        return out
    return skip


def test_moe_skip_skips_exactly_the_routes_its_rule_names(moe):
    ref, path = moe
    lm = load_model(path, tokenizer=False)
    routing = lm.place_experts(on_card=20)
    routing.skip_budget = 0.3
    ids = np.random.default_rng(5).integers(0, 320, 50)
    ours = lm.model.logits(lm.model.forward(lm.model.new_state(), ids))
    named = []
    rule = skipped_by_rule(routing.on_card, 0.3)
    routes, theirs = transformers_routes(ref, ids, skip=lambda i, index, w: named.append(rule(i, index, w)) or named[-1])
    _, unskipped = transformers_routes(ref, ids)
    assert routing.skipped == sum(int(s.sum()) for s in named) > 0
    assert np.abs(ours - theirs).max() <= 1e-3 * np.abs(theirs).max()  # the same routes dropped on both sides
    assert np.abs(theirs - unskipped).max() > 0.01 * np.abs(theirs).max()  # and dropping them shows


def test_moe_skip_is_lossy_counted_and_refused_under_exact(moe, capsys):
    _, path = moe
    with pytest.raises(DuetError, match="runs under lossy acceptance only"):
        GenerateOptions(moe_skip=0.2)
    assert main(["--headless", "fox", "--model", str(path), "--moe-skip", "0.2", "--max-tokens", "4"]) == 2
    assert "runs under lossy acceptance only" in capsys.readouterr().err
    lm = load_model(path)
    lm.place_experts(on_card=20)
    prompt = lm.tokenizer.encode("the quick brown fox")
    finished = [e for e in generate(lm, prompt, GenerateOptions(max_tokens=12, draft="none", accept="lossy", moe_skip=0.3))
                if not isinstance(e, Tokens)][0]
    stats = finished.stats.to_dict()
    assert stats["n_skipped"] > 0 and 0 < stats["expert_hit_rate"] < 1 and stats["host_bytes_per_token"] > 0
    assert main(["--headless", "fox", "--model", str(path), "--moe-skip", "0.3", "--accept", "lossy", "--max-tokens", "6",
                 "--json"]) == 0
    assert {"expert_hit_rate", "host_bytes_per_token", "n_skipped"} <= set(json.loads(capsys.readouterr().out)["stats"])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_census_of_the_users_own_chats(moe, tmp_path, monkeypatch):
    """`--chats`: every saved conversation, rendered with the model's chat template, is what it counts."""
    from duet.app.settings import user_paths
    from duet.app.store import Store

    ref, path = moe
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    paths = user_paths()
    paths.database.parent.mkdir(parents=True, exist_ok=True)
    store = Store(paths.database)
    chat = [("user", "the quick brown fox"), ("assistant", "jumps over the lazy dog")]
    conversation = store.create_conversation("fox")
    for role, text in chat:
        store.add_message(conversation.id, role, text, model="m")
    store.close()
    assert main(["models", "census", str(path), "--chats"]) == 0
    tokenizer = load_model(path).tokenizer
    ids = tokenizer.encode(tokenizer.render_chat([{"role": r, "content": t} for r, t in chat], add_generation_prompt=False))
    routes, _ = transformers_routes(ref, ids)
    expected = np.zeros((LAYERS, EXPERTS), np.int64)
    for i, (index, _) in routes.items():
        np.add.at(expected[i], index.ravel(), 1)
    census = json.loads((path / CENSUS_FILE).read_text())
    (path / CENSUS_FILE).unlink()
    assert census["tokens"] == len(ids) and census["counts"] == expected.tolist()
