"""The MTP head in the layout of real Qwen3.5 checkpoints, built from transformers' own blocks.

Draft step (REFERENCE.md section 1): u = fc([norm_e(embed(x_{t+1})) ; norm_h(h_t)]), one full-attention
decoder layer at the positions of the x_{t+1} tokens, mtp.norm, then the main model's tied lm_head
gives logits for x_{t+2}. h_t is the main model's post-final-norm hidden state.
"""

import copy

import torch
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)


def mtp_layer_config(config):
    """A copy of the main config describing one full-attention layer (the MTP layer's geometry)."""
    layer_config = copy.deepcopy(config)
    layer_config.num_hidden_layers = 1
    layer_config.layer_types = ["full_attention"]
    return layer_config


class MTPHead(nn.Module):
    """Parameter names match the checkpoint's `mtp.*` tensors once prefixed with `mtp.`."""

    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        layer_config = mtp_layer_config(config)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(layer_config)

    def init_weights(self, std):
        """Linear weights ~ N(0, std) as transformers' init does; zero-centred norms start at 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, Qwen3_5RMSNorm):
                nn.init.zeros_(module.weight)

    def forward(self, next_embeds, hidden, positions):
        """next_embeds = embed(x_{t+1}) and hidden = h_t, both [B, T, H]; positions [B, T] are those of
        x_{t+1}. Returns the MTP layer's normed output [B, T, H]; apply the shared lm_head for x_{t+2}."""
        fused = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(fused)  # [B, T, 2H] -> [B, T, H]
        position_embeddings = self.rotary_emb(x, positions)
        # attention_mask=None makes the sdpa path causal over T
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)
