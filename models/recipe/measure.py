"""Figures for the model card, all computed from the exported bf16 files as a user would load them."""

import math

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3_5ForCausalLM

from mtp import MTPHead
from training import trained_targets

EVAL_BATCH = 16


def load_exported(out_dir):
    """(model, mtp, tokenizer) from out_dir in fp32: the bf16 weights exactly, computed in fp32."""
    model, info = Qwen3_5ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    mtp = MTPHead(model.config)
    tensors = load_file(out_dir / "model.safetensors")
    mtp.load_state_dict({k.removeprefix("mtp."): v.float() for k, v in tensors.items() if k.startswith("mtp.")})
    return model.eval(), mtp.eval(), AutoTokenizer.from_pretrained(out_dir)


@torch.no_grad()
def main_and_mtp_logits(model, mtp, batch):
    """Teacher-forced logits over a [B, L] batch: main [B, L, V] for x_{t+1}; MTP [B, L-1, V] for
    x_{t+2}, row t drafted from h_t and x_{t+1}."""
    hidden = model.model(input_ids=batch).last_hidden_state
    positions = torch.arange(1, batch.shape[1]).expand(batch.shape[0], -1)
    drafted = mtp(model.model.embed_tokens(batch[:, 1:]), hidden[:, :-1], positions)
    return model.lm_head(hidden), model.lm_head(drafted)


def held_out_figures(model, mtp, windows, think_id):
    """Mean NLL of the next tokens in the [N, L] windows that training scores (all but the template's
    `<think>`), and the share of positions where the MTP draft for x_{t+2} equals the main model's
    greedy token at t+1 (both teacher-forced)."""
    nll, agree, n_tokens, n_drafts = 0.0, 0, 0, 0
    for batch in windows.split(EVAL_BATCH):
        main, drafted = main_and_mtp_logits(model, mtp, batch[:, :-1])
        targets = trained_targets(batch[:, 1:], think_id)
        nll += F.cross_entropy(main.flatten(0, 1), targets.flatten(), reduction="sum").item()
        agree += (drafted.argmax(-1) == main[:, 1:].argmax(-1)).sum().item()
        n_tokens += (targets >= 0).sum().item()
        n_drafts += drafted.shape[0] * drafted.shape[1]
    return {"held_out_nll": nll / n_tokens, "held_out_ppl": math.exp(nll / n_tokens),
            "held_out_tokens": n_tokens, "mtp_agreement": agree / n_drafts, "mtp_positions": n_drafts}


def unigram_perplexity(train_windows, windows, vocab_size, think_id):
    """Perplexity of the same held-out targets under add-one smoothed unigram counts of the training
    windows' targets (same tokenizer)."""
    def targets(w):
        t = trained_targets(w[:, 1:], think_id).flatten().numpy()
        return t[t >= 0]

    counts = np.bincount(targets(train_windows), minlength=vocab_size) + 1
    log_p = np.log(counts / counts.sum())
    return math.exp(-log_p[targets(windows)].mean())


def greedy_reply(model, tokenizer, prompt, max_new_tokens, repetition_penalty=1.0):
    """(prompt ids, reply ids) of a greedy chat reply, stopping at either eos id."""
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         repetition_penalty=repetition_penalty, eos_token_id=model.config.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return ids[0], out[0, ids.shape[1]:]


def greedy_mtp_acceptance(model, mtp, prompt_ids, reply_ids):
    """(hits, drafts): drafts over the reply that equal the token greedy decoding committed next, i.e.
    what `--draft mtp` at depth 1 would accept (tokens per cycle = 1 + hits / drafts)."""
    sequence = torch.cat([prompt_ids, reply_ids])[None]
    main, drafted = main_and_mtp_logits(model, mtp, sequence)
    # drafts from the last prompt token on, each guessing a token inside the reply
    first = len(prompt_ids) - 1
    hits = drafted[0, first:-1].argmax(-1) == main[0, first + 1 : -1].argmax(-1)
    return hits.sum().item(), hits.numel()


def sample_prompts(chapters, count):
    """The first half of the first verse of `count` chapters spread over the held-out ones."""
    picks = [chapters[i * len(chapters) // count] for i in range(count)]
    return [" ".join(c[0].split()[: max(3, len(c[0].split()) // 2)]) for c in picks]
