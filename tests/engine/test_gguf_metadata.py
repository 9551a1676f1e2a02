"""A GGUF file's model keys -> ModelConfig (engine/checkpoint/gguf_names.gguf_config, ngram_constants),
on the keys llama.cpp's converter wrote into tests/engine/data/llamacpp_qwen4exp_mtp_f16.gguf, read
with the gguf package: each key's default, each layer pattern, and each bad value refused in one exact
line. That the file's keys give its source's config.json is test_gguf_files.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from duet.engine.checkpoint.gguf_names import gguf_config, ngram_constants
from duet.engine.config import FULL_ATTENTION, LINEAR_ATTENTION
from duet.engine.errors import CheckpointError

FILE = Path(__file__).parent / "data" / "llamacpp_qwen4exp_mtp_f16.gguf"
CORRUPT = "the file is corrupt, download it again or convert it again"
SOURCE = "model.gguf"
L, F = LINEAR_ATTENTION, FULL_ATTENTION


@pytest.fixture(scope="module")
def written() -> tuple[dict, dict]:
    """(keys, tensor shapes in numpy order) as llama.cpp wrote them: 5 layers and the MTP block."""
    reader = GGUFReader(FILE)
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    return keys, shapes


def config(written, **changes):
    """The config of the file's keys with `changes` (a key's last part, dots as __; None drops it)."""
    keys, shapes = written
    keys = dict(keys)
    for name, value in changes.items():
        key = name.replace("__", ".")
        key = key if key.startswith(("qwen4exp.", "tokenizer.", "general.")) else f"qwen4exp.{key}"
        if value is None:
            keys.pop(key, None)
        else:
            keys[key] = value
    return gguf_config(keys, shapes, SOURCE)


def refused(written, **changes) -> str:
    with pytest.raises(CheckpointError) as error:
        config(written, **changes)
    return str(error.value)


def test_the_layer_pattern_follows_the_recurrent_flags_else_the_interval(written):
    assert config(written).layer_types == (L, L, L, F, L)  # the file's flags, cut before the MTP block
    no_ple = {"ple__layers": None}  # PLE sits on a DeltaNet layer: free the pattern
    flags = [True, False, False, True, True, True]  # not the interval's pattern: the flags win
    assert config(written, attention__recurrent_layers=flags, **no_ple).layer_types == (L, F, F, L, L)
    assert config(written, attention__recurrent_layers=None, full_attention_interval=2, **no_ple).layer_types == \
        (L, F, L, F, L)
    assert config(written, attention__recurrent_layers=[True] * 4, full_attention_interval=3, **no_ple).layer_types == \
        (L, L, F, L, L)  # fewer flags than layers: the interval
    assert config(written, attention__recurrent_layers=None, full_attention_interval=None).layer_types == \
        (L, L, L, F, L)  # llama.cpp's default interval, 4


def test_the_head_is_tied_exactly_when_the_file_has_no_output_tensor(written):
    keys, shapes = written
    assert "output.weight" in shapes and not gguf_config(keys, shapes, SOURCE).tie_word_embeddings
    untied = {name: shape for name, shape in shapes.items() if name != "output.weight"}
    assert gguf_config(keys, untied, SOURCE).tie_word_embeddings


def test_stop_tokens_join_the_ple_eos_and_the_tokenizers(written):
    assert config(written).eos_token_ids == (2,)  # both say 2
    assert config(written, tokenizer__ggml__eos_token_id=7).eos_token_ids == (2, 7)
    assert config(written, tokenizer__ggml__eos_token_id=None).eos_token_ids == (2,)
    assert config(written, ple__eos_token_id=0, tokenizer__ggml__eos_token_id=0).eos_token_ids == (0,)


def test_ple_width_and_its_defaults(written):
    """embedding_length_per_layer_input is one n-gram head's row: the PLE width is rows x (n - 1) x heads,
    n and heads defaulting to llama.cpp's 3 and 8."""
    assert config(written).flash.ple_embed_dim == 8 * (3 - 1) * 2
    assert config(written, ple__ngram_size=4).flash.ple_embed_dim == 8 * (4 - 1) * 2
    assert config(written, ple__heads_per_ngram=None).flash.ple_embed_dim == 8 * (3 - 1) * 8
    assert config(written, ple__ngram_size=None, ple__heads_per_ngram=None).flash.ple_embed_dim == 8 * 2 * 8
    assert config(written, ple__layers=[0]).flash.ple_layers == (0,)  # the first layer is a layer
    assert config(written, ple__layers=None).flash.ple_layers == ()


@pytest.mark.parametrize("changes,line", [
    ({"ple__layers": 1}, "metadata key qwen4exp.ple.layers is 1, not a list of layer numbers below 5"),
    ({"ple__layers": [5]}, "metadata key qwen4exp.ple.layers is [5], not a list of layer numbers below 5"),
    ({"ple__layers": [-1]}, "metadata key qwen4exp.ple.layers is [-1], not a list of layer numbers below 5"),
    ({"ple__layers": [True]}, "metadata key qwen4exp.ple.layers is [True], not a list of layer numbers below 5"),
    ({"ple__eos_token_id": -1}, "metadata key qwen4exp.ple.eos_token_id is -1, not a token id"),
    ({"ple__eos_token_id": "2"}, "metadata key qwen4exp.ple.eos_token_id is '2', not a token id"),
    ({"embedding_length_per_layer_input": None},
     "metadata key qwen4exp.embedding_length_per_layer_input is None, not an integer from 1 to 1048576"),
    ({"general__architecture": "qwen5"},
     "GGUF architecture 'qwen5' (key general.architecture) is not supported; duet reads qwen35, qwen35moe, qwen3next, "
     "qwen4exp"),
    ({"hyper_connection__count": None},
     "metadata lacks qwen4exp.hyper_connection.count; the file is not a complete qwen4exp GGUF"),
    ({"embedding_length": [64, "wide"]},
     f"metadata key qwen4exp.embedding_length is [64, 'wide'], not a number or a per-layer array of numbers; {CORRUPT}"),
])
def test_bad_flash_next_keys_are_one_exact_line(written, changes, line):
    message = refused(written, **changes)
    expected = f"{SOURCE}: {line}"
    assert message == expected or message == f"{expected}; {CORRUPT}", message


@pytest.mark.parametrize("key,value,line", [
    ("ple.layer_multipliers", [1, 2], "is [1, 2], not 3 integers"),
    ("ple.head_vocab_sizes", [101, 103, 107], "is [101, 103, 107], not 4 integers"),
    ("ple.head_offsets", [0, 101, 204, 2**63], f"is [0, 101, 204, {2**63}], not 4 integers"),
    ("ple.head_offsets", [0, 101, 204, -1], "is [0, 101, 204, -1], not 4 integers"),
    ("ple.head_offsets", [0, 101, 204, 3.0], "is [0, 101, 204, 3.0], not 4 integers"),
    ("ple.layer_multipliers", None, "is None, not 3 integers"),
])
def test_bad_hash_constants_are_one_exact_line(written, key, value, line):
    keys, shapes = written
    c = gguf_config(keys, shapes, SOURCE)
    changed = {**keys, f"qwen4exp.{key}": value}
    with pytest.raises(CheckpointError) as error:
        ngram_constants(changed, c, SOURCE)
    assert str(error.value) == f"{SOURCE}: metadata key qwen4exp.{key} {line} from 0 to 2^63; {CORRUPT}"


def test_hash_constants_up_to_2_to_the_63_are_read_exactly(written):
    keys, shapes = written
    c = gguf_config(keys, shapes, SOURCE)
    top = {**keys, "qwen4exp.ple.head_offsets": [0, 101, 204, 2**63 - 1]}
    constants = ngram_constants(top, c, SOURCE)
    offsets = constants["layers.1.ple.ple_embedding.ngram_heads_offsets"]
    assert offsets.dtype == "int64" and [int(v) for v in offsets] == [0, 101, 204, 2**63 - 1]
    assert [int(v) for v in constants["layers.1.ple.ple_embedding.layer_multipliers"]] == \
        keys["qwen4exp.ple.layer_multipliers"]
