"""The GGUF name table round-trips every model type, MTP head included: model tensors -> GGUF tensors
-> model tensors, through the table alone and through `duet convert` and the GGUF reader.

Sources are transformers' own checkpoints, read by the HF reader (which splits Qwen3-Next's fused
projections). That the table puts each tensor where llama.cpp does is tests/engine/test_gguf_files.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from safetensors.torch import load_file, save_file

from duet.app.cli import main
from conftest import build_reference, randomize, save_reference, split_fused_experts
from duet.engine.checkpoint.gguf import GGUFCheckpoint
from duet.engine.checkpoint.gguf_names import AS_STORED, GGUF_ARCHITECTURE, gguf_tensors
from duet.engine.checkpoint.hf import TensorPlan, checkpoint_name
from duet.engine.weights import InputOrder
from test_gguf_files import qwen3_next_reference, source_tensors

KINDS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def add_mtp_head(folder: Path, ref, seed: int) -> None:
    """A random MTP head (fc, three norms, one full-attention layer of the model's own kind, MoE for
    the MoE types) written into a saved checkpoint, experts per expert as save_pretrained stores them."""
    import torch

    config = ref.config
    layer_config = type(config)(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    full = config.layer_types.index("full_attention")
    layer = type(ref.model.layers[full])(layer_config, 0)
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    norms = {name: type(ref.model.norm)(config.hidden_size) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for module in (layer, fc, *norms.values()):
        randomize(module, seed)
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = fc.weight
    tensors.update({f"mtp.{name}.weight": norm.weight for name, norm in norms.items()})
    tensors.update({f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))
    split_fused_experts(folder)


def fuse_experts(folder: Path) -> None:
    """Rewrite per-expert tensors as transformers' fused experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    path = folder / "model.safetensors"
    tensors, experts = {}, {}
    for name, value in safetensors.numpy.load_file(path).items():
        if match := re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name):
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = value
        else:
            tensors[name] = value
    for base, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        tensors[base + ".gate_up_proj"] = np.stack([np.concatenate([parts[e, "gate"], parts[e, "up"]]) for e in range(count)])
        tensors[base + ".down_proj"] = np.stack([parts[e, "down"] for e in range(count)])
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=KINDS)
def source(request, tmp_path_factory) -> Path:
    """A model of each type with an MTP head. Qwen3-Next has experts in every layer, as llama.cpp's
    qwen3next has them, and stores them fused, as transformers holds them."""
    ref = qwen3_next_reference(7) if request.param == "qwen3_next" else build_reference(request.param, seed=7)
    folder = save_reference(ref, tmp_path_factory.mktemp(request.param))
    add_mtp_head(folder, ref, seed=8)
    if request.param == "qwen3_next":
        fuse_experts(folder)
    return folder


def assert_gives_back(stored, expected: np.ndarray, exact: bool, what: str) -> None:
    """stored (an array, or InputOrder: the model's inputs gathered by order) holds expected:
    exactly, or to fp32 rounding where values were computed ((1 + w) - 1, log(exp(a)))."""
    if isinstance(stored, InputOrder):
        stored, expected = stored.weight, expected[:, stored.order]
    assert stored.shape == expected.shape, what
    if exact:
        assert np.array_equal(stored, expected), what
    else:
        np.testing.assert_allclose(stored, expected, rtol=0, atol=1e-6, err_msg=what)


def test_model_tensors_round_trip_through_the_table(source):
    config, tensor = source_tensors(source)
    arch = GGUF_ARCHITECTURE[config.model_type]
    table = gguf_tensors(config, arch, mtp=True)
    keys = [link.key for t in table for link in t.links]
    assert len(keys) == len(set(keys)) and any(k.startswith("mtp.layers.0.") for k in keys)
    for t in table:
        stored = t.from_model(tensor)
        assert stored.shape == t.shape and stored.dtype == np.float32, t.name
        for link in t.links:
            part = stored if link.expert is None else stored[link.expert]
            assert_gives_back(link.from_gguf(part), tensor(link.key), link.values is AS_STORED, f"{t.name} -> {link.key}")


def test_convert_and_the_reader_round_trip(source, tmp_path):
    """gguf-f32 keeps every value; the reader offers exactly what the model reads, as the source holds it."""
    path = tmp_path / "model.gguf"
    assert main(["convert", str(source), str(path), "--format", "gguf-f32"]) == 0
    config, tensor = source_tensors(source)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.mtp_num_hidden_layers == 1 and ckpt.config.layer_types == config.layer_types
    assert set(ckpt.names()) == set(TensorPlan(ckpt, ckpt.config).expected)
    as_stored = {checkpoint_name(link.key): link.values is AS_STORED
                 for t in gguf_tensors(ckpt.config, ckpt.arch, mtp=True) for link in t.links}
    for name in ckpt.names():
        assert_gives_back(ckpt.read_f32(name), tensor(name.removeprefix("model.")), as_stored[name], name)
