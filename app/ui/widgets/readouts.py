"""The readout panel: speed and acceptance figures of the reply, the switches, and the context meter."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar, Select, Sparkline, Static, Switch

from duet.app.session import WARN_SHARE, Readout
from duet.engine import Accept, Route

SPARKLINE_POINTS = 40
NOTHING = "—"


def readout_rows(readout: Readout) -> list[tuple[str, str]]:
    """(label, value) rows; a figure the engine did not measure shows as a dash."""
    by_position = " ".join(f"{share:.0%}" for share in readout.accept_by_position)  # four fit the panel
    return [
        ("decode", f"{readout.decode_tok_s:.1f} tok/s" if readout.decode_tok_s else NOTHING),
        ("prefill", f"{readout.prefill_tok_s:.0f} tok/s" if readout.prefill_tok_s else NOTHING),
    ] + ([("reused", f"{readout.cached_tokens:,} tokens")] if readout.cached_tokens else []) + [  # the prompt cache's rows
        ("first token", f"{readout.first_token_s:.2f} s" if readout.first_token_s is not None else NOTHING),
        ("tokens/cycle", f"{readout.tokens_per_cycle:.2f}" if readout.tokens_per_cycle else NOTHING),
        ("acceptance", f"{readout.acceptance_rate:.0%}" if readout.acceptance_rate is not None else NOTHING),
        ("by position", by_position if readout.drafted else NOTHING),
        ("lossy kept", str(readout.n_lossy) if readout.drafted else NOTHING),
    ] + ([  # a MoE model: where its experts' bytes came from (engine/experts.py)
        ("experts on card", f"{readout.expert_hit_rate:.0%} of routes"),
        ("from RAM", f"{readout.host_bytes_per_token / 1e6:.2f} MB/token"),
        ("moe-skip", f"{readout.n_skipped} skipped"),
    ] if readout.expert_hit_rate is not None else [])


class Readouts(Vertical):
    """Figures of the reply streaming now, or of the last saved reply."""

    def compose(self) -> ComposeResult:
        yield Sparkline([], id="speed-sparkline")
        yield Static(id="figures")

    def on_mount(self) -> None:
        self.show(Readout())

    def show(self, readout: Readout) -> None:
        rows = readout_rows(readout)
        width = max(len(label) for label, _ in rows)
        self.query_one("#figures", Static).update("\n".join(f"{label:<{width}}  {value}" for label, value in rows))

    def start_reply(self) -> None:
        self.query_one(Sparkline).data = []

    def add_speed(self, tok_s: float) -> None:
        sparkline = self.query_one(Sparkline)
        sparkline.data = [*sparkline.data, tok_s][-SPARKLINE_POINTS:]


class ReadoutLine(Label):
    """The readout in one line, under the conversation when the panel is folded away (a narrow
    terminal): decode speed, tokens a cycle, acceptance, route, rule and context, all in words."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parts: dict[str, str] = {}

    def set(self, readout: Readout | None = None, route: str | None = None, accept: str | None = None,
            context: tuple[int, int] | None = None, choices: str | None = None) -> None:
        if readout is not None:
            self.parts["speed"] = f"{readout.decode_tok_s:.0f} tok/s" if readout.decode_tok_s else "— tok/s"
            self.parts["cycle"] = f"{readout.tokens_per_cycle:.2f} tok/cycle" if readout.tokens_per_cycle else ""
            self.parts["kept"] = f"{readout.acceptance_rate:.0%} kept" if readout.acceptance_rate is not None else ""
        if route is not None:
            self.parts["route"] = route
        if accept is not None:
            self.parts["accept"] = accept
        if context is not None:
            self.parts["context"] = f"ctx {context[0]:,}/{context[1]:,}"
        if choices is not None:
            self.parts["choices"] = choices
        order = ("speed", "cycle", "kept", "route", "accept", "choices", "context")
        self.update(" · ".join(self.parts[k] for k in order if self.parts.get(k)))


class SwitchPanel(Vertical):
    """The route the model runs and the acceptance rule; flipping them applies from the next cycle."""

    def compose(self) -> ComposeResult:
        yield Label("route")
        yield Select([], id="route", allow_blank=True, prompt="(no model)")
        with Horizontal(id="accept-row"):
            yield Label("accept: exact", id="accept-label")  # the rule in words: a knob alone is colour
            yield Switch(id="accept", tooltip="exact: output as the model's own; lossy: keeps more drafts")
        yield Label("", id="engine-choices")

    def show_choices(self, choices) -> None:
        """The next reply's drafts, depth and KV cache (EngineChoices), in words."""
        depth = "auto" if choices.depth is None else choices.depth
        self.query_one("#engine-choices", Label).update(f"drafts: {choices.draft}\ndepth: {depth}\nKV cache: {choices.kv}")

    def set_routes(self, routes: tuple[Route, ...], current: str) -> None:
        select = self.query_one("#route", Select)
        select.set_options([(route, route) for route in routes])
        select.value = current

    def set_accept(self, rule: Accept) -> None:
        self.query_one("#accept", Switch).value = rule == Accept.LOSSY
        self.show_accept(rule)

    def show_accept(self, rule: Accept) -> None:
        self.query_one("#accept-label", Label).update(f"accept: {rule}")


class ContextMeter(Vertical):
    """Tokens in the context of the budget; warns from WARN_SHARE on, and says so at the limit."""

    def compose(self) -> ComposeResult:
        yield Label("context", id="context-label")
        yield ProgressBar(total=1, show_eta=False, show_percentage=False, id="context-bar")

    def show(self, used: int, budget: int) -> None:
        share = used / budget if budget else 0.0
        self.query_one(ProgressBar).update(total=max(budget, 1), progress=min(used, budget))
        warning = "\nfull: you choose what to drop" if used >= budget else "\nnearly full" if share >= WARN_SHARE else ""
        self.query_one("#context-label", Label).update(f"context {used:,} / {budget:,}{warning}")
        self.set_class(share >= WARN_SHARE, "-warn")
        self.set_class(used >= budget, "-full")
