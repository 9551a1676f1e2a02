"""load_model, the one way to load: open (config, tokenizer, headers) -> plan and check -> read -> assemble.

A model folder or GGUF file becomes weights in memory, a tokenizer and a config, with progress events.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duet.engine.assemble import Linears, assemble, routed_expert
from duet.engine.backend import compiled, compiled_sampling
from duet.engine.backend.cpu_ops import CpuOps
from duet.engine.backend.select import backend_name, gpu_geometry_problem
from duet.engine.checkpoint.gguf import GGUFCheckpoint, find_gguf
from duet.engine.checkpoint.hf import TensorPlan, read_weights
from duet.engine.checkpoint.quantized import read_quantization
from duet.engine.checkpoint.trellis_files import read_trellis
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.config import ModelConfig
from duet.engine.errors import CheckpointError, DuetError
from duet.engine.experts import ExpertRouting, census_path, experts_on_card, load_census
from duet.engine.model import Model, MoE
from duet.engine.tokenizer import Tokenizer
from duet.engine.weights import ModelWeights


@dataclass(frozen=True)
class LoadProgress:
    """How far a load is: in stage WEIGHTS, bytes of weights read out of the total the model needs;
    in stage KERNELS, CPU kernels compiled (a machine's first run) or loaded from the disk cache."""

    WEIGHTS = "weights"
    KERNELS = "kernels"

    done_bytes: int
    total_bytes: int
    stage: str = WEIGHTS


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Model
    tokenizer: Tokenizer | None  # None when load_model was asked for the network alone
    route: str
    routes: tuple[str, ...] = ()  # every route this checkpoint can run, the natural one first
    weights: ModelWeights | None = field(default=None, repr=False)  # kept when there is another route to build
    host_tables: bool = False  # the head ranks with an int4 copy and rescores with bf16 rows (engine/heads.py)
    expert_bytes: int = 0  # one routed expert of one layer, as stored (0: not a MoE)
    experts_on_card: np.ndarray | None = None  # GPU MoE: bool [layers, experts] the card holds; None: all where the model runs

    @functools.cached_property
    def mtp_draft_share(self) -> float:
        """What an MTP draft reads (its layer and the draft head) over what a decode pass reads, by
        placement's bill of bytes: a draft's cost in decode steps where passes are bound by reading
        weights. Depth (engine/speculative.py) weighs drafts with it."""
        from duet.engine.checkpoint.headers import read_headers
        from duet.engine.placement import bill_of_bytes, weights_of

        weights = weights_of(read_headers(str(self.path)), w4=False)
        return bill_of_bytes(weights, self.config, depth=1).drafting / bill_of_bytes(weights, self.config).verify_pass

    def place_experts(self, on_card: int | None = None) -> ExpertRouting:
        """Put `on_card` routed experts on the card (expert_placement) and count every pass's routes
        from now on. On the GPU the experts move: those leaving the card become the CPU's Linears, run
        on the host; those joining it go up. On the CPU the placement is a budget: counted, not moved."""
        mask = expert_placement(self.path, self.config, on_card)
        if self.experts_on_card is not None:
            self._move_experts(mask)
        routing = ExpertRouting(mask, self.expert_bytes)
        self.model.use_routing(routing)
        return routing

    def _move_experts(self, mask: np.ndarray) -> None:
        get = Linears(self.weights, self.route, self.model.ops, mask)
        for i, layer in enumerate(self.model.layers):
            moved = np.flatnonzero(mask[i] != self.experts_on_card[i]) if isinstance(layer.ffn, MoE) else []
            for e in moved:
                layer.ffn.experts[e] = routed_expert(get, f"layers.{i}.mlp.", int(e), i)
        self.experts_on_card = mask

    def use_route(self, route: str) -> None:
        """Run the next forward pass on another route of the same weights, without reading files again.

        Between the two quantized routes only the Linear wrappers change; the `bf16` route of a
        quantized checkpoint dequantizes every matrix to fp32 (memory x8 of the packed form). The
        old route's layers go first, so memory never holds both routes.
        """
        if route == self.route:
            return
        if route not in self.routes or self.weights is None:
            raise DuetError(f"{self.name} cannot run the {route} route; it runs {' or '.join(self.routes)}")
        self.model.drop_weights()
        self.model.take_weights(assemble(self.weights, route, self.host_tables, self.model.ops, self.experts_on_card))
        self.route = route


def load_model(path: str | Path, progress: Callable[[LoadProgress], None] | None = None,
               route: str = "auto", host_tables: bool = False, tokenizer: bool = True,
               backend: str | None = None) -> LoadedModel:
    """Read config, tokenizer and the tensors the text model needs (never the vision tower).

    `path` is a model folder (safetensors: bf16, or INT4 compressed-tensors / GPTQ) or a .gguf file
    (or a folder holding one). `route` is bf16, w4a16, w4a8, or auto for the checkpoint's natural
    one. Headers, shapes, the route and the tokenizer are all checked before any weight data is
    read, so a bad file fails fast with one line naming it. `host_tables`: see engine/heads.py.
    `tokenizer=False` loads the network alone (benchmarks and tests of checkpoints saved without one).
    `backend`: cpu, cupy or auto; None takes DUET_BACKEND (auto when unset).
    """
    opened = open_model(path, tokenizer)
    report = (lambda done, total: progress(LoadProgress(done, total))) if progress else None
    try:
        chosen = resolve_route(route, opened.routes, opened.description, opened.location)
        chosen_backend = choose_backend(opened.config, opened.location, backend)
        weights = read_weights(opened.checkpoint, opened.config, report, opened.quantized, host_tables)
    finally:
        opened.checkpoint.close()
    # On the GPU a MoE's routed experts are placed before anything is uploaded: those off the card never go up.
    on_card = expert_placement(opened.location, opened.config) if opened.config.is_moe and chosen_backend == "cupy" else None
    model = assemble_on(weights, chosen, host_tables, chosen_backend, opened.location, on_card)
    if isinstance(model.ops, CpuOps):  # the CPU's after all (a weight the GPU kernels do not take): nothing to place
        chosen_backend, on_card = "cpu", None
    # The CPU's kernels: the model's, or its host experts', the sampler's (on the host whatever the backend),
    # and its MTP passes' in one call where it has their plan
    compiled.compile_kernels(progress and (lambda done, total: progress(LoadProgress(done, total, LoadProgress.KERNELS))),
                             model_kernels=chosen_backend == "cpu" or on_card is not None,
                             also=compiled_sampling.host_steps(model.mtp_plan is not None),
                             helper=compiled_sampling.FIRST_RUN_HELPER)
    lm = LoadedModel(opened.name, opened.location, opened.config, model,
                     opened.tokenizer, route=chosen, routes=opened.routes,
                     weights=weights if len(opened.routes) > 1 or on_card is not None else None, host_tables=host_tables,
                     expert_bytes=_expert_bytes(weights), experts_on_card=on_card)
    if opened.config.is_moe:
        lm.place_experts()
    return lm


def expert_placement(path: Path, config: ModelConfig, on_card: int | None = None) -> np.ndarray:
    """bool [layers, experts]: the routed experts the card holds, `on_card` of them (the most-routed
    by the census beside the model, if any; engine/experts.py). None: as many as the plan of this
    machine's card (an RTX 3090 without one) fits at a q4 cache of the model's longest context."""
    routed = sum(config.moe_layers) * config.num_experts
    if on_card is None:
        from duet.engine.checkpoint.headers import read_headers
        from duet.engine.placement import RTX_3090, assess, detect_card

        share = assess(read_headers(str(path)), detect_card() or RTX_3090, kv="q4").plan.experts_on_card
        on_card = round((1.0 if share is None else share) * routed)
    layers = len(config.moe_layers)
    census = load_census(census_path(path), layers, config.num_experts)
    return experts_on_card(census, layers, config.num_experts, on_card) & np.array(config.moe_layers)[:, None]


def _expert_bytes(weights: ModelWeights) -> int:
    """One routed expert of one layer as stored, averaged over the trunk's experts."""
    c = weights.config
    parts = [(key, value) for key, value in weights.tensors.items() if key.startswith("layers.") and ".mlp.experts." in key]
    if not parts:
        return 0
    return sum(value.nbytes for _, value in parts) // (sum(c.moe_layers) * c.num_experts)


BACKEND_ENV = "DUET_BACKEND"  # cpu or cupy forces a backend; unset or auto: cupy where a GPU and CuPy are


def choose_backend(config: ModelConfig, source: Path, requested: str | None = None) -> str:
    """`cpu` or `cupy` for this model: as requested, else DUET_BACKEND if set, else the GPU when
    there is one and our kernels take the model's geometry."""
    requested = requested or os.environ.get(BACKEND_ENV, "auto")
    try:
        name = backend_name(requested)
    except ValueError as error:
        raise DuetError(f"{BACKEND_ENV}={requested}: {error}") from None
    problem = gpu_geometry_problem(config) if name == "cupy" else None
    if problem and requested == "cupy":
        raise DuetError(f"{source}: the GPU kernels cannot run {problem}; unset {BACKEND_ENV} to run on the CPU")
    return "cpu" if problem else name


def assemble_on(weights: ModelWeights, route: str, host_tables: bool, backend: str, source: Path,
                experts_on_card: np.ndarray | None = None) -> Model:
    """The Model on the CPU op set, or on the GPU's (engine/backend/cupy_model.py, imported only here).
    A weight our GPU kernels do not take keeps the model on the CPU, unless the GPU was forced."""
    if backend == "cupy":
        from duet.engine.backend.cupy_model import GpuOps

        try:
            return assemble(weights, route, host_tables, GpuOps(weights.config), experts_on_card)
        except ValueError as error:
            if os.environ.get(BACKEND_ENV) == "cupy":
                raise DuetError(f"{source}: {error}; unset {BACKEND_ENV} to run on the CPU") from None
    return assemble(weights, route, host_tables)


def check_model(path: str | Path) -> ModelConfig:
    """Everything load_model checks before it reads a weight (config, tokenizer, every tensor header)."""
    opened = open_model(path)
    try:
        TensorPlan(opened.checkpoint, opened.config, opened.quantized)
    finally:
        opened.checkpoint.close()
    return opened.config


@dataclass
class OpenedModel:
    """A checkpoint whose headers, config and tokenizer are read, with no weight data touched."""

    name: str
    location: Path
    config: ModelConfig
    tokenizer: Tokenizer | None
    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint
    quantized: object  # the checkpoint's quantization (INT4 or GGUF blocks), None for float weights
    routes: tuple[str, ...]
    description: str


def open_model(path: str | Path, tokenizer: bool = True) -> OpenedModel:
    model_path = Path(path).expanduser()
    gguf_file = find_gguf(model_path)
    if gguf_file is not None:
        checkpoint = GGUFCheckpoint(gguf_file)
        location = gguf_file.resolve()
        return OpenedModel(location.stem, location, checkpoint.config, checkpoint.tokenizer() if tokenizer else None,
                           checkpoint, checkpoint.quantized, checkpoint.routes, checkpoint.description)
    if not model_path.is_dir():
        raise DuetError(f"{model_path}: not a model folder or .gguf file; give a folder holding config.json "
                        "or a .gguf file")
    config = ModelConfig.from_file(model_path / "config.json")
    text = Tokenizer.from_dir(model_path, extra_eos_ids=config.eos_token_ids) if tokenizer else None
    checkpoint = SafetensorsCheckpoint(model_path)
    quantized = read_trellis(checkpoint) or read_quantization(model_path, checkpoint)
    routes, description = (quantized.routes, quantized.description) if quantized else (("bf16",), "bf16 safetensors")
    location = model_path.resolve()
    return OpenedModel(location.name, location, config, text, checkpoint, quantized, routes, description)


def resolve_route(requested: str, available: tuple[str, ...], description: str, source) -> str:
    """`auto` -> the checkpoint's natural route (first of available); a route it cannot run -> one line."""
    if requested == "auto":
        return available[0]
    if requested not in available:
        others = " or ".join(available)
        raise CheckpointError(source, f"route {requested} cannot run {description} weights; use --route {others}")
    return requested
