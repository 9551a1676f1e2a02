"""A byte-level BPE tokenizer with Qwen's ChatML special tokens, and its files for the model folder."""

import json
import re

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CONTROL_TOKENS = [END_OF_TEXT, IM_START, IM_END]  # special: hidden when decoding with skip_special_tokens
THINK_TOKENS = [THINK_OPEN, THINK_CLOSE]  # added but not special, as in Qwen3's tokenizer
ADDED_TOKEN_TEXT = re.compile("|".join(re.escape(t) for t in CONTROL_TOKENS + THINK_TOKENS))


def train_tokenizer(texts, vocab_size):
    """BPE over bytes, trained on the chat texts with their added tokens cut out (they get whole ids of
    their own, so merges are not spent on their spelling). The think tokens take the last two ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    pieces = (piece for text in texts for piece in ADDED_TOKEN_TEXT.split(text) if piece)
    tokenizer.train_from_iterator(pieces, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return tokenizer


def tokenizer_config(tokenizer, model_max_length):
    """tokenizer_config.json in the shape of Qwen3's, for a plain PreTrainedTokenizerFast."""
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in CONTROL_TOKENS,
        }
        for t in CONTROL_TOKENS + THINK_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def save_tokenizer(tokenizer, out_dir, model_max_length, chat_template):
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(tokenizer, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(chat_template)
