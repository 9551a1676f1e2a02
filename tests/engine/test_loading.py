"""Loading: progress events, only the tensors the text model needs, config parsing rules."""

from __future__ import annotations

import json

import pytest

from conftest import build_reference, save_reference
from duet.engine import CheckpointError, LoadProgress, load_model
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import ModelConfig


def test_progress_counts_exactly_the_text_model_bytes(tmp_path):
    save_reference(build_reference("qwen3_5", seed=1), tmp_path)
    reported = []
    lm = load_model(tmp_path, progress=reported.append)
    ckpt = SafetensorsCheckpoint(tmp_path)
    text_bytes = sum(ckpt.info(n).nbytes for n in ckpt.names() if not n.startswith("model.visual."))
    events = [e for e in reported if e.stage == LoadProgress.WEIGHTS]
    assert [e.done_bytes for e in events] == sorted(e.done_bytes for e in events)
    assert events[-1].done_bytes == events[-1].total_bytes == text_bytes
    kernels = reported[len(events):]  # then the CPU kernels, counted one by one
    assert {e.stage for e in kernels} == {LoadProgress.KERNELS} and kernels[-1].done_bytes == kernels[-1].total_bytes
    assert lm.config.model_type == "qwen3_5_text"  # the nested text config wins


def test_layer_types_default_to_every_fourth_full_attention():
    raw = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 8,
           "num_attention_heads": 2, "head_dim": 16, "intermediate_size": 16, "linear_num_key_heads": 1, "linear_num_value_heads": 2}
    types = ModelConfig.from_dict(raw).layer_types
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [3, 7]


def test_qwen3_next_dense_layers_follow_mlp_only_layers(tmp_path):
    save_reference(build_reference("qwen3_next"), tmp_path, with_tokenizer=False)
    config = ModelConfig.from_file(tmp_path / "config.json")
    assert config.moe_layers == (True, False, True, True, True)


@pytest.mark.parametrize("edit,needle", [
    ({"num_hidden_layers": "five"}, "num_hidden_layers"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "yarn"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_invalid_config_values_name_the_problem(tmp_path, edit, needle):
    save_reference(build_reference("qwen3_5_text"), tmp_path, with_tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(CheckpointError, match=needle):
        ModelConfig.from_file(tmp_path / "config.json")


def test_shard_outside_the_model_folder_is_refused(tmp_path):
    save_reference(build_reference("qwen3_5_text"), tmp_path, with_tokenizer=False)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        SafetensorsCheckpoint(tmp_path)
