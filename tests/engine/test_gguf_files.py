"""GGUF files written by llama.cpp's own converter: our name table names what they hold, `duet convert`
writes the same, our reader gives back the source tensors, and the files load and match transformers, live.

The files in tests/engine/data were converted from tiny random models (see data/README.md); each
test rebuilds the same transformers model from its seed. The converter stores 2-D weights in f16,
so the reference runs with those weights rounded to f16 too.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from duet.app.cli import main
from conftest import add_random_mtp_head, build_reference, moe_fields, randomize, save_reference, tiny_text_config
from duet.engine import load_model
from duet.engine.checkpoint.gguf import GGUFCheckpoint
from duet.engine.checkpoint.gguf_names import GGUF_ARCHITECTURE, gguf_tensors
from duet.engine.checkpoint.headers import read_headers
from duet.engine.checkpoint.hf import TensorPlan, read_weights
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import ModelConfig
from duet.engine.weights import InputOrder

DATA = Path(__file__).parent / "data"
QWEN35_MTP, QWEN35MOE, QWEN3NEXT = "llamacpp_qwen35_mtp_f16.gguf", "llamacpp_qwen35moe_f16.gguf", "llamacpp_qwen3next_f16.gguf"


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


@pytest.fixture(scope="module", params=[QWEN35_MTP, QWEN35MOE, QWEN3NEXT])
def llamacpp(request, tmp_path_factory) -> tuple[Path, Path]:
    """A llama.cpp file and the HF folder it was converted from, rebuilt from its seeds (data/README.md)."""
    name, folder = request.param, tmp_path_factory.mktemp("source")
    if name == QWEN35_MTP:
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
    mtp = TensorPlan(ckpt, config).has_mtp
    ckpt.close()
    reader = gguf.GGUFReader(path)
    arch = GGUF_ARCHITECTURE[config.model_type]
    assert arch == reader.fields["general.architecture"].contents()
    theirs = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert {t.name: t.shape for t in gguf_tensors(config, arch, mtp)} == theirs


def test_duet_convert_writes_what_llamacpp_wrote(llamacpp, tmp_path):
    """Same keys, tensors, types and shapes; f16 data bit for bit, f32 (computed: 1 + w, -exp) to rounding."""
    path, source = llamacpp
    assert main(["convert", str(source), str(tmp_path / "ours.gguf"), "--format", "gguf-f16"]) == 0
    ours, theirs = gguf.GGUFReader(tmp_path / "ours.gguf"), gguf.GGUFReader(path)
    arch = theirs.fields["general.architecture"].contents()

    def keys(reader):
        return {k: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}

    assert ours.fields["general.architecture"].contents() == arch and keys(ours) == keys(theirs)
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
    assert set(ckpt.names()) == set(TensorPlan(ckpt, ckpt.config).expected)
    _, tensor = source_tensors(source)
    for name in ckpt.names():
        stored, expected = ckpt.read_f32(name), tensor(name.removeprefix("model."))
        if isinstance(stored, InputOrder):  # the file's inputs are the model's, gathered by order
            stored, expected = stored.weight, expected[:, stored.order]
        if ckpt.types[ckpt.entries[name].source] == gguf.GGMLQuantizationType.F16:
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
