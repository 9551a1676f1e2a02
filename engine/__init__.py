"""duet's inference engine: a library with no UI imports.

    lm = load_model("models/demo", progress=print)
    ids = lm.tokenizer.encode(lm.tokenizer.render_chat([{"role": "user", "content": "Hi"}]))
    for event in generate(lm, ids, GenerateOptions(max_tokens=64)):
        ...
"""

from engine.choices import Accept, Draft, KVCache, Route
from engine.errors import CheckpointError, DuetError
from engine.generate import Cycle, Finished, GenerateOptions, Stats, Switches, Tokens, generate
from engine.loader import LoadedModel, LoadProgress, load_model
from engine.sampling import SamplingParams

__all__ = [
    "Accept",
    "CheckpointError",
    "Cycle",
    "Draft",
    "DuetError",
    "Finished",
    "GenerateOptions",
    "KVCache",
    "LoadProgress",
    "LoadedModel",
    "Route",
    "SamplingParams",
    "Stats",
    "Switches",
    "Tokens",
    "generate",
    "load_model",
]
