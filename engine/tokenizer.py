"""Tokenizer: `tokenizers` for text <-> ids, and the model's chat template (rendered by
engine/chat_template.py, in jinja2's sandbox)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as TokenizersBackend

from duet.engine import chat_template
from duet.engine.errors import CheckpointError, DuetError

# The named special tokens transformers hands every chat template (its `special_tokens_map`).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What a byte-level decoder writes for bytes that do not (yet) form a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"
RAW_HINT = "use --raw to send the prompt without a template"
# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` (as in the models' tokenizer.json); gpt-2 is ByteLevel's own.
GGUF_PRE_SPLITS = {
    "gpt-2": None,
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of added tokens


class Tokenizer:
    """A model's tokenizer: encode/decode, its stop tokens, and its chat template."""

    def __init__(
        self,
        backend: TokenizersBackend,
        named_tokens: dict[str, str],
        eos_ids: frozenset[int],
        chat_template: str | None,
        template_source: Path | None,
    ):
        self._backend = backend
        self.named_tokens = named_tokens
        self.eos_ids = eos_ids
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._chat_template = chat_template
        self._template_source = template_source

    @classmethod
    def from_dir(cls, model_dir: Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json and chat_template.jinja from a model folder."""
        model_dir = Path(model_dir)
        backend = _load_backend(model_dir / "tokenizer.json")
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json_object(config_path) if config_path.exists() else {}
        named_tokens = _named_tokens(config, config_path)
        eos_ids = set(extra_eos_ids)
        if "eos_token" in named_tokens:
            eos_ids.add(_id_of(backend, named_tokens["eos_token"], config_path))
        template, source = _find_chat_template(model_dir, config, config_path)
        return cls(backend, named_tokens, frozenset(eos_ids), template, source)

    @classmethod
    def from_gguf_vocab(cls, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                        bos_id: int | None, eos_id: int | None, pad_id: int | None, extra_eos_ids: Iterable[int],
                        chat_template: str | None, source: Path) -> Tokenizer:
        """A byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata (llama.cpp's "gpt2" model)."""
        if pre not in GGUF_PRE_SPLITS:
            raise CheckpointError(source, f"tokenizer pre-tokenizer {pre!r} is not supported; duet reads "
                                          f"{', '.join(GGUF_PRE_SPLITS)}")
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
        backend = TokenizersBackend(bpe)
        split = GGUF_PRE_SPLITS[pre]
        backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                                 pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens([AddedToken(t, special=kind == GGUF_CONTROL, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind in (GGUF_CONTROL, GGUF_USER_DEFINED)])
        named = {name: tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", eos_id), ("pad_token", pad_id))
                 if i is not None}
        eos_ids = frozenset([*extra_eos_ids, *([eos_id] if eos_id is not None else [])])
        return cls(backend, named, eos_ids, chat_template, source)

    @property
    def bos_token(self) -> str | None:
        return self.named_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.named_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.named_tokens.get("pad_token")

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str) -> list[int]:
        """Ids for text, adding no special tokens; special tokens written in the text map to their ids."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.decode)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for a conversation, as the model's chat template writes it."""
        if self._chat_template is None:
            raise DuetError(f"this model has no chat template; {RAW_HINT}")
        variables: dict[str, Any] = {
            **self.named_tokens,
            # Templates test for a missing key, not for None (OpenAI-style messages carry content=None).
            "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return chat_template.render(self._chat_template, variables)
        except chat_template.TemplateFailure as failure:
            raise DuetError(f"chat template in {self._template_source}: {failure}; {RAW_HINT}") from None

    def turn_start(self, messages: list[dict], prompt_ids: list[int], **render) -> int | None:
        """How many of prompt_ids (messages rendered with the reply's opening) come before that
        opening: the length of the conversation rendered without it, when its tokens begin
        prompt_ids (a template may write the end of the last message otherwise then); else None."""
        before = self.encode(self.render_chat(messages, add_generation_prompt=False, **render))
        return len(before) if len(before) < len(prompt_ids) and prompt_ids[: len(before)] == before else None


class StreamDecoder:
    """Turns ids arriving a few at a time into text, holding back a character split across tokens.

    Only a short window is decoded each time: the ids of the last emitted piece (as context, since the
    text of a token can depend on the one before it) and the ids not emitted yet.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._window: list[int] = []
        self._context = 0  # the first _context ids of the window were emitted already

    def push(self, ids: Sequence[int]) -> str:
        """The text completed by these ids; empty while the newest character is still incomplete."""
        self._window.extend(ids)
        context_text, text = self._decode_window()
        if text.endswith(REPLACEMENT_CHAR) or len(text) <= len(context_text):
            return ""
        self._window = self._window[self._context :]
        self._context = len(self._window)
        return text[len(context_text) :]

    def flush(self) -> str:
        """Whatever is held back, incomplete characters included; the decoder starts over empty."""
        context_text, text = self._decode_window()
        self._window, self._context = [], 0
        return text[len(context_text) :]

    def _decode_window(self) -> tuple[str, str]:
        return self._decode(self._window[: self._context]), self._decode(self._window)


def _load_backend(path: Path) -> TokenizersBackend:
    if not path.is_file():
        raise CheckpointError(path, "file not found; download the model again or copy its tokenizer files in")
    try:
        return TokenizersBackend.from_file(str(path))
    except Exception as error:  # the tokenizers library raises plain Exception for any bad file
        problem = " ".join(str(error).split())
        raise CheckpointError(path, f"not a valid tokenizers file ({problem}); download the model again") from error


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(path, f"cannot be read as JSON ({error}); download the model again") from error
    if not isinstance(value, dict):
        raise CheckpointError(path, "expected a JSON object at the top level; download the model again")
    return value


def _named_tokens(config: dict[str, Any], path: Path) -> dict[str, str]:
    """The named special tokens that are set, as text; each is a string or an AddedToken dict."""
    named = {}
    for name in NAMED_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            named[name] = value
        elif value is not None:
            problem = f'{name} must be a string or {{"content": ...}}; fix the file or download it again'
            raise CheckpointError(path, problem)
    return named


def _id_of(backend: TokenizersBackend, token: str, path: Path) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise CheckpointError(path, f"token {token!r} is not in tokenizer.json; download the model again")
    return token_id


def _find_chat_template(model_dir: Path, config: dict[str, Any], config_path: Path) -> tuple[str | None, Path | None]:
    """chat_template.jinja if present, else tokenizer_config.json's chat_template (the "default" one of a list)."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(jinja_path, f"cannot be read ({error}); download the model again") from error
    template = config.get("chat_template")
    if template is None:
        return None, None
    if isinstance(template, str):
        return template, config_path
    if isinstance(template, list) and all(_is_named_template(entry) for entry in template):
        default = next((entry["template"] for entry in template if entry["name"] == "default"), None)
        return (default, config_path) if default is not None else (None, None)
    raise CheckpointError(
        config_path, "chat_template must be a string or a list of {name, template}; fix the file or download it again"
    )


def _is_named_template(entry: Any) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
