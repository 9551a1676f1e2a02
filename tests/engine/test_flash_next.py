"""Flash-Next (qwen4_exp) against transformers' qwen4_exp on tiny random configs: geometry variants,
the MTP head (built from transformers' own Qwen4Exp layer classes, which have no MTP), the caches a
verify rolls back, and the refusals for bad files. Parity of the common cases, greedy generation and
rollback sit with the other model types in test_model_parity.py and test_speculative.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import add_random_flash_mtp_head, build_reference, save_reference
from conftest import run_generate as run
from duet.engine import GenerateOptions, load_model
from duet.engine.config import ModelConfig
from duet.engine.errors import CheckpointError

EOS = 2  # <|im_end|>, the n-gram history's stop (conftest.flash_fields)
pytestmark = pytest.mark.usefixtures("stable_topk")  # QSA's tied block scores: the same pick on both sides


def logits_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Within 1e-3 of the logit scale: fp32 sums in another order through a few layers."""
    scale = np.abs(theirs).max()
    assert scale > 1.0, "reference logits too flat to compare"
    assert np.abs(ours - theirs).max() <= 1e-3 * scale


def prompt_ids(length: int, vocab: int, seed: int) -> np.ndarray:
    """Random ids with EOS at a few places, one of them twice in a row."""
    ids = np.random.default_rng(seed).integers(0, vocab, length)
    ids[[length // 4, length // 4 + 1, length // 2, length - 5]] = EOS
    return ids


@pytest.mark.parametrize("overrides", [
    dict(hc_count=2, ple_layer_ids=[2]),  # two streams, PLE on one layer
    dict(hc_count=4, ple_layer_ids=[1, 3], ngram_size=4, ple_embed_dim=48),  # 2-, 3- and 4-grams
    dict(hc_count=3, ple_layer_ids=[], num_experts_per_tok=3),  # no PLE at all
    dict(indexer_budget=8, indexer_compress_ratio=2, indexer_n_heads=2),  # many small blocks, few read
], ids=["hc2-one-ple", "hc4-4grams", "no-ple", "small-blocks"])
def test_prefill_and_decode_match_transformers_across_geometries(tmp_path, overrides):
    ref = build_reference("qwen4_exp_text", seed=3, **overrides)
    save_reference(ref, tmp_path, with_tokenizer=False)
    model = load_model(tmp_path, tokenizer=False, backend="cpu").model
    ids = prompt_ids(110, ref.config.vocab_size, seed=1)  # several times the QSA budget
    with torch.no_grad():
        expected = ref(torch.tensor(ids)[None]).logits[0].numpy()
    state = model.new_state()
    logits_close(model.logits(model.forward(state, ids[:90])), expected[:90])
    for i in range(90, len(ids)):
        logits_close(model.logits(model.forward(state, ids[i : i + 1]))[0], expected[i])


def trunk_streams(ref, ids: np.ndarray) -> torch.Tensor:
    """transformers' hc-wide residual after the last layer (the input of its head mixer)."""
    seen = {}
    hook = ref.model.hyper_connection_mixer.register_forward_hook(lambda module, args, out: seen.update(x=args[0]))
    try:
        ref(torch.tensor(ids)[None])
    finally:
        hook.remove()
    return seen["x"]


def test_mtp_head_matches_a_reference_built_from_transformers_layers(tmp_path):
    """Per stream s: fc_embedding(norm_e(embed(x_{t+1}))) + fc_hidden(norm_h(h_t)_s), a QSA layer at
    positions t + 1, the MTP's own mixer, the shared head (llama.cpp's qwen4exp MTP graph)."""
    ref = build_reference("qwen4_exp_text", seed=13)
    save_reference(ref, tmp_path, with_tokenizer=False)
    parts = add_random_flash_mtp_head(tmp_path, ref, seed=17)
    hc, H = ref.config.hc_count, ref.config.hidden_size
    ids = prompt_ids(90, ref.config.vocab_size, seed=4)
    T = len(ids) - 1
    with torch.no_grad():
        streams = trunk_streams(ref, ids)[:, :-1]  # h_t for t < T
        e = parts["fc_embedding"](parts["norm_embedding"](ref.model.embed_tokens(torch.tensor(ids[1:])[None])))
        h = parts["fc_hidden"](parts["norm_hidden"](streams).unflatten(-1, (hc, H)))
        x = (h + e[:, :, None, :]).flatten(-2)
        positions = torch.arange(1, T + 1)[None, None].expand(3, 1, T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = parts["layer"](x, position_embeddings=parts["rotary"](x, positions), attention_mask=mask)
        expected = ref.lm_head(parts["mixer"](x))[0].numpy()

    model = load_model(tmp_path, tokenizer=False, backend="cpu").model
    assert model.mtp is not None
    main = model.forward(model.new_state(), ids)  # the streams, [len(ids), hc * H]
    state = model.new_mtp_state()
    prefill = model.draft_logits(model.mtp_forward(state, ids[1:60], main[:59]))
    steps = [model.draft_logits(model.mtp_forward(state, ids[i + 1 : i + 2], main[i : i + 1]))[0]
             for i in range(59, T)]
    logits_close(np.concatenate([prefill, np.stack(steps)]), expected)


def test_greedy_replies_with_mtp_ngram_and_no_drafts_are_transformers_reply(tmp_path):
    ref = build_reference("qwen4_exp_text", seed=6)
    save_reference(ref, tmp_path)
    add_random_flash_mtp_head(tmp_path, ref, seed=8)
    lm = load_model(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, 40)]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=[EOS],
                           pad_token_id=EOS)
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) == 64, "pick a seed whose greedy run does not hit eos"
    for draft in ("none", "ngram", "mtp"):
        ours, finished = run(lm, prompt, GenerateOptions(max_tokens=64, draft=draft))
        assert ours == theirs, draft
        assert draft == "none" or finished.stats.drafted > 0


def test_greedy_with_drafts_is_greedy_without_on_the_q4_cache(tmp_path):
    """Every verify rolls back the 4-bit KV rows, the indexer's keys and blocks, PLE's history and conv."""
    ref = build_reference("qwen4_exp_text", seed=6)
    save_reference(ref, tmp_path)
    add_random_flash_mtp_head(tmp_path, ref, seed=8)
    lm = load_model(tmp_path)
    prompt = [5, 6, 7, 8, 9] * 8  # repetitive: n-gram drafts find matches
    plain, _ = run(lm, prompt, GenerateOptions(max_tokens=48, draft="none", kv="q4"))
    for draft in ("ngram", "mtp"):
        drafted, finished = run(lm, prompt, GenerateOptions(max_tokens=48, draft=draft, kv="q4"))
        assert drafted == plain and finished.stats.drafted > 0, draft


# ---------------------------------------------------------------------------------------------
# Bad files: one line naming what is wrong, before a weight is read


@pytest.fixture(scope="module")
def flash_reference():
    """The transformers model flash_dir holds (read it only: tests share it)."""
    return build_reference("qwen4_exp_text", seed=3)


@pytest.fixture(scope="module")
def flash_dir(flash_reference, tmp_path_factory):
    return save_reference(flash_reference, tmp_path_factory.mktemp("flash") / "m", with_tokenizer=False)


def damaged(flash_dir, tmp_path, change) -> Path:
    """A copy of the checkpoint whose tensors (a dict by name) change(tensors) edits."""
    from safetensors.numpy import load_file, save_file

    folder = Path(shutil.copytree(flash_dir, tmp_path / "damaged"))
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_a_missing_ngram_shard_is_named(flash_dir, tmp_path):
    name = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_3.weight"
    folder = damaged(flash_dir, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as error:
        load_model(folder, tokenizer=False)
    assert str(error.value) == (f"{folder}: tensor {name} is missing; the n-gram table is stored in 4 shards "
                                "(split_ngram_parts) and the checkpoint is incomplete")


def test_hash_constants_that_reach_outside_the_table_are_refused(flash_dir, tmp_path):
    def grow(tensors):
        tensors["model.layers.0.ple.ple_embedding.ngram_heads_vocab_sizes"][-1] += 10_000

    with pytest.raises(CheckpointError, match="vocabularies run outside the table's 432 rows"):
        load_model(damaged(flash_dir, tmp_path, grow), tokenizer=False)


def test_hash_constants_stored_as_floats_are_refused(flash_dir, tmp_path):
    """llama.cpp's converter notes how float32 would round the 45-bit multipliers: never accept them."""
    def as_float(tensors):
        key = "model.layers.0.ple.ple_embedding.layer_multipliers"
        tensors[key] = tensors[key].astype(np.float32)

    with pytest.raises(CheckpointError, match=r"layer_multipliers is F32 \[3\], expected I64 \[3\]"):
        load_model(damaged(flash_dir, tmp_path, as_float), tokenizer=False)


@pytest.mark.parametrize("change,needle", [
    (dict(ple_layer_ids=[4]), "ple_layer_ids names a layer that is not linear attention"),
    (dict(ple_layer_ids=[9]), "not a list of layer numbers from 1 to 5"),
    (dict(indexer_n_heads=None), "missing 'indexer_n_heads'"),
    (dict(indexer_budget=10), "indexer_budget is not a multiple of indexer_compress_ratio"),
    (dict(hc_count=1), "'hc_count' is 1, not an integer from 2 to 64"),
    (dict(output_gate_type="gelu"), "output_gate_type 'gelu' is not supported"),
])
def test_bad_flash_next_configs_are_one_line(flash_dir, tmp_path, change, needle):
    folder = Path(shutil.copytree(flash_dir, tmp_path / "bad"))
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle):
        load_model(folder, tokenizer=False)


def test_a_converted_int4_file_keeps_the_tables_and_constants_and_runs(tmp_path):
    """`duet convert` codes the matrices its rule names and copies the n-gram shards and the int64
    constants byte for byte (no format codes a table; float constants would round the multipliers).
    The trellis writer copies them with the same function; trellis-coding this model takes minutes."""
    from duet.app.cli import main
    from duet.engine.checkpoint.safetensors import SafetensorsFile

    dims = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                moe_intermediate_size=128, shared_expert_intermediate_size=128, ple_embed_dim=128, hc_lowrank=32)
    source = save_reference(build_reference("qwen4_exp_text", seed=7, **dims), tmp_path / "source")
    assert main(["convert", str(source), str(tmp_path / "int4"), "--format", "int4"]) == 0
    before, after = SafetensorsFile(source / "model.safetensors"), SafetensorsFile(tmp_path / "int4" / "model.safetensors")
    kept = [name for name in before.tensors if ".ngram_embedding." in name or name.endswith(("_multipliers", "_sizes", "_offsets"))]
    assert len(kept) == 2 * (4 + 3)  # two PLE layers: 4 shards and 3 constants each
    for name in kept:
        assert after.tensors[name].dtype == before.tensors[name].dtype, name
        assert np.array_equal(after.raw(name), before.raw(name)), name
    assert "model.layers.0.attn_hyper_connection.input_mix_weight_down.weight" in after.tensors  # kept 16-bit
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_packed" in after.tensors  # coded
    for route in ("w4a16", "w4a8"):  # numerics: test_route_references.py
        tokens, finished = run(load_model(tmp_path / "int4", route=route), [5, 6, 7, 8, 9] * 4, GenerateOptions(max_tokens=8))
        assert len(tokens) == 8 and finished.stats.routes == [route]


def test_a_quantized_ngram_table_gathers_the_rows_gguf_dequantizes():
    """A GGUF table in blocks (the seed's is 28.8 GB quantized) stays blocks; a lookup dequantizes the rows it reads."""
    import gguf

    from duet.engine.quant.gguf_blocks import BlockMatrix
    from duet.engine.weights import ShardedRows

    rows = np.random.default_rng(0).standard_normal((100, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    table = ShardedRows((BlockMatrix(gguf.GGMLQuantizationType.Q8_0, blocks, 64),), bf16=False)
    ids = np.array([[3, 99], [0, 42]])
    assert table.shape == (100, 64)
    assert np.array_equal(table[ids], gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)[ids])


E0 = "model.layers.0.ple.ple_embedding."
SHARD = E0 + "ngram_embedding.shard_{}.weight"
BAD_TABLES = {  # case: (change to the tensors, the problem the one line ends with)
    "a shard of another width": (lambda t: t.update({SHARD.format(1): t[SHARD.format(1)][:, :4].copy()}),
                                 f"tensor {SHARD.format(1)} is F32 [108, 4]"),
    "a shard without rows": (lambda t: t.update({SHARD.format(2): t[SHARD.format(2)][:0].copy()}),
                             f"tensor {SHARD.format(2)} is F32 [0, 8]"),
    "a shard of one dimension": (lambda t: t.update({SHARD.format(3): t[SHARD.format(3)].ravel().copy()}),
                                 f"tensor {SHARD.format(3)} is F32 [864]"),
    "a shard of integers": (lambda t: t.update({SHARD.format(0): t[SHARD.format(0)].astype(np.int32)}),
                            f"tensor {SHARD.format(0)} is I32 [108, 8]"),
    "a shard of another float type": (lambda t: t.update({SHARD.format(1): t[SHARD.format(1)].astype(np.float16)}),
                                      f"tensor {SHARD.format(1)} is F16 [108, 8]"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_table_shards_that_do_not_belong_together_are_one_exact_line(flash_dir, tmp_path, case):
    change, problem = BAD_TABLES[case]
    folder = damaged(flash_dir, tmp_path, change)
    with pytest.raises(CheckpointError) as error:
        load_model(folder, tokenizer=False)
    assert str(error.value) == (f"{folder / 'model.safetensors'}: {problem}; an n-gram table shard is float [rows, 8], "
                                "all of one type; the files do not belong together")


def test_f16_shards_all_of_one_type_are_read(flash_dir, tmp_path):
    def narrow(tensors):
        for j in range(4):
            tensors[SHARD.format(j)] = tensors[SHARD.format(j)].astype(np.float16)

    assert load_model(damaged(flash_dir, tmp_path, narrow), tokenizer=False).model is not None


def prefill_matches(folder: Path, ref) -> None:
    """duet's prefill logits of `folder` against transformers' model `ref` on the same 60 ids."""
    ids = prompt_ids(60, ref.config.vocab_size, seed=5)
    with torch.no_grad():
        expected = ref(torch.tensor(ids)[None]).logits[0].numpy()
    model = load_model(folder, tokenizer=False, backend="cpu").model
    logits_close(model.logits(model.forward(model.new_state(), ids)), expected)


def test_a_bf16_checkpoint_reads_its_tables_as_bf16(tmp_path):
    """The released Flash-Next is bf16: its n-gram shards are bf16 bits a lookup widens. The reference is
    transformers on the same bf16-rounded weights, run in fp32."""
    from duet.engine.checkpoint.safetensors import SafetensorsFile

    ref = build_reference("qwen4_exp_text", seed=3).to(torch.bfloat16)  # its own: .to() changes the model in place
    folder = save_reference(ref, tmp_path / "bf16", with_tokenizer=False)
    assert SafetensorsFile(folder / "model.safetensors").tensors[SHARD.format(0)].dtype == "BF16"
    prefill_matches(folder, ref.to(torch.float32))


def restack(whole: bool):
    """Each PLE layer's table as one `ngram_embedding.weight`, or as 4 shards of 1, 2, 3 and the rest rows."""
    def change(tensors):
        for layer in (0, 2):
            e = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding."
            table = np.concatenate([tensors.pop(f"{e}shard_{j}.weight") for j in range(4)])
            if whole:
                tensors[e + "weight"] = table
            else:
                for j, rows in enumerate(np.split(table, [1, 3, 6])):
                    tensors[f"{e}shard_{j}.weight"] = rows
    return change


@pytest.mark.parametrize("whole", [True, False], ids=["one-tensor", "shards-of-1-2-3-rows-and-the-rest"])
def test_a_table_stored_whole_or_unevenly_is_read_as_the_shards_are(flash_dir, flash_reference, tmp_path, whole):
    """A checkpoint may keep a layer's n-gram table as one `ngram_embedding.weight` (split_ngram_parts
    names only how HF shards it), or in shards of any sizes: the same rows, the same logits."""
    prefill_matches(damaged(flash_dir, tmp_path, restack(whole)), flash_reference)


BAD_CONSTANTS = {  # case: (tensor, new values, the problem)
    "a head of no rows": ("ngram_heads_vocab_sizes", [101, 0, 107, 109], "vocabularies"),
    "a head before the table": ("ngram_heads_offsets", [-1, 101, 204, 311], "vocabularies"),
    "an even multiplier": ("layer_multipliers", [25912437101140036, 21043097849633001, 26491075874708125], "multipliers"),
    "a multiplier of 0": ("layer_multipliers", [0, 21043097849633001, 26491075874708125], "multipliers"),
    "a negative multiplier": ("layer_multipliers", [-25912437101140037, 21043097849633001, 26491075874708125],
                              "multipliers"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONSTANTS))
def test_hash_constants_a_lookup_cannot_trust_are_one_exact_line(flash_dir, tmp_path, case):
    name, values, what = BAD_CONSTANTS[case]
    folder = damaged(flash_dir, tmp_path, lambda t: t.update({E0 + name: np.array(values, np.int64)}))
    with pytest.raises(CheckpointError) as error:
        load_model(folder, tokenizer=False)
    prefix = f"{folder / 'model.safetensors'}: "
    assert str(error.value) == prefix + {
        "vocabularies": f"{E0.removeprefix('model.')}: the n-gram heads' vocabularies run outside the table's 432 rows; "
                        "the file is corrupt, re-download the model",
        "multipliers": f"{E0.removeprefix('model.')}layer_multipliers are not odd positive integers; the file is corrupt, "
                       "re-download the model"}[what]


def test_the_first_and_the_last_rows_are_lookups_a_table_allows(flash_dir, tmp_path):
    """A head of one row at row 0, and one ending at the last row: both inside the table."""
    def edge(tensors):
        tensors[E0 + "ngram_heads_vocab_sizes"] = np.array([1, 103, 107, 432 - 311], np.int64)
        tensors[E0 + "layer_multipliers"] = np.array([1, 21043097849633001, 26491075874708125], np.int64)

    assert load_model(damaged(flash_dir, tmp_path, edge), tokenizer=False).model is not None


def test_a_missing_constant_is_named(flash_dir, tmp_path):
    folder = damaged(flash_dir, tmp_path, lambda t: t.pop(E0 + "ngram_heads_offsets"))
    with pytest.raises(CheckpointError) as error:
        load_model(folder, tokenizer=False)
    assert str(error.value) == f"{folder}: tensor {E0}ngram_heads_offsets is missing; the checkpoint is incomplete"


def test_n_gram_tables_stay_read_only_maps_of_their_files(flash_dir):
    """A table is gathered from its file's pages, never copied whole, and a model can never write to it."""
    from duet.engine.checkpoint.hf import TensorPlan
    from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
    from duet.engine.weights import ShardedRows

    ckpt = SafetensorsCheckpoint(flash_dir)
    tables = [t for t in TensorPlan(ckpt, ModelConfig.from_file(flash_dir / "config.json")).read_all(None).values()
              if isinstance(t, ShardedRows)]
    assert len(tables) == 2 and all(isinstance(s, np.memmap) and s.mode == "r" and not s.flags.writeable
                                    for table in tables for s in table.shards)
