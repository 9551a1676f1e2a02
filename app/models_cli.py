"""`duet models {list,pull,rm,info,census,import}`: the models screen's work without the UI."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from duet.app.catalog import (
    clear_stale_staging, delete_model, find_in_catalog, find_local, human_size, import_model, load_catalog, local_models,
)
from duet.app.arguments import RENAMED_KV, choice
from duet.app.downloads import DownloadProgress, download_model, remote_model
from duet.app.models_info import info_json, info_lines, plan_model
from duet.app.settings import user_paths
from duet.app.store import Store
from duet.engine import DuetError, KVCache, load_model
from duet.engine.experts import census_path, save_census, take_census
from duet.engine.placement import DEFAULT_ETA, RTX_3090, Card, GiB, detect_card

EXIT_INTERRUPTED = 130


def add_models_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="models_command", required=True, metavar="COMMAND")
    listing = commands.add_parser("list", help="the catalog and the models on disk")
    listing.set_defaults(run=run_list)
    pull = commands.add_parser("pull", help="download a catalog model or any hub repo (verified, then registered)")
    pull.add_argument("name", help="catalog name or hub repo id (owner/name)")
    pull.add_argument("--include", action="append", default=[], metavar="PATTERN",
                      help="only files matching this glob (repeatable; default: the catalog's, else model files)")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.set_defaults(run=run_pull)
    remove = commands.add_parser("rm", help="delete a model from disk and say how much was freed")
    remove.add_argument("name", help="name from duet models list")
    remove.set_defaults(run=run_rm)
    info = commands.add_parser("info", help="bytes per pass, memory plan and context budget, from tensor headers only")
    info.add_argument("name", help="a model folder or GGUF file, a name from duet models list, or a hub repo id")
    info.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    add_plan_arguments(info)
    info.set_defaults(run=run_info)
    census = commands.add_parser("census", help="count a MoE model's expert routes over a text, saved beside the "
                                                "model: which experts its card holds from the next load on")
    census.add_argument("name", help="a model folder or GGUF file, or a name from duet models list")
    source = census.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="a text file to count over (a calibration text)")
    source.add_argument("--chats", action="store_true", help="count over your saved conversations, as the model saw them")
    census.set_defaults(run=run_census)
    importing = commands.add_parser("import", help="check a model folder, then add it to duet's models")
    importing.add_argument("path", help="a model folder (config.json, tokenizer, safetensors)")
    importing.add_argument("--name", help="name in the models dir (default: the folder's name)")
    importing.set_defaults(run=run_import)


def run_list(args: argparse.Namespace) -> int:
    models_dir = user_paths().models_dir
    local = local_models(models_dir)
    on_disk = {m.repo.lower() for m in local if m.repo} | {m.name.lower() for m in local}
    print("catalog (duet models pull NAME)")
    for entry in load_catalog():
        here = "on disk" if entry.name.lower() in on_disk or entry.repo.lower() in on_disk else ""
        made_by = " (community)" if entry.community else ""
        print(f"  {entry.name:<20} {entry.params:<9} {entry.format:<8} {(entry.repo or 'ships with duet') + made_by:<58} {here}")
    print(f"on disk ({models_dir})")
    for model in local:
        print(f"  {model.name:<40} {model.where:<9} {human_size(model.size):>9}  {model.path}")
    if not local:
        print("  (none)")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    models_dir = user_paths().models_dir
    clear_stale_staging(models_dir)
    entry = find_in_catalog(args.name, load_catalog())
    if entry is not None and entry.bundled:
        raise DuetError(f"{entry.name} ships with duet; nothing to download")
    repo = entry.repo if entry else args.name
    if "/" not in repo:
        raise DuetError(f"{args.name}: not in the catalog and not a hub repo id (owner/name); see duet models list")
    patterns = tuple(args.include) or (entry.files if entry else ())
    remote = remote_model(repo, patterns, args.revision)
    print(f"{repo}: {len(remote.files)} files, {human_size(remote.size)}", file=sys.stderr)
    cancel = threading.Event()
    try:
        model = download_model(remote, models_dir, ProgressLine(sys.stderr), cancel)
    except KeyboardInterrupt:
        print("\ndownload interrupted; nothing was kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"\n{model.name}: {human_size(model.size)} in {model.path}", file=sys.stderr)
    return 0


def run_rm(args: argparse.Namespace) -> int:
    model = find_local(args.name, user_paths().models_dir)
    if model is None:
        raise DuetError(f"{args.name}: no model of that name on disk; see duet models list")
    freed = delete_model(model)
    print(f"deleted {model.name}; freed {human_size(freed)}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    """A path, then a model on disk, then a catalog entry (on the hub), then a hub repo id."""
    if Path(args.name).expanduser().exists():
        return run_model_info(args.name, args)
    model = find_local(args.name, user_paths().models_dir)
    if model is not None:
        return run_model_info(str(model.path), args)
    entry = find_in_catalog(args.name, load_catalog())
    if entry is not None and entry.repo:
        return run_model_info(entry.repo, args, entry.files)
    if "/" in args.name:
        return run_model_info(args.name, args)
    raise DuetError(f"{args.name}: not a model folder or file, a model on disk, a catalog name or a hub repo id")


def run_census(args: argparse.Namespace) -> int:
    path = Path(args.name).expanduser()
    if not path.exists():
        model = find_local(args.name, user_paths().models_dir)
        if model is None:
            raise DuetError(f"{args.name}: not a model folder or file, or a model on disk (duet models list)")
        path = model.path
    text = None if args.chats else _read_text(Path(args.text).expanduser())
    lm = load_model(path)
    if not lm.config.is_moe:
        raise DuetError(f"{path}: not a mixture-of-experts model; a census counts routed experts")
    counts, tokens = take_census(lm, lm.tokenizer.encode(text) if text is not None else _chat_tokens(lm.tokenizer))
    where = census_path(lm.path)
    save_census(where, counts, tokens)
    routing = lm.place_experts()
    print(f"census of {tokens:,} tokens saved to {where}; {routing.share_on_card:.0%} of the routed experts on the card, "
          f"which took {counts[routing.on_card].sum() / max(1, counts.sum()):.1%} of the routes")
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DuetError(f"{path}: cannot read it as UTF-8 text ({error.__class__.__name__}); give a text file") from None


def _chat_tokens(tokenizer) -> list[int]:
    """Every saved conversation rendered with the model's chat template, one after another."""
    paths = user_paths()
    if not paths.database.exists():
        raise DuetError(f"{paths.database}: no saved conversations yet; chat first, or pass --text FILE")
    store = Store(paths.database)
    try:
        ids = []
        for conversation in store.conversations():
            messages = [{"role": m.role, "content": m.content} for m in store.messages(conversation.id)]
            ids += tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=False)) if messages else []
    finally:
        store.close()
    return ids


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    plan = parser.add_argument_group("plan for a card (default: the GPU here, else an RTX 3090)")
    plan.add_argument("--vram", type=float, metavar="GiB", help="card memory as sold (24 for an RTX 3090)")
    plan.add_argument("--bandwidth", type=float, metavar="GB/s", help="card memory bandwidth (936 for an RTX 3090)")
    plan.add_argument("--context", type=int, help="tokens of context to plan for (default: the model's longest)")
    plan.add_argument("--kv", **choice(KVCache, RENAMED_KV), default=KVCache.BF16,
                      help="KV cache type (default bf16); q8 is planning-only: duet runs bf16 and q4")
    plan.add_argument("--host-tables", action="store_true",
                      help="keep the bf16 embedding and rescoring head in host memory")
    plan.add_argument("--depth", type=int, help="drafts a cycle (default: 3 with an MTP head, else 0)")
    plan.add_argument("--eta", type=float, default=DEFAULT_ETA, help=f"share of peak bandwidth reached (default {DEFAULT_ETA})")
    plan.add_argument("--tau", type=float, default=1.0, help="tokens committed a cycle (default 1)")


def card_from(args: argparse.Namespace) -> tuple[Card, bool]:
    """The card to plan for, and whether it was detected here. Flags override what is detected."""
    detected = None if args.vram and args.bandwidth else detect_card()
    base = detected or RTX_3090
    vram = int(args.vram * GiB) if args.vram else base.vram
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else base.bandwidth
    name = base.name if (args.vram, args.bandwidth) == (None, None) else "card from --vram/--bandwidth"
    return Card(name, vram, bandwidth), detected is not None


def run_model_info(source: str, args: argparse.Namespace, patterns: tuple[str, ...] = ()) -> int:
    for flag in ("vram", "bandwidth", "context", "depth", "eta", "tau"):
        value = getattr(args, flag)
        if value is not None and (value < 0 or (value == 0 and flag not in ("context", "depth"))):
            raise DuetError(f"--{flag} {value}: must be {'zero or ' if flag in ('context', 'depth') else ''}positive")
    card, detected = card_from(args)
    plan = plan_model(source, patterns, card, args.context, args.kv, args.host_tables, args.depth, args.eta, args.tau)
    print(json.dumps(info_json(plan, detected)) if args.json else "\n".join(info_lines(plan)))
    return 0


def run_import(args: argparse.Namespace) -> int:
    model = import_model(Path(args.path), user_paths().models_dir, args.name)
    print(f"imported {model.name}: {human_size(model.size)} in {model.path}")
    return 0


class ProgressLine:
    """Download progress redrawn on one terminal line; a line per finished file elsewhere."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, p: DownloadProgress) -> None:
        if self.tty:
            eta = f" · {p.eta_seconds:.0f} s left" if p.eta_seconds is not None else ""
            self.stream.write(f"\r\033[K{p.filename} {human_size(p.file_done)}/{human_size(p.file_total)} · "
                              f"all {p.done / p.total if p.total else 1:.0%} of {human_size(p.total)} · "
                              f"{human_size(p.bytes_per_second)}/s{eta}")
        elif p.file_done == p.file_total:
            self.stream.write(f"{p.filename}: {human_size(p.file_total)}\n")
        self.stream.flush()
