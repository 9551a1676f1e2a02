"""GGUF files written by llama.cpp's own converter: our name table names what they hold, `duet convert`
writes the same, our reader gives back the source tensors, and the files load and match transformers, live.

The files in tests/engine/data were converted from tiny random models (see data/README.md); each
test rebuilds the same transformers model from its seed. The converter stores 2-D weights in f16,
so the reference runs with those weights rounded to f16 too.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from duet.app.cli import main
from conftest import (add_random_flash_mtp_head, add_random_mtp_head, build_reference, moe_fields, randomize, save_reference,
                      tiny_text_config)
from duet.engine import GenerateOptions, Tokens, generate, load_model
from duet.engine.checkpoint.gguf import GGUFCheckpoint
from duet.engine.checkpoint.gguf_names import GGUF_ARCHITECTURE, gguf_tensors
from duet.engine.checkpoint.headers import read_headers
from duet.engine.checkpoint.hf import TensorPlan, read_weights
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import ModelConfig
from duet.engine.weights import InputOrder, ShardedRows

DATA = Path(__file__).parent / "data"
QWEN35_MTP, QWEN35MOE, QWEN3NEXT = "llamacpp_qwen35_mtp_f16.gguf", "llamacpp_qwen35moe_f16.gguf", "llamacpp_qwen3next_f16.gguf"
QWEN4EXP = "llamacpp_qwen4exp_mtp_f16.gguf"


def flash_next_reference(folder: Path):
    """The Flash-Next model (one PLE layer, MTP) llamacpp_qwen4exp_mtp_f16.gguf was converted from."""
    ref = build_reference("qwen4_exp_text", seed=21, ple_layer_ids=[2])
    save_reference(ref, folder)
    return ref, add_random_flash_mtp_head(folder, ref, seed=22)


def qwen3_next_reference(seed: int):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.Qwen3NextConfig(**tiny_text_config(), **moe_fields(), decoder_sparse_step=1, mlp_only_layers=[],
                                norm_topk_prob=True)
    model = tf.Qwen3NextForCausalLM(config)
    randomize(model, seed)
    return model.eval()


# matrices the converter leaves in f32 (Flash-Next's PLE conv is squeezed to 2-D and stored f16)
KEPT_F32 = ("linear_attn.conv1d", "mlp.gate.weight", "shared_expert_gate")


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


@pytest.fixture(scope="module", params=[QWEN35_MTP, QWEN35MOE, QWEN3NEXT, QWEN4EXP])
def llamacpp(request, tmp_path_factory) -> tuple[Path, Path]:
    """A llama.cpp file and the HF folder it was converted from, rebuilt from its seeds (data/README.md)."""
    name, folder = request.param, tmp_path_factory.mktemp("source")
    if name == QWEN4EXP:
        flash_next_reference(folder)
    elif name == QWEN35_MTP:
        ref = build_reference("qwen3_5_text", seed=21)
        save_reference(ref, folder)
        add_random_mtp_head(folder, ref, seed=22)
    else:
        save_reference(build_reference("qwen3_5_moe_text", seed=21) if name == QWEN35MOE else qwen3_next_reference(21), folder)
    return DATA / name, folder


def source_tensors(folder: Path):
    """(config, model tensor by key) of an HF folder as the HF reader reads it (Qwen3-Next's fused
    projections split); fused experts are sliced per expert here."""
    config = ModelConfig.from_file(folder / "config.json")
    ckpt = SafetensorsCheckpoint(folder)
    tensors = read_weights(ckpt, config).tensors
    ckpt.close()

    def tensor(key: str) -> np.ndarray:
        if isinstance(tensors.get(key), ShardedRows):  # an n-gram table, its shards read whole
            return tensors[key][np.arange(tensors[key].shape[0])]
        if key in tensors:
            return tensors[key]
        base, e, proj = re.fullmatch(r"(.*)\.experts\.(\d+)\.(gate|up|down)_proj\.weight", key).groups()
        if proj == "down":
            return tensors[f"{base}.experts.down_proj"][int(e)]
        gate, up = np.split(tensors[f"{base}.experts.gate_up_proj"][int(e)], 2)
        return gate if proj == "gate" else up

    return config, tensor


def test_the_name_table_names_exactly_the_tensors_llamacpp_wrote(llamacpp):
    path, source = llamacpp
    config = ModelConfig.from_file(source / "config.json")
    ckpt = SafetensorsCheckpoint(source)
    plan = TensorPlan(ckpt, config)
    mtp, ngram_rows = plan.has_mtp, plan.ngram_rows
    ckpt.close()
    reader = gguf.GGUFReader(path)
    arch = GGUF_ARCHITECTURE[config.model_type]
    assert arch == reader.fields["general.architecture"].contents()
    theirs = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert {t.name: t.shape for t in gguf_tensors(config, arch, mtp, ngram_rows)} == theirs


def test_duet_convert_writes_what_llamacpp_wrote(llamacpp, tmp_path):
    """Same keys, tensors, types and shapes; f16 data bit for bit, f32 (computed: 1 + w, -exp) to rounding."""
    path, source = llamacpp
    assert main(["convert", str(source), str(tmp_path / "ours.gguf"), "--format", "gguf-f16"]) == 0
    ours, theirs = gguf.GGUFReader(tmp_path / "ours.gguf"), gguf.GGUFReader(path)
    arch = theirs.fields["general.architecture"].contents()

    def keys(reader):
        return {k: (f.contents(), f.types) for k, f in reader.fields.items() if k.startswith(arch + ".")}

    ours_keys, their_keys = keys(ours), keys(theirs)
    if arch == "qwen4exp":
        # llama.cpp's converter compares transformers' parsed layer_types, which call QSA layers
        # "indexed_attention", with "full_attention": it writes 0 for every trunk layer (its loader takes
        # the one nonzero ratio for all QSA layers); we write each QSA layer's ratio.
        ratios = "qwen4exp.attention.compress_ratios"
        full = [i for i, kind in enumerate(ModelConfig.from_file(source / "config.json").layer_types) if kind == "full_attention"]
        (mine, _), (real, _) = ours_keys.pop(ratios), their_keys.pop(ratios)
        assert [0 if i in full else r for i, r in enumerate(mine)] == real and all(mine[i] == max(real) for i in full)
    assert ours.fields["general.architecture"].contents() == arch and ours_keys == their_keys
    mine = {t.name: t for t in ours.tensors}
    assert sorted(mine) == sorted(t.name for t in theirs.tensors)
    for real in theirs.tensors:
        tensor = mine[real.name]
        assert (tensor.tensor_type, list(tensor.shape)) == (real.tensor_type, list(real.shape)), real.name
        if real.tensor_type == gguf.GGMLQuantizationType.F16:
            assert np.array_equal(tensor.data.view(np.uint16), real.data.view(np.uint16)), real.name
        else:
            np.testing.assert_allclose(tensor.data, real.data, rtol=1e-6, err_msg=real.name)


def test_the_reader_gives_back_the_source_tensors(llamacpp):
    """Every tensor the model reads and nothing else; f16 matrices equal the source rounded to f16,
    f32 tensors the source to rounding (w = (1 + w) - 1, A_log = log(exp(A_log)))."""
    path, source = llamacpp
    ckpt = GGUFCheckpoint(path)
    plan = TensorPlan(ckpt, ckpt.config)
    assert set(ckpt.names()) == {*plan.expected, *plan.integers, *(name for names in plan.tables.values() for name in names)}
    _, tensor = source_tensors(source)
    for name in ckpt.names():
        stored, expected = ckpt.read_f32(name), tensor(name.removeprefix("model."))
        if isinstance(stored, InputOrder):  # the file's inputs are the model's, gathered by order
            stored, expected = stored.weight, expected[:, stored.order]
        sources = ckpt.entries[name].source.split(" + ")  # a model tensor some GGUF tensors hold parts of
        if ckpt.entries[name].dtype == "I64":  # hash constants, from uint64 keys: exact
            assert stored.dtype == np.int64 and np.array_equal(stored, expected), name
        elif all(ckpt.types[source] == gguf.GGMLQuantizationType.F16 for source in sources):
            assert np.array_equal(stored, expected.astype(np.float16).astype(np.float32)), name
        else:
            np.testing.assert_allclose(stored, expected, rtol=0, atol=1e-6, err_msg=name)


def test_both_readers_make_one_config_and_qwen3next_reads_as_qwen3_5_moe(llamacpp):
    """The header reader (models info, placement) and the loader agree; a qwen3next file holds the
    Qwen3.5-MoE layout once llama.cpp has split in_proj_qkvz, and is presented so."""
    path, source = llamacpp
    config = GGUFCheckpoint(path).config
    assert read_headers(str(path)).config == config
    model_type = ModelConfig.from_file(source / "config.json").model_type
    assert config.model_type == {"qwen3_next": "qwen3_5_moe_text"}.get(model_type, model_type)
    assert config.flash == ModelConfig.from_file(source / "config.json").flash or \
        config.flash == dataclasses.replace(ModelConfig.from_file(source / "config.json").flash, split_ngram_parts=1)
    assert not config.fused_linear_projections


@pytest.mark.parametrize("name,build", [
    (QWEN35MOE, lambda: build_reference("qwen3_5_moe_text", seed=21)),
    (QWEN3NEXT, lambda: qwen3_next_reference(21)),
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
    from duet.engine.tokenizer import Tokenizer

    save_reference(build_reference("qwen3_5_text", seed=21), tmp_path)
    original = Tokenizer.from_dir(tmp_path)
    ours = load_model(DATA / "llamacpp_qwen35_mtp_f16.gguf").tokenizer
    chat = [{"role": "user", "content": "the lazy dog runs far away from home"}]
    text = original.render_chat(chat)
    assert ours.render_chat(chat) == text
    assert ours.encode(text) == original.encode(text)
    assert ours.eos_ids == original.eos_ids and ours.eos_token == "<|im_end|>"
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.usefixtures("stable_topk")  # QSA's tied block scores: the same pick on both sides
def test_llamacpp_qwen4exp_file_with_mtp_matches_transformers(tmp_path):
    """Flash-Next as llama.cpp writes it: hyper-connections, one PLE table, QSA, and the MTP head whose
    eh_proj holds fc_embedding and fc_hidden side by side (its reference as in test_flash_next.py)."""
    ref, parts = flash_next_reference(tmp_path)
    round_matrices_to_f16(ref, *(parts[k] for k in ("fc_embedding", "fc_hidden", "layer", "mixer")))
    lm = load_model(DATA / QWEN4EXP)
    model = lm.model
    ids = np.random.default_rng(4).integers(0, 300, 70)
    ids[[20, 21, 50]] = 2  # <|im_end|>: the n-gram history stops there
    hidden = model.forward(model.new_state(), ids)
    assert_close(model.logits(hidden), logits(ref, ids))

    seen = {}
    hook = ref.model.hyper_connection_mixer.register_forward_hook(lambda module, args, out: seen.update(x=args[0]))
    T, hc, H = len(ids) - 1, ref.config.hc_count, ref.config.hidden_size
    with torch.no_grad():
        logits(ref, ids)
        e = parts["fc_embedding"](parts["norm_embedding"](ref.model.embed_tokens(torch.tensor(ids[1:])[None])))
        h = parts["fc_hidden"](parts["norm_hidden"](seen["x"][:, :-1]).unflatten(-1, (hc, H)))
        x = (h + e[:, :, None, :]).flatten(-2)
        positions = torch.arange(1, T + 1)[None, None].expand(3, 1, T)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = parts["layer"](x, position_embeddings=parts["rotary"](x, positions), attention_mask=mask)
        expected = ref.lm_head(parts["mixer"](x))[0].numpy()
    hook.remove()
    assert_close(model.draft_logits(model.mtp_forward(model.new_mtp_state(), ids[1:], hidden[:-1])), expected)


def test_a_qwen4exp_file_duet_writes_gives_the_sources_tokens(tmp_path):
    """f32 holds the weights as they are: greedy with MTP drafts gives the HF folder's tokens exactly;
    q8_0 loads on the w4a8 route, the MTP head's eh_proj read as two runs of its blocks."""
    flash_next_reference(tmp_path / "source")
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, 40)]
    options = GenerateOptions(max_tokens=24, draft="mtp")

    def reply(path) -> list[int]:
        return [t for event in generate(load_model(path), prompt, options) if isinstance(event, Tokens) for t in event.token_ids]

    for fmt in ("gguf-f32", "gguf-q8_0"):
        assert main(["convert", str(tmp_path / "source"), str(tmp_path / f"{fmt}.gguf"), "--format", fmt]) == 0
    assert reply(tmp_path / "gguf-f32.gguf") == reply(tmp_path / "source")
    q8 = load_model(tmp_path / "gguf-q8_0.gguf")
    assert q8.route == "w4a8" and q8.model.mtp.fc_embedding.shape == (64, 64) and reply(tmp_path / "gguf-q8_0.gguf")


def test_a_quantized_qwen4exp_file_reads_as_its_blocks(tmp_path):
    """gguf-q8_0 of Flash-Next, every model tensor against gguf's own dequantize of the stored data:
    index_qk_proj is the indexer's q_proj and k_proj stacked into one quantized matrix, the hash
    constants are exact int64 entries of their own."""
    from duet.engine.checkpoint.gguf_names import gguf_tensors
    from duet.engine.quant.gguf_blocks import BlockMatrix

    flash_next_reference(tmp_path / "source")
    path = tmp_path / "q8.gguf"
    assert main(["convert", str(tmp_path / "source"), str(path), "--format", "gguf-q8_0"]) == 0
    reader, ckpt = gguf.GGUFReader(path), GGUFCheckpoint(path)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
              for t in reader.tensors}
    types = {t.name: t.tensor_type for t in reader.tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0
    held = {}  # model key -> [(part_of, values)]
    for tensor in gguf_tensors(ckpt.config, "qwen4exp", True, ckpt._shape("per_layer_token_embd.weight")[0]):
        for link in tensor.links:
            data = stored[tensor.name] if link.expert is None else stored[tensor.name][link.expert]
            held.setdefault(link.key, []).append((link, data))
    assert {types[name] for name in types if ".indexer." in name and name.endswith("_proj.weight")} == {q8}
    for key, parts in held.items():
        name = "model." + key if not key.startswith("mtp.") else key
        name = name if name in ckpt.entries else key
        entry = ckpt.entries[name]
        got = ckpt.quantized.read(name) if name in ckpt.quantized else ckpt.read_f32(name)
        got = got.weight if isinstance(got, InputOrder) else got  # ssm_out's inputs in the file's order
        blocks = all(types[s] == q8 for s in entry.source.split(" + "))
        assert (name in ckpt.quantized) == blocks == isinstance(got, BlockMatrix), name
        values = got.dequantize() if isinstance(got, BlockMatrix) else got
        if len(parts) > 1 and parts[0][0].part_of is not None:  # rows held by several tensors, in order
            expected = np.concatenate([data for _, data in sorted(parts, key=lambda p: p[0].part_of.start)])
            assert key.endswith("index_qk_proj.weight") and blocks
        else:
            link, expected = parts[0]
            expected = link.values.from_gguf(expected if link.rows is None else expected[link.rows])
            expected = expected if link.cols is None else expected[:, link.cols]
        assert np.array_equal(values, expected), name
    assert sum(key.endswith("index_qk_proj.weight") for key in held) == 2  # the QSA layer's and the MTP layer's

    # Parts of different forms (a llama-quantize run may give k_proj another type) join as fp32.
    name = next(name for name in ckpt.entries if name.endswith("index_qk_proj.weight"))
    parts, load = ckpt.entries[name].load.args[0], ckpt._load
    ckpt._load = lambda tensor, link: load(tensor, link) if link.part_of.start == 0 else load(tensor, link).dequantize()
    mixed = ckpt.read_f32(name)
    assert isinstance(mixed, np.ndarray) and np.array_equal(mixed, np.concatenate([load(*part).dequantize() for part in parts]))
    constants = [name for name, entry in ckpt.entries.items() if entry.dtype == "I64"]
    assert len(constants) == 3
    for name in constants:
        info, values = ckpt.info(name), ckpt.read_ints(name)
        assert name not in ckpt.quantized and info.dtype == "I64" and info.nbytes == values.nbytes == 8 * values.size
