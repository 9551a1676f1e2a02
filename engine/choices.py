"""The words for the engine's choices: one vocabulary for `duet`, `duet models info` and the app.

StrEnum members equal their strings, so engine code that compares strings ("w4a8", "exact", "q4")
takes a member as it is.
"""

from __future__ import annotations

from enum import StrEnum


class Route(StrEnum):
    """How weights and activations meet in a product (DESIGN.md, Contracts)."""

    AUTO = "auto"  # the checkpoint's natural route: bf16 for float weights, w4a16 for INT4, w4a8 for GGUF
    BF16 = "bf16"
    W4A16 = "w4a16"
    W4A8 = "w4a8"


class Accept(StrEnum):
    """Speculative acceptance rule (REFERENCE.md section 5)."""

    EXACT = "exact"  # output keeps the model's own distribution
    LOSSY = "lossy"  # also keeps a rejected draft the model ranks at least as high as its replacement


class Draft(StrEnum):
    AUTO = "auto"  # the MTP head when the checkpoint has one, else n-gram lookup
    MTP = "mtp"
    NGRAM = "ngram"
    NONE = "none"


class KVCache(StrEnum):
    """The attention KV cache type, named by how a row is stored (engine.placement's words)."""

    BF16 = "bf16"  # not quantized: bf16 rows on the GPU (the CPU reference keeps fp32)
    Q8 = "q8"  # planning only: engine.placement sizes it, the engine has no q8 cache to run
    Q4 = "q4"  # 4 bits, Hadamard-rotated, sink and recent rows exact

    @property
    def runs(self) -> bool:
        """Whether the engine can run this cache, not only plan it."""
        return self is not KVCache.Q8
