"""Writes the model folder: config.json and bf16 model.safetensors in the naming of real checkpoints."""

import torch
from safetensors.torch import save_file


def checkpoint_tensors(model, mtp):
    """{name: bf16 tensor}: `model.*` from the main model, `mtp.*` from the head; lm_head is tied to
    the embedding and left out, as tied Qwen3.5 checkpoints do."""
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors |= {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def write_config(config, out_dir):
    """config.json as save_pretrained writes it; mtp_num_hidden_layers rides along as a config extra."""
    assert config.mtp_num_hidden_layers == 1
    config.dtype = torch.bfloat16
    config.save_pretrained(out_dir)


def write_checkpoint(model, mtp, out_dir):
    write_config(model.config, out_dir)
    save_file(checkpoint_tensors(model, mtp), out_dir / "model.safetensors", metadata={"format": "pt"})
