"""Builds duet's bundled demo model from scratch: data, tokenizer, joint model + MTP training, export,
measurement and model card.

    python models/recipe/train_demo.py --out models/demo

Needs the Debian package bible-kjv (the text) and the `train` extra (torch, transformers). Runs on one
CPU thread in well under an hour. The app never imports this folder.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # keep the tokenizer trainer on one thread too

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

import measure
from bpe import THINK_OPEN, save_tokenizer, train_tokenizer
from card import render_card
from export import write_checkpoint
from kjv_chats import TEMPLATE_PATH, chat_pairs, package_versions, read_chapters, split_chapters
from training import MTP_LOSS_WEIGHT, conversation_windows, demo_config, train

VOCAB_SIZE = 4096
MAX_POSITIONS = 2048
HELD_OUT_FRACTION = 0.05
GREEDY_PROMPTS = 8
MAX_REPLY_TOKENS = 96
CARD_SAMPLES = 2
SAMPLE_REPETITION_PENALTY = 1.3  # plain greedy decoding of a model this small soon loops
SIZE_LIMIT_BYTES = 15_000_000


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to write (e.g. models/demo)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=257, help="tokens per window (256 inputs + 1 target)")
    parser.add_argument("--lr", type=float, default=2e-3)
    return parser.parse_args()


def log(message):
    print(message, flush=True)


def parameter_counts(model, mtp):
    main = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    return main, sum(p.numel() for p in mtp.parameters())


def folder_bytes(out_dir, skip=()):
    return sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file() and p.name not in skip)


def architecture_facts(config):
    return {
        "hidden": config.hidden_size,
        "hidden2": 2 * config.hidden_size,
        "layers": config.num_hidden_layers,
        "layer_pattern": "".join("A" if t == "full_attention" else "L" for t in config.layer_types),
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rotary_dims": int(config.head_dim * config.rope_parameters["partial_rotary_factor"]),
        "rope_theta": config.rope_parameters["rope_theta"],
        "hk": config.linear_num_key_heads,
        "hv": config.linear_num_value_heads,
        "dk": config.linear_key_head_dim,
        "dv": config.linear_value_head_dim,
        "conv": config.linear_conv_kernel_dim,
        "intermediate": config.intermediate_size,
        "max_positions": config.max_position_embeddings,
        "eos_ids": config.eos_token_id,
        "vocab_size": config.vocab_size,
    }


def measure_exported(out_dir, train_windows, held_out_windows, held_out_chapters, think_id):
    """Held-out perplexity, unigram baseline, MTP agreement and acceptance, and samples, all from the
    written files."""
    model, mtp, tokenizer = measure.load_exported(out_dir)
    facts = measure.held_out_figures(model, mtp, held_out_windows, think_id)
    vocab_size = model.config.vocab_size
    facts["unigram_ppl"] = measure.unigram_perplexity(train_windows, held_out_windows, vocab_size, think_id)
    prompts = measure.sample_prompts(held_out_chapters, GREEDY_PROMPTS)
    hits = drafts = 0
    for prompt in prompts:
        prompt_ids, reply_ids = measure.greedy_reply(model, tokenizer, prompt, MAX_REPLY_TOKENS)
        h, n = measure.greedy_mtp_acceptance(model, mtp, prompt_ids, reply_ids)
        hits, drafts = hits + h, drafts + n
    samples = []
    for prompt in prompts[:CARD_SAMPLES]:
        _, reply = measure.greedy_reply(model, tokenizer, prompt, MAX_REPLY_TOKENS, SAMPLE_REPETITION_PENALTY)
        samples.append((prompt, tokenizer.decode(reply, skip_special_tokens=True).strip()))
    return facts | {
        "greedy_prompts": GREEDY_PROMPTS,
        "greedy_positions": drafts,
        "greedy_acceptance": hits / drafts,
        "tokens_per_cycle": 1 + hits / drafts,
        "samples": samples,
        "sample_penalty": SAMPLE_REPETITION_PENALTY,
    }


def run_facts(args, chapters, held_out_chapters, train_windows, model, mtp, record):
    """What the card says about data, size and training."""
    params_main, params_mtp = parameter_counts(model, mtp)
    versions = package_versions()
    with safe_open(args.out / "model.safetensors", "pt") as f:
        tensor_count = len(list(f.keys()))
    return architecture_facts(model.config) | record | {
        "params_main_m": params_main / 1e6,
        "params_mtp_m": params_mtp / 1e6,
        "tensor_count": tensor_count,
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
        "text_version": versions["bible-kjv-text"],
        "reader_version": versions["bible-kjv"],
        "verses": sum(len(c) for c in chapters),
        "chapters": len(chapters),
        "seed": args.seed,
        "held_out_chapters": len(held_out_chapters),
        "held_out_percent": 100 * HELD_OUT_FRACTION,
        "mtp_weight": MTP_LOSS_WEIGHT,
        "lr": args.lr,
        "batch": args.batch,
        "length": args.length,
        "train_tokens": record["tokens"],
        "epoch_tokens": train_windows[:, 1:].numel(),
        "epochs": record["tokens"] / train_windows[:, 1:].numel(),
        "train_minutes": record["train_seconds"] / 60,
        "train_cpu_minutes": record["train_cpu_seconds"] / 60,
    }


def main():
    args = parse_args()
    torch.set_num_threads(1)
    started, cpu_started = time.perf_counter(), time.process_time()
    args.out.mkdir(parents=True, exist_ok=True)

    chapters = read_chapters()
    train_chapters, held_out_chapters = split_chapters(chapters, HELD_OUT_FRACTION, args.seed)
    train_pairs = chat_pairs(train_chapters, args.seed)
    tokenizer = train_tokenizer([prompt + reply for prompt, reply in train_pairs], VOCAB_SIZE)
    train_windows = conversation_windows(tokenizer, train_pairs, args.length)
    held_out_windows = conversation_windows(tokenizer, chat_pairs(held_out_chapters, args.seed), args.length)
    log(f"{len(train_chapters)} training chapters ({train_windows[:, 1:].numel():,} tokens), "
        f"{len(held_out_chapters)} held out ({held_out_windows[:, 1:].numel():,})")

    config = demo_config(tokenizer, MAX_POSITIONS)
    model, mtp, record = train(config, tokenizer, train_chapters, seed=args.seed, steps=args.steps,
                               batch_size=args.batch, length=args.length, lr=args.lr, log=log)
    write_checkpoint(model, mtp, args.out)
    save_tokenizer(tokenizer, args.out, MAX_POSITIONS, TEMPLATE_PATH.read_text())

    think_id = tokenizer.token_to_id(THINK_OPEN)
    facts = measure_exported(args.out, train_windows, held_out_windows, held_out_chapters, think_id)
    facts |= run_facts(args, chapters, held_out_chapters, train_windows, model, mtp, record)
    facts |= {
        "total_minutes": (time.perf_counter() - started) / 60,
        "total_cpu_minutes": (time.process_time() - cpu_started) / 60,
        "files_bytes": folder_bytes(args.out, skip=("README.md",)),
    }
    (args.out / "README.md").write_text(render_card(facts))
    facts["folder_bytes"] = folder_bytes(args.out)

    for key in ("final_train_loss", "final_mtp_loss", "held_out_ppl", "unigram_ppl", "mtp_agreement",
                "greedy_acceptance", "tokens_per_cycle", "train_minutes", "train_cpu_minutes", "total_minutes",
                "total_cpu_minutes", "folder_bytes"):
        log(f"{key}: {facts[key]}")
    for prompt, reply in facts["samples"]:
        log(f"> {prompt}\n  {reply}")
    if facts["folder_bytes"] > SIZE_LIMIT_BYTES:
        sys.exit(f"{args.out} holds {facts['folder_bytes']:,} bytes, over the {SIZE_LIMIT_BYTES:,} limit")


if __name__ == "__main__":
    main()
