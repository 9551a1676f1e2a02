"""The demo geometry, the token windows, and the joint training of the main model and its MTP head."""

import itertools
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from bpe import END_OF_TEXT, IM_END, THINK_OPEN
from kjv_chats import chat_pairs
from mtp import MTPHead

MTP_LOSS_WEIGHT = 0.5


def demo_config(tokenizer, max_positions):
    """A few-million-parameter qwen3_5_text: 6 DeltaNet + 2 gated-attention layers, Hv (4) > Hk (2)."""
    return Qwen3_5TextConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        # 16 of 64 head dims rotated; mrope sections cover those 8 frequencies (text positions ignore them)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        eos_token_id=[tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)],
        mtp_num_hidden_layers=1,
    )


def conversation_ids(tokenizer, pairs):
    """One int64 id array per conversation: prompt and reply encoded apart, then joined. Encoded as one
    string, the `\\n\\n` that ends the enable_thinking=false prompt would merge differently with the
    reply's first characters than it does when the prompt is encoded alone at chat time."""
    prompts = tokenizer.encode_batch([p for p, _ in pairs])
    replies = tokenizer.encode_batch([r for _, r in pairs])
    return [np.asarray(p.ids + r.ids, dtype=np.int64) for p, r in zip(prompts, replies)]


def conversation_windows(tokenizer, pairs, length):
    """[N, length] int64 windows cut back to back from the concatenated conversations; neighbours share
    one token so that every token is a target once. Conversations start anywhere in a window."""
    stream = np.concatenate(conversation_ids(tokenizer, pairs))
    n = (len(stream) - 1) // (length - 1)
    starts = np.arange(n)[:, None] * (length - 1)
    return torch.from_numpy(stream[starts + np.arange(length)])  # [N, length]


def training_batches(tokenizer, chapters, seed, batch_size, length):
    """Endless [batch_size, length] batches; every epoch draws fresh conversation cuts and order."""
    for epoch in itertools.count():
        windows = conversation_windows(tokenizer, chat_pairs(chapters, seed + 1 + epoch), length)
        for i in range(0, len(windows) - batch_size + 1, batch_size):
            yield windows[i : i + batch_size]


def trained_targets(batch, think_id):
    """The batch as targets, `<think>` ignored (-100). The template writes the empty think block into
    the prompt when enable_thinking is false; trained on, the model would open one by itself after
    half of the plain generation prompts."""
    return batch.masked_fill(batch == think_id, -100)


def joint_losses(model, mtp, batch, think_id):
    """(main CE of x_{t+1}, MTP CE of x_{t+2}) on a [B, L] batch. The MTP row at index t reads h_t and
    embed(x_{t+1}) at position t+1; gradients flow from both losses into the shared trunk."""
    inputs, targets = batch[:, :-1], trained_targets(batch, think_id)  # inputs [B, T], T = L - 1
    hidden = model.model(input_ids=inputs).last_hidden_state  # post final norm, [B, T, H]
    main_loss = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), targets[:, 1:].flatten())
    next_tokens = batch[:, 1:-1]  # x_{t+1} for t = 0 .. T-2
    positions = torch.arange(1, inputs.shape[1]).expand(batch.shape[0], -1)
    drafted = mtp(model.model.embed_tokens(next_tokens), hidden[:, :-1], positions)
    mtp_loss = F.cross_entropy(model.lm_head(drafted).flatten(0, 1), targets[:, 2:].flatten())
    return main_loss, mtp_loss


def adamw(params, lr, weight_decay):
    """AdamW with weight decay on matrices only (not on norms, A_log, dt_bias)."""
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def warmup_cosine(warmup, total, floor):
    """LR multiplier: linear warmup, then cosine from 1 down to floor at the last step."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(config, tokenizer, chapters, *, seed, steps, batch_size, length, lr, log):
    """Trains main model and MTP head together; returns (model, mtp, record of the run)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    mtp = MTPHead(config)
    mtp.init_weights(config.initializer_range)
    params = list({id(p): p for p in [*model.parameters(), *mtp.parameters()]}.values())  # tied weights once
    optimizer = adamw(params, lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, steps // 25), steps, 0.1))
    batches = training_batches(tokenizer, chapters, seed, batch_size, length)
    think_id = tokenizer.token_to_id(THINK_OPEN)
    model.train(), mtp.train()
    history, started, cpu_started = [], time.perf_counter(), time.process_time()
    for step in range(steps):
        # bf16 matmuls (AMX on this CPU, ~1.6x faster than fp32), fp32 weights, optimizer and losses
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main_loss, mtp_loss = joint_losses(model, mtp, next(batches), think_id)
        (main_loss + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        history.append((main_loss.item(), mtp_loss.item()))
        if (step + 1) % 25 == 0 or step + 1 == steps:
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            main_avg, mtp_avg = np.mean(history[-25:], axis=0)
            log(f"step {step + 1}/{steps}  loss {main_avg:.3f}  mtp {mtp_avg:.3f}  {wall:.0f}s wall {cpu:.0f}s cpu")
    model.eval(), mtp.eval()
    last = np.mean(history[-50:], axis=0)
    record = {
        "steps": steps,
        "tokens": steps * batch_size * (length - 1),
        "train_seconds": time.perf_counter() - started,
        "train_cpu_seconds": time.process_time() - cpu_started,
        "final_train_loss": float(last[0]),
        "final_mtp_loss": float(last[1]),
    }
    return model, mtp, record
