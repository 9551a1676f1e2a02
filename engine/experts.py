"""Routed experts between the card and host RAM: which live on the card, what each pass reads from
the host, a routing census to choose them by, and llamAmpere's `--moe-skip`.

A MoE model too big for the card keeps its most-used experts there and runs the rest from RAM
(REFERENCE.md section 7: the seed's 24 GB card held 41% of Flash-Next's experts for a 91-93% hit
rate). Which experts are most used is a census: per layer, how often a calibration text (or the
user's own chats) routed a token to each. With a census, the card takes the most-routed (layer,
expert) pairs within its budget; without one, each layer's lowest-numbered experts, as many per
layer as fit. The engine counts every route of every pass as a hit (the expert is on the card) or
a miss (its bytes come from RAM): the hit rate and host bytes per token are measured, on the CPU
too, where the split runs as a budget.

`--moe-skip BUDGET` (lossy): per row, off-card routes are skipped, lowest router weight first, while
their summed weight stays within BUDGET; the first FIRST_ROUTES_KEPT routes always run. A skipped
expert adds nothing and the other weights are not renormalized. It changes the model's output, so
it runs only under lossy acceptance and is counted (`n_skipped`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duet.engine.errors import CheckpointError, DuetError

FIRST_ROUTES_KEPT = 5  # llamAmpere protects a row's first five routes from skipping
CENSUS_FILE = "duet-census.json"


def census_path(model_path: Path) -> Path:
    """Where a model's census lives: in its folder, or beside its .gguf file."""
    return model_path / CENSUS_FILE if model_path.is_dir() else model_path.with_name(f"{model_path.name}.{CENSUS_FILE}")


def save_census(path: Path, counts: np.ndarray, tokens: int) -> None:
    path.write_text(json.dumps({"format": "duet-census", "version": 1, "tokens": tokens,
                                "counts": counts.astype(int).tolist()}))


def load_census(path: Path, layers: int, experts: int) -> np.ndarray | None:
    """Counts [layers, experts] from a census file, None if there is none; a file of another model's
    shape, or not a census, is one line."""
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        counts = np.array(raw["counts"], dtype=np.int64)
    except (ValueError, KeyError, TypeError, OverflowError):
        raise CheckpointError(path, "is not a routing census; delete it or run `duet models census` again") from None
    if counts.shape != (layers, experts) or (counts < 0).any():
        raise CheckpointError(path, f"holds a census of shape {list(counts.shape)}, this model routes {layers} layers of "
                                    f"{experts} experts; delete it or run `duet models census` again")
    return counts


def experts_on_card(counts: np.ndarray | None, layers: int, experts: int, on_card: int) -> np.ndarray:
    """bool [layers, experts]: the `on_card` experts the card holds: the most-routed by the census
    (ties: the lower layer, then the lower expert), else the lowest-numbered of each layer."""
    chosen = np.zeros((layers, experts), bool)
    on_card = max(0, min(on_card, layers * experts))
    if counts is None:
        per_layer, extra = divmod(on_card, layers)
        for layer in range(layers):
            chosen[layer, : per_layer + (layer < extra)] = True
        return chosen
    order = np.argsort(-counts.ravel(), kind="stable")[:on_card]
    chosen.ravel()[order] = True
    return chosen


@dataclass
class ExpertRouting:
    """The experts on the card, and what the passes routed; MoE layers report each pass's routes here."""

    on_card: np.ndarray  # bool [layers, experts]
    expert_bytes: int  # one expert's bytes: what a miss reads from host RAM
    skip_budget: float = 0.0  # router weight a row may skip (off-card routes); 0: skip nothing
    census: np.ndarray | None = None  # int64 [layers, experts] while a census is being taken
    hits: int = 0
    misses: int = 0
    skipped: int = 0

    @property
    def share_on_card(self) -> float:
        return float(self.on_card.mean())

    def route(self, layer: int, chosen: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Count the routes of one MoE pass (chosen [T, k] in falling weight); returns the weights with
        the routes `--moe-skip` skips set to 0."""
        on = self.on_card[layer][chosen]
        if self.census is not None:
            np.add.at(self.census[layer], chosen.ravel(), 1)
        skip = np.zeros_like(on)
        if self.skip_budget > 0:
            skip = self._skipped(on, weights)
            weights = np.where(skip, 0.0, weights).astype(weights.dtype)
        self.hits += int((on & ~skip).sum())
        self.misses += int((~on & ~skip).sum())
        self.skipped += int(skip.sum())
        return weights

    def _skipped(self, on: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Per row: off-card routes past the first FIRST_ROUTES_KEPT, lowest weight first, while the
        skipped weight stays within the budget."""
        skip = np.zeros_like(on)
        for row in range(on.shape[0]):
            spent = 0.0
            for slot in range(on.shape[1] - 1, FIRST_ROUTES_KEPT - 1, -1):  # slots fall in weight
                if on[row, slot]:
                    continue
                if spent + weights[row, slot] > self.skip_budget:
                    break
                spent += weights[row, slot]
                skip[row, slot] = True
        return skip

    def reset_counts(self) -> None:
        self.hits = self.misses = self.skipped = 0


def check_moe_skip(budget: float, accept: str) -> None:
    if not 0 <= budget < 1:
        raise DuetError(f"--moe-skip is a share of the router weight from 0 to 1 (got {budget})")
    if budget and accept == "exact":
        raise DuetError("--moe-skip changes the model's answers, so it runs under lossy acceptance only; "
                        "add --accept lossy or drop --moe-skip")


def take_census(lm, token_ids: list[int], chunk: int = 512) -> tuple[np.ndarray, int]:
    """Run `token_ids` through the model (prefill chunks, no generation) and count every row's routes:
    (counts [layers, experts], tokens counted). The model's own routing is back in place after."""
    c, model = lm.config, lm.model
    token_ids = token_ids[: c.max_position_embeddings - 1]
    if not token_ids:
        raise DuetError("the census text is empty; give a text file with some prose or chat in it")
    shape = (len(c.moe_layers), c.num_experts)
    counting = ExpertRouting(np.ones(shape, bool), lm.expert_bytes, census=np.zeros(shape, np.int64))
    previous = model.routing
    model.use_routing(counting)
    try:
        state = model.new_state()
        for start in range(0, len(token_ids), chunk):
            model.forward(state, token_ids[start : start + chunk])
    finally:
        model.use_routing(previous)
    return counting.census, len(token_ids)
