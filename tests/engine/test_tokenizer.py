"""Tokenizer against transformers' tokenizer on a real byte-level BPE trained here, and its template sandbox."""

from __future__ import annotations

import json
from collections.abc import Iterator
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as TokenizersBackend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from duet.engine.errors import CheckpointError, DuetError
from duet.engine.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML with thinking, in the spirit of Qwen3's template: reasoning is dropped from past assistant turns,
# and with enable_thinking false the generation prompt opens an empty think block.
CHAT_TEMPLATE = """\
{%- set ns = namespace(system='') %}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content %}
{%- endif %}
{%- if tools %}
    {#- strftime_now must exist; [:0] keeps the output independent of the clock #}
    {%- set ns.system = ns.system + '\\n\\n# Tools' + strftime_now('%Y')[:0] + '\\n<tools>' %}
    {%- for tool in tools %}
        {%- set ns.system = ns.system + '\\n' + (tool | tojson) %}
    {%- endfor %}
    {%- set ns.system = ns.system + '\\n</tools>' %}
{%- endif %}
{%- if ns.system %}
{{- '<|im_start|>system\\n' + ns.system | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('System message must come first.') }}{% endif %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}
        {% generation %}{{ content }}{% endgeneration %}
        {%- if message.tool_calls is defined %}
            {{- '\n<tool_call>' + (message.tool_calls | tojson) + '</tool_call>' }}
        {%- endif %}
    {%- else %}
        {{- content }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- else %}
    {{- eos_token }}
{%- endif %}
"""

WORDS = (
    "the model reads every weight once per cycle and verifies the drafted tokens "
    "café naïve über façade 東京 日本語 中文 한국어 Привет мир 🙂 ✨ 🚀 1234 5678"
).split()

MULTIBYTE_TEXT = "Grüße aus Köln! 東京タワー 🦀🧪 and 👩‍💻 naïve café — 日本語の文章 🙂✨ end."

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "You are terse. Réponds en français."},
        {"role": "user", "content": "What is 東京?"},
    ],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Count to three."},
        # content after </think> only is kept; a None field is dropped, as transformers does
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n1, 2, 3", "tool_calls": None},
        {"role": "user", "content": "Now backwards 🙂"},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo for a city — <b>not</b> escaped",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def training_lines(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(count)]


def write_tokenizer_json(folder: Path) -> None:
    backend = TokenizersBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(training_lines(400), trainer)
    backend.save(str(folder / "tokenizer.json"))


def write_config(folder: Path, **fields) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        **fields,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_json(folder)
    write_config(folder)
    return folder


@pytest.fixture(scope="module")
def ours(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def theirs(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    return tmp_path


@pytest.mark.parametrize(
    "text",
    [
        "",
        "the model reads every weight",
        "  leading and   repeated spaces\n\nnew lines\t",
        MULTIBYTE_TEXT,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|endoftext|>",
        "half a special <|im_sta and <think>x</think>",
    ],
)
def test_encode_and_decode_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_tokens_written_in_text_map_to_their_ids(ours: Tokenizer, theirs) -> None:
    assert ours.encode("<|im_start|>") == [ours.token_to_id("<|im_start|>")]
    assert ours.vocab_size == len(theirs)


def test_eos_ids_combine_the_tokenizer_eos_and_the_callers(model_dir: Path) -> None:
    endoftext = Tokenizer.from_dir(model_dir).token_to_id("<|endoftext|>")
    tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=[endoftext])
    assert tokenizer.eos_ids == frozenset({tokenizer.token_to_id("<|im_end|>"), endoftext})
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_apply_chat_template(
    ours: Tokenizer, theirs, conversation: list[dict], enable_thinking: bool | None, add_generation_prompt: bool
) -> None:
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **thinking
        )
        rendered = ours.render_chat(
            conversation, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tools=tools
        )
        assert rendered == expected


def test_empty_think_block_only_when_thinking_is_off(ours: Tokenizer) -> None:
    assert ours.render_chat(CONVERSATIONS[0], enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert ours.render_chat(CONVERSATIONS[0], enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_the_turn_starts_where_the_conversation_without_the_reply_opening_ends(ours: Tokenizer) -> None:
    """The demo's template writes the reply's opening (`<|im_start|>assistant\\n`) after the last
    message's tokens; prompt ids that do not begin with those have no turn start, nor has a template
    that ends a conversation without an opening otherwise (this module's writes eos_token there)."""
    demo = Tokenizer.from_dir(Path(__file__).resolve().parents[2] / "models" / "demo")
    conversation = CONVERSATIONS[0]
    prompt = demo.encode(demo.render_chat(conversation))
    start = demo.turn_start(conversation, prompt)
    assert demo.decode(prompt[start:]) == "<|im_start|>assistant\n" and demo.decode(prompt[:start]).endswith("<|im_end|>\n")
    assert demo.turn_start(conversation, prompt[:start]) is None  # nothing after it
    assert demo.turn_start(conversation, [prompt[0] + 1] + prompt[1:]) is None
    assert ours.turn_start(conversation, ours.encode(ours.render_chat(conversation))) is None


def test_template_sources_in_order_of_preference(model_dir: Path, tmp_path: Path, ours: Tokenizer) -> None:
    folder = copy_of(model_dir, tmp_path)
    templates = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHAT_TEMPLATE}]
    write_config(folder, chat_template=templates)
    assert Tokenizer.from_dir(folder).render_chat(CONVERSATIONS[1]) == ours.render_chat(CONVERSATIONS[1])
    (folder / "chat_template.jinja").write_text("{{ messages | length }} messages", encoding="utf-8")
    assert Tokenizer.from_dir(folder).render_chat(CONVERSATIONS[1]) == "2 messages"


def test_no_chat_template_says_to_use_raw(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(model_dir, tmp_path)
    write_config(folder, chat_template=None)
    tokenizer = Tokenizer.from_dir(folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(DuetError, match="no chat template.*--raw"):
        tokenizer.render_chat(CONVERSATIONS[0])


def test_template_errors_name_the_template(ours: Tokenizer, model_dir: Path, tmp_path: Path) -> None:
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(DuetError, match=r"tokenizer_config\.json: System message must come first") as raised:
        ours.render_chat(late_system)
    assert "\n" not in str(raised.value)
    folder = copy_of(model_dir, tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }", encoding="utf-8")
    with pytest.raises(DuetError, match=r"chat_template\.jinja"):
        Tokenizer.from_dir(folder).render_chat(CONVERSATIONS[0])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('echo escaped') }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    ],
)
def test_sandbox_refuses_python_internals(model_dir: Path, tmp_path: Path, template: str) -> None:
    folder = copy_of(model_dir, tmp_path)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    with pytest.raises(DuetError, match=r"chat_template\.jinja"):
        Tokenizer.from_dir(folder).render_chat(CONVERSATIONS[0])


def test_sandbox_renders_a_lone_unsafe_attribute_as_undefined(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_of(model_dir, tmp_path)
    (folder / "chat_template.jinja").write_text("[{{ raise_exception.__globals__ }}]", encoding="utf-8")
    assert Tokenizer.from_dir(folder).render_chat(CONVERSATIONS[0]) == "[]"


def chunk_sizes_covering(total: int, sizes: list[int]) -> Iterator[int]:
    taken, i = 0, 0
    while taken < total:
        yield sizes[i % len(sizes)]
        taken += sizes[i % len(sizes)]
        i += 1


def test_stream_decoder_yields_whole_characters_only(ours: Tokenizer) -> None:
    ids = ours.encode(MULTIBYTE_TEXT * 3)
    # The test only means something if some characters are split across tokens.
    assert any("\ufffd" in ours.decode([token]) for token in ids)
    for chunk_sizes in ([1], [2, 3, 1], [5]):
        decoder, pieces, start = ours.stream_decoder(), [], 0
        for size in chunk_sizes_covering(len(ids), chunk_sizes):
            pieces.append(decoder.push(ids[start : start + size]))
            start += size
        pieces.append(decoder.flush())
        assert "".join(pieces) == ours.decode(ids)
        assert not any("\ufffd" in piece for piece in pieces)
        assert "" in pieces[:-1]  # something was held back


def test_stream_decoder_flush_returns_an_incomplete_tail(ours: Tokenizer) -> None:
    ids = ours.encode("ok 🦀")[:-1]
    assert ours.decode(ids).endswith("\ufffd")  # the crab is cut short
    decoder = ours.stream_decoder()
    streamed = decoder.push(ids)
    tail = decoder.flush()
    assert "\ufffd" not in streamed and tail.endswith("\ufffd")
    assert streamed + tail == ours.decode(ids)
    assert decoder.push(ours.encode("again")) == "again"  # flushed means empty, not stuck


def test_stream_decoder_decodes_a_short_window(ours: Tokenizer) -> None:
    ids = ours.encode(MULTIBYTE_TEXT * 40)
    window_lengths: list[int] = []

    def recording_decode(window: list[int]) -> str:
        window_lengths.append(len(window))
        return ours.decode(window)

    decoder = StreamDecoder(recording_decode)
    text = "".join(decoder.push([token]) for token in ids) + decoder.flush()
    assert text == ours.decode(ids)
    assert max(window_lengths) <= 8 < len(ids)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found") as raised:
        Tokenizer.from_dir(tmp_path)
    assert raised.value.path == str(tmp_path / "tokenizer.json")


def test_corrupt_tokenizer_json_names_the_file(model_dir: Path, tmp_path: Path) -> None:
    text = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_dir(tmp_path)
    assert raised.value.path == str(tmp_path / "tokenizer.json")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "config_text",
    [
        '{"eos_token": "<|im_end|>",',
        '["not", "an", "object"]',
        '{"eos_token": 7}',
        '{"eos_token": "<|not_a_token|>"}',
        '{"chat_template": 12}',
        '{"chat_template": [{"name": "default"}]}',
    ],
)
def test_malformed_tokenizer_config_names_the_file(model_dir: Path, tmp_path: Path, config_text: str) -> None:
    folder = copy_of(model_dir, tmp_path)
    (folder / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    with pytest.raises(CheckpointError) as raised:
        Tokenizer.from_dir(folder)
    assert raised.value.path == str(folder / "tokenizer_config.json")
    assert "\n" not in str(raised.value)
