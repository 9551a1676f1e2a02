"""What several benchmarks share: argument types, model geometries, the prompt, thread counts, and our
engine's timed greedy decode."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duet.engine.config import FULL_ATTENTION, ModelConfig
from duet.engine.errors import DuetError
from duet.engine.model import Model

PROMPT_SEED = 0
WARMUP_PROMPT_TOKENS = 8

# Text geometries of real checkpoints, as Qwen3_5TextConfig arguments (REFERENCE.md section 1).
GEOMETRIES = {
    "qwen3.5-0.8b": dict(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ),
}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def require_reference(benchmark: str) -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise DuetError(f"duet bench {benchmark} needs torch and transformers: pip install 'duet[test]'") from None


def blas_threads() -> int:
    """Threads numpy's BLAS runs matmuls on: threadpoolctl's report, else what OpenBLAS picks itself."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return openblas_default_threads()
    pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
    numpy_pools = [p for p in pools if "numpy" in p["filepath"]]
    return (numpy_pools + pools)[0]["num_threads"] if pools else openblas_default_threads()


def openblas_default_threads() -> int:
    """OPENBLAS_NUM_THREADS, then OMP_NUM_THREADS, then one thread per CPU."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def random_prompt(vocab_size: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(PROMPT_SEED).integers(0, vocab_size, length)]


def geometry(config: ModelConfig) -> dict:
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "full_attention_layers": config.layer_types.count(FULL_ATTENTION),
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_key_heads": config.linear_num_key_heads,
        "linear_value_heads": config.linear_num_value_heads,
        "experts": config.num_experts,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


@dataclass(frozen=True)
class Run:
    """One timed generation: prefill of the prompt, then one forward pass per decode step."""

    prefill_s: float
    decode_s: float
    tokens: list[int]  # greedy: the one prefill produced, then one per decode step


Engine = Callable[[list[int], int], Run]  # (prompt ids, decode steps) -> Run


def ours_engine(model: Model) -> Engine:
    def timed_greedy(prompt: list[int], steps: int) -> Run:
        state = model.new_state()
        started = time.perf_counter()
        tokens = [int(np.argmax(model.logits(model.forward(state, prompt, last_only=True))[0]))]
        prefilled = time.perf_counter()
        for _ in range(steps):
            tokens.append(int(np.argmax(model.logits(model.forward(state, tokens[-1:]))[0])))
        return Run(prefilled - started, time.perf_counter() - prefilled, tokens)

    return timed_greedy
