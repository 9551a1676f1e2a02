"""The model card, models/demo/README.md, filled in from the run's measured figures."""

import html

CARD = """\
# duet demo: a small qwen3_5_text model with a trained MTP head

The model `duet` runs when no other model is given. It is a {params_main_m:.2f}M-parameter model in the
exact `qwen3_5_text` architecture (gated DeltaNet and gated attention layers), plus a
{params_mtp_m:.2f}M-parameter multi-token-prediction (MTP) head, trained from scratch on the King James
Bible in about {train_cpu_minutes:.0f} minutes on one CPU thread. Give it the start of a verse and it
continues the passage in the style of the KJV. It knows nothing else.

## Files
| file | what |
|---|---|
| `config.json` | `Qwen3_5TextConfig` as `save_pretrained` writes it, `model_type` `qwen3_5_text`, with `mtp_num_hidden_layers: 1` |
| `model.safetensors` | bf16, {tensor_count} tensors, {weights_bytes:,} bytes: `model.embed_tokens`, `model.layers.{{i}}.*`, `model.norm`, `mtp.*` (no `lm_head`: tied) |
| `tokenizer.json`, `tokenizer_config.json` | byte-level BPE, {vocab_size} ids; eos `<|im_end|>`, pad `<|endoftext|>` |
| `chat_template.jinja` | ChatML; `enable_thinking=false` adds an empty `<think>` block to the generation prompt |

All files but this card: {files_bytes:,} bytes.

## Architecture
hidden {hidden}, {layers} layers `{layer_pattern}` (DeltaNet `L`, gated attention `A`), attention
{heads} query / {kv_heads} KV heads of dim {head_dim} with partial RoPE ({rotary_dims} dims, theta
{rope_theta:g}), DeltaNet {hk} key heads (dim {dk}) and {hv} value heads (dim {dv}), conv kernel {conv},
MLP {intermediate}, tied embeddings, max positions {max_positions}. Stop ids {eos_ids}
(`<|endoftext|>`, `<|im_end|>`).

MTP head in the layout of real Qwen3.5 checkpoints: `mtp.fc` [{hidden}, {hidden2}] over
`[pre_fc_norm_embedding(embed(x_t+1)) ; pre_fc_norm_hidden(h_t)]` (embedding first, h_t after the final
norm), one full-attention decoder layer `mtp.layers.0.*` at the position of x_t+1, `mtp.norm`, then the
shared lm_head gives logits for x_t+2. transformers loads this folder with `Qwen3_5ForCausalLM` and
ignores `mtp.*`.

## Data and licence
Source: the Debian package `bible-kjv-text` {text_version} (the text; the `bible` reader of
`bible-kjv` {reader_version} extracts it): the King James Version of 1611, {verses:,} verses in
{chapters:,} chapters. The package's copyright file states that the copyright of the KJV text has
expired; the text is in the public domain in most of the world (in the United Kingdom the Crown's
letters patent still govern printing it). The retrieval program is GPL-2+; only its output text was used.

Chapters were split with seed {seed}: {held_out_chapters} chapters ({held_out_percent:.0f}%) held out for
evaluation, the rest for training. Each chapter is read through as conversations of one to three turns:
the user gives a verse, or the first words of one, and the assistant continues with the rest of that
verse and up to three more. Half the conversations carry the empty `<think>\\n\\n</think>\\n\\n` block
that `enable_thinking=false` adds; its `<think>` is never a training target, so the model does not open
a think block by itself. Conversations are rendered with `chat_template.jinja`, prompt and reply
tokenized apart as in a chat, and trained on whole (user turns are KJV too), so the model learns to end
its turn with `<|im_end|>`.

## Training
Joint training of model and MTP head from scratch, loss = CE(x_t+1) + {mtp_weight} * CE_MTP(x_t+2), the MTP
loss also flowing into the trunk. AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak lr {lr:g},
linear warmup then cosine to 10%, gradient clip 1.0, batches of {batch} windows of {length} tokens cut
back to back from the shuffled conversations (fresh conversation cuts every epoch), {steps} steps =
{train_tokens:,} tokens (~{epochs:.1f} epochs of the {epoch_tokens:,}-token training split). Matmuls ran in bf16
under autocast, weights, optimizer state and losses in fp32, on one CPU thread (Xeon with AMX). Training
took {train_cpu_minutes:.1f} CPU minutes ({train_minutes:.1f} minutes wall-clock, which exceeds CPU time only
when other jobs share the CPU); the whole recipe {total_cpu_minutes:.1f} CPU minutes ({total_minutes:.1f} wall).

Final training loss (mean of the last 50 steps): {final_train_loss:.3f} (main), {final_mtp_loss:.3f} (MTP).

## Evaluation (held-out chapters, the bf16 weights of this folder, computed in fp32)
| figure | value |
|---|---|
| held-out perplexity ({held_out_tokens:,} tokens of chat text, all but the template's `<think>`) | **{held_out_ppl:.2f}** |
| unigram perplexity, same tokens (add-one smoothed counts of the training split) | {unigram_ppl:.1f} |
| MTP agreement: draft for x_t+2 = main model's greedy token at t+1, teacher-forced ({mtp_positions:,} positions) | **{mtp_agreement:.1%}** |
| MTP acceptance on the model's own plain greedy replies to {greedy_prompts} held-out prompts ({greedy_positions:,} drafts; their loops are easy to draft) | {greedy_acceptance:.1%} |
| implied tokens per cycle, greedy `--draft mtp` at depth 1 | {tokens_per_cycle:.2f} |

## Samples
Held-out prompts, greedy decoding with repetition penalty {sample_penalty} (plain greedy decoding soon
falls into loops at this size):

{samples}

## Limitations
It writes KJV-flavoured sentences, not sense, and nothing but KJV.

## Reproduce
```
apt-get install bible-kjv          # pulls in bible-kjv-text
pip install -e .[train]            # torch, transformers
python models/recipe/train_demo.py --out models/demo
```
The recipe is deterministic given the seed on one machine (different CPUs may round differently).
"""

SAMPLE = """\
> **user:** {prompt}
>
> **assistant:** {reply}
"""


def shown(text):
    """Text on one quoted line with its tags and newlines visible (a reply may open with the empty
    think block)."""
    return html.escape(text, quote=False).replace("\n", "\\n")


def render_card(facts):
    samples = "\n".join(SAMPLE.format(prompt=p, reply=shown(r)) for p, r in facts["samples"])
    return CARD.format(**facts | {"samples": samples})
