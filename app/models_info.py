"""What a model needs on a card, for `duet models info` and the models screen: the bill of bytes,
the memory plan and the context budget, as a table or JSON.

Everything comes from tensor headers (engine.checkpoint.headers): on the hub only the headers are
fetched, never the weights. The figures are engine.placement's; this module only lays them out.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from duet.engine import KVCache
from duet.engine.checkpoint.headers import CheckpointHeaders, read_headers
from duet.engine.heads import RESCORE_CANDIDATES, shortlist_rows
from duet.engine.placement import (
    DEFAULT_ETA, EXPERTS, KV_TYPES, RTX_3090, Assessment, Card, Plan, Settings, GB, GiB, assess, attention_layers,
    describe_format, detect_card,
)


@dataclass(frozen=True)
class ModelPlan:
    """A checkpoint's tensor headers and what it needs on a card: the bill, the plan, the budget."""

    headers: CheckpointHeaders
    report: Assessment


def plan_model(source: str, patterns: tuple[str, ...] = (), card: Card | None = None, context: int | None = None,
               kv: KVCache = KVCache.BF16, host_tables: bool = False, depth: int | None = None,
               eta: float = DEFAULT_ETA, tau: float = 1.0) -> ModelPlan:
    """Plan a model folder, GGUF file or hub repo for `card` (default: the GPU here, else an RTX 3090),
    reading its tensor headers only; `patterns` pick the files of a hub repo."""
    headers = read_headers(source, patterns=patterns)
    report = assess(headers, card or detect_card() or RTX_3090, context, kv, host_tables, depth, eta, tau)
    return ModelPlan(headers, report)


def host_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def card_summary(p: Plan) -> str:
    verdict = "fits" if p.fits else "does not fit"
    return (f"{p.card.name}: {p.used / GiB:.2f} of {p.card.vram / GiB:.2f} GiB · {verdict} "
            f"at {p.context:,} tokens, KV {p.kv}")


def host_summary(p: Plan, memory: int) -> str:
    return (f"host memory: {sum(p.on_host.values()) / GiB:.2f} of {memory / GiB:.2f} GiB "
            "(tables and experts kept off the card)")


# --- JSON: every figure, bytes as integers ----------------------------------------------------------

def info_json(model: ModelPlan, detected: bool) -> dict:
    headers, r = model.headers, model.report
    c, bill, plan = headers.config, r.bill, r.plan
    return {
        "source": headers.source,
        "format": headers.format,
        "weights_format": describe_format(headers),
        "files": list(headers.files),
        "file_bytes": headers.file_bytes,
        "tensors": len(headers.tensors),
        "model": {
            "model_type": c.model_type, "layers": c.num_hidden_layers,
            "deltanet_layers": c.layer_types.count("linear_attention"), "attention_layers": attention_layers(c),
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "experts": c.num_experts,
            "experts_per_token": c.num_experts_per_tok, "mtp_layers": c.mtp_num_hidden_layers,
            "max_context": c.max_position_embeddings,
        },
        "card": {"name": plan.card.name, "vram_bytes": plan.card.vram, "bandwidth_bytes_per_s": plan.card.bandwidth,
                 "detected": detected},
        "settings": dataclasses.asdict(r.settings),
        "weights": _weights_json(r.weights),
        "bill": {
            **{k: v for k, v in dataclasses.asdict(bill).items() if k not in ("context", "kv", "depth")},
            "decoder_weights": bill.decoder_weights, "verify_pass": bill.verify_pass, "total": bill.total,
        },
        "plan": {"on_card": plan.on_card, "on_host": plan.on_host, "used": plan.used, "vram": plan.card.vram,
                 "fits": plan.fits, "experts_on_card": plan.experts_on_card},
        "max_context": {kv: {"tables_on_card": by[False], "host_tables": by[True]} for kv, by in r.max_context.items()},
        "ceiling": {"eta": r.eta, "tau": r.tau, "bytes_per_cycle": bill.total,
                    "cycles_per_s": r.ceiling_tok_s / r.tau, "tok_s": r.ceiling_tok_s},
        "w4_repack": _weights_json(r.w4_repack) if r.w4_repack else None,
        "alternatives": [{**dataclasses.asdict(a.settings), "used": a.used, "flags": _flags(a.settings, r.settings)}
                         for a in r.alternatives],
    }


def _weights_json(w) -> dict:
    return {**dataclasses.asdict(w), "decoder_weights": sum(w.decoder.values()), "shortlist": w.shortlist}


# --- the table ----------------------------------------------------------------------------------------

def info_lines(model: ModelPlan) -> list[str]:
    headers, r = model.headers, model.report
    return [*_model_lines(headers), "", *_bill_lines(headers, r), "", *_plan_lines(r), "", *_budget_lines(r),
            "", _ceiling_line(r)]


def _model_lines(h: CheckpointHeaders) -> list[str]:
    c = h.config
    files = f"{len(h.files)} file{'s' if len(h.files) > 1 else ''}"
    moe = f", {c.num_experts} experts ({c.num_experts_per_tok} routed a token)" if c.num_experts else ""
    return [
        f"{h.source} · {h.format}, {files}, {h.file_bytes / GB:.2f} GB, {len(h.tensors):,} tensors · {describe_format(h)}",
        f"{c.model_type}: {c.num_hidden_layers} layers ({c.layer_types.count('linear_attention')} DeltaNet + "
        f"{attention_layers(c)} attention){moe}, hidden {c.hidden_size:,}, vocab {c.vocab_size:,}, "
        f"MTP layers {c.mtp_num_hidden_layers}, context up to {c.max_position_embeddings:,}",
    ]


def _row(label: str, value: float, unit: float = GB, digits: int = 3) -> str:
    return f"  {label:<66}{value / unit:>9.{digits}f}"


def _bill_lines(h: CheckpointHeaders, r: Assessment) -> list[str]:
    b, w, s, c = r.bill, r.weights, r.settings, h.config
    drafts = f"{s.depth} MTP drafts (a verify pass of {s.depth + 1} rows)" if s.depth else "no drafts"
    head = (f"lm_head, int4 copy ({c.vocab_size:,} x {c.hidden_size:,}; top {RESCORE_CANDIDATES} rescored in bf16)"
            if w.int4_head else f"lm_head ({c.vocab_size:,} x {c.hidden_size:,}, as stored)")
    kinds = " · ".join(f"{k} {v / GB:.3f}" for k, v in b.decoder.items() if v)
    lines = [
        f"Bytes one cycle reads, GB: {drafts}, KV {s.kv} at {s.context:,} tokens",
        _row("decoder weights" + (" (routed experts: those the rows route to)" if b.decoder[EXPERTS] else ""), b.decoder_weights),
        f"    {kinds}",
        _row(head, b.lm_head),
        _row("embedding rows, rescored candidates' rows" + (", n-gram rows (host)" if c.flash else ""), b.lookups),
        _row("DeltaNet state, read and written", b.deltanet_state),
        _row("conv state" + (" (DeltaNet and PLE)" if c.flash else "") + ", read and written", b.conv_state),
        _row(f"KV cache, {attention_layers(c)} attention layers"
             + (f" (QSA: block keys, ~{c.flash.indexer_budget:,} rows a row)" if c.flash else ""), b.kv_cache),
        _row("= verify pass", b.verify_pass),
    ]
    if s.depth:
        lines += [
            _row(f"MTP drafting: {s.depth} x (MTP layer + {shortlist_rows(c.vocab_size):,}-row shortlist head)", b.drafting),
            _row(f"MTP KV cache, {s.depth} x {c.mtp_num_hidden_layers if b.drafting else 0} layer", b.drafting_kv),
            _row("rollback record: the DeltaNet state before the verify, each row's inputs", b.rollback),
            _row("= one cycle", b.total),
        ]
    lines.append("  not read:")
    lines += [_row(f"  {k}", v) for k, v in b.not_read.items()]
    return lines


def _plan_lines(r: Assessment) -> list[str]:
    p = r.plan
    lines = [f"Memory on the card, GiB: {p.card.name}, {p.card.vram / GiB:.2f} GiB, {p.card.bandwidth / 1e9:.0f} GB/s"]
    lines += [_row(k, v, GiB, 2) for k, v in p.on_card.items()]
    verdict = "fits" if p.fits else "does not fit"
    lines.append(_row(f"= in use, of {p.card.vram / GiB:.2f}: {verdict}", p.used, GiB, 2))
    if p.experts_on_card is not None:
        lines.append(f"  routed experts on the card: {p.experts_on_card:.0%}"
                     + (" (the rest run from host memory, not counted in the ceiling below)" if p.experts_on_card < 1 else ""))
    if p.on_host:
        lines.append("  in host memory: " + " · ".join(f"{k} {v / GiB:.2f} GiB" for k, v in p.on_host.items()))
    if not p.fits:
        lines.append("  what would fit:" if r.alternatives else "  nothing fits this card, even with q4 KV and host tables")
        lines += [f"    {_flags(a.settings, r.settings):<30}{a.settings.context:>9,} tokens, {a.used / GiB:.2f} GiB"
                  for a in r.alternatives]
    return lines


def _flags(s: Settings, asked: Settings) -> str:
    flags = []
    if s.context != asked.context:
        flags.append(f"--context {s.context}")
    if s.kv != asked.kv:
        flags.append(f"--kv {s.kv}")
    if s.host_tables != asked.host_tables:
        flags.append("--host-tables")
    if s.w4 != asked.w4:
        flags.append("W4 repack (duet convert)")
    return " ".join(flags)


def _budget_lines(r: Assessment) -> list[str]:
    return [
        f"Longest context that fits ({r.settings.depth} drafts)".ljust(36) + "".join(f"{kv:>10}" for kv in KV_TYPES),
        "  tables on the card".ljust(36) + "".join(f"{r.max_context[kv][False]:>10,}" for kv in KV_TYPES),
        "  --host-tables".ljust(36) + "".join(f"{r.max_context[kv][True]:>10,}" for kv in KV_TYPES),
    ]


def _ceiling_line(r: Assessment) -> str:
    card, g = r.plan.card, r.bill.total
    return (f"Ceiling: {r.eta:g} x {card.bandwidth / 1e9:.0f} GB/s / {g / GB:.3f} GB = {r.ceiling_tok_s / r.tau:.1f} cycles/s;"
            f" x tau {r.tau:g} = {r.ceiling_tok_s:.1f} tok/s")
