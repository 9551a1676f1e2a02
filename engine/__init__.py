"""duet's inference engine: a library with no UI imports.

    lm = load_model("models/demo", progress=print)
    ids = lm.tokenizer.encode(lm.tokenizer.render_chat([{"role": "user", "content": "Hi"}]))
    for event in generate(lm, ids, GenerateOptions(max_tokens=64)):
        ...
"""

from duet.engine.choices import Accept, Draft, KVCache, Route
from duet.engine.errors import CheckpointError, DuetError
from duet.engine.experts import check_moe_skip
from duet.engine.generate import Cycle, Finished, GenerateOptions, PromptCache, Stats, Switches, Tokens, generate
from duet.engine.loader import LoadedModel, LoadProgress, load_model
from duet.engine.sampling import SamplingParams

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
    "PromptCache",
    "Route",
    "SamplingParams",
    "Stats",
    "Switches",
    "Tokens",
    "check_moe_skip",
    "generate",
    "load_model",
]
