"""A GGUF file's model keys -> ModelConfig (engine/checkpoint/gguf_names.gguf_config, ngram_constants),
on the keys llama.cpp's converter wrote into tests/engine/data/llamacpp_qwen4exp_mtp_f16.gguf, read
with the gguf package: each key's default, each layer pattern, and each bad value refused in one exact
line. That the file's keys give its source's config.json is test_gguf_files.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gguf import GGUFReader

from duet.engine.checkpoint.gguf_names import NGRAM_TABLE, gguf_config, gguf_tensors, ngram_constants
from duet.engine.config import FULL_ATTENTION, LINEAR_ATTENTION, MAX_SIZE
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
    assert config(written, attention__recurrent_layers=flags[:5], **no_ple).layer_types == (L, F, F, L, L)  # no MTP flag
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


def test_the_name_table_holds_one_ple_layer_only(written):
    """llama.cpp's qwen4exp has one n-gram table (duet convert says so before it gets here)."""
    c = config(written)
    assert [t.name for t in gguf_tensors(c, "qwen4exp", mtp=False, ngram_rows=10)].count(NGRAM_TABLE) == 1
    two = dataclasses.replace(c, flash=dataclasses.replace(c.flash, ple_layers=(1, 2)))
    with pytest.raises(ValueError) as error:
        gguf_tensors(two, "qwen4exp", mtp=False, ngram_rows=10)
    assert str(error.value) == "llama.cpp's qwen4exp holds one n-gram table, and this model has PLE on 2 layers"


def test_head_width_and_rotary_share_without_a_key_length(written):
    """Without attention.key_length a head is embedding_length / head_count wide; the rotary share is
    rope.dimension_count of it, all of it at most."""
    assert config(written).partial_rotary_factor == 8 / 32  # key_length 32
    assert config(written, attention__key_length=None).partial_rotary_factor == 8 / (64 / 4)
    # all of a head (QSA's indexer heads, 16 wide, take the same rotary part: heads of 16 here)
    assert config(written, attention__key_length=None, rope__dimension_count=16).partial_rotary_factor == 1.0
    assert config(written, attention__key_length=None, rope__dimension_count=None).partial_rotary_factor == 1.0


@pytest.mark.parametrize("changes,line", [
    ({"attention__key_length": None, "attention__head_count": 3},
     "metadata keys qwen4exp.embedding_length and qwen4exp.attention.head_count are 64 and 3, and there is no "
     "qwen4exp.attention.key_length: the first is no multiple of the second"),
    ({"rope__dimension_count": 33}, "metadata key qwen4exp.rope.dimension_count is 33, more than the head dimension 32"),
    ({"block_count": 1}, "metadata key qwen4exp.block_count is 1, which leaves no layers besides its 1 MTP block(s)"),
    ({"ssm__inner_size": 66},
     "metadata keys qwen4exp.ssm.inner_size and qwen4exp.ssm.time_step_rank are 66 and 4: the first is no multiple "
     "of the second"),
    ({"embedding_length": [64, True]},
     "metadata key qwen4exp.embedding_length is [64, True], not a number or a per-layer array of numbers"),
    ({"embedding_length": []}, "metadata key qwen4exp.embedding_length is [], not a number or a per-layer array of numbers"),
])
def test_inconsistent_keys_are_one_exact_line(written, changes, line):
    assert refused(written, **changes) == f"{SOURCE}: {line}; {CORRUPT}"


@pytest.mark.parametrize("dropped,missing", [
    ("expert_count", "qwen4exp.expert_count"),
    ("expert_count expert_used_count", "qwen4exp.expert_count, qwen4exp.expert_used_count"),
    ("attention__indexer__top_k", "qwen4exp.attention.indexer.top_k"),
    ("ssm__inner_size", "qwen4exp.ssm.inner_size"),
])
def test_each_key_llamacpp_needs_is_asked_for_by_name(written, dropped, missing):
    line = refused(written, **{name: None for name in dropped.split()})
    assert line == f"{SOURCE}: metadata lacks {missing}; the file is not a complete qwen4exp GGUF"


def test_the_token_table_gives_the_vocabulary_and_must_be_a_matrix(written):
    keys, shapes = written
    assert gguf_config(keys, shapes, SOURCE).vocab_size == shapes["token_embd.weight"][0]
    for vocab in (1, MAX_SIZE):
        assert gguf_config(keys, {**shapes, "token_embd.weight": (vocab, 64)}, SOURCE).vocab_size == vocab
    for shape in ((MAX_SIZE + 1, 64), (0, 64), (64,)):
        with pytest.raises(CheckpointError) as error:
            gguf_config(keys, {**shapes, "token_embd.weight": shape}, SOURCE)
        assert str(error.value) == (f"{SOURCE}: tensor token_embd.weight has shape {list(shape)}, not [vocabulary, width] "
                                    f"with a vocabulary from 1 to {MAX_SIZE}; {CORRUPT}")
    missing = {name: shape for name, shape in shapes.items() if name != "token_embd.weight"}
    with pytest.raises(CheckpointError) as error:
        gguf_config(keys, missing, SOURCE)
    assert str(error.value) == f"{SOURCE}: metadata lacks tensor token_embd.weight; the file is not a complete qwen4exp GGUF"


def test_a_ple_layer_the_pattern_makes_attention_is_refused_naming_the_file(written):
    line = refused(written, ple__layers=[3])  # layer 3 is full attention
    assert line == f"{SOURCE}: ple_layer_ids names a layer that is not linear attention; PLE runs on DeltaNet layers only"
