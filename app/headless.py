"""`duet --headless PROMPT`: reply text streams to stdout, stats go to stderr, `--json` for scripts."""

from __future__ import annotations

import argparse
import json
import sys

from duet.app.session import EngineChoices, reply_options
from duet.app.settings import bundled_demo_model
from duet.engine import Finished, LoadProgress, Tokens, generate, load_model

EXIT_INTERRUPTED = 130


def run_headless(args: argparse.Namespace, choices: EngineChoices) -> int:
    options = reply_options(args, args.context, choices, args.accept)
    bar = ProgressBar(sys.stderr) if sys.stderr.isatty() else None
    lm = load_model(args.model or bundled_demo_model(), progress=bar, route=args.route, host_tables=choices.host_tables)
    if bar:
        bar.close()
    tokenizer = lm.tokenizer
    text = args.headless if args.raw else tokenizer.render_chat([{"role": "user", "content": args.headless}])
    prompt_ids = tokenizer.encode(text)

    pieces: list[str] = []
    token_ids: list[int] = []
    finish, stats = "cancelled", None
    try:
        for event in generate(lm, prompt_ids, options):
            if isinstance(event, Tokens):
                pieces.append(event.text)
                token_ids.extend(event.token_ids)
                stats = event.stats
                if not args.json and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            elif isinstance(event, Finished):
                finish, stats = event.finish_reason, event.stats
    except KeyboardInterrupt:
        pass
    if args.json:
        print(json.dumps({
            "text": "".join(pieces),
            "tokens": token_ids,
            "finish_reason": finish,
            "model": lm.name,
            "route": lm.route,
            "accept": options.accept,
            "stats": stats.to_dict() if stats else None,
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    if stats:
        print(summary_line(stats, finish), file=sys.stderr)
    return EXIT_INTERRUPTED if finish == "cancelled" else 0


def summary_line(stats, finish: str) -> str:
    return (f"[{stats.prompt_tokens} prompt tokens at {stats.prefill_tok_s:.1f} tok/s · "
            f"{stats.generated_tokens} generated at {stats.decode_tok_s:.1f} tok/s · "
            f"{stats.tokens_per_cycle:.2f} tokens/cycle · "
            f"{stats.accepted}/{stats.drafted} drafts kept ({stats.n_lossy} lossy) · "
            + (f"experts {stats.expert_hit_rate:.1%} on the card, {stats.host_bytes_per_token / 1e6:.2f} MB a token "
               f"from RAM, {stats.n_skipped} skipped · " if stats.routed_experts else "")
            + f"{finish}]")


class ProgressBar:
    """A one-line loading bar redrawn in place on a terminal."""

    WIDTH = 30

    def __init__(self, stream):
        self.stream = stream

    def __call__(self, p: LoadProgress) -> None:
        share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
        filled = int(share * self.WIDTH)
        if p.stage == LoadProgress.KERNELS:
            what, count = "CPU kernels (compiled on a first run)", f"{p.done_bytes}/{p.total_bytes}"
        else:
            what, count = "loading weights", f"{p.done_bytes / 1e6:,.1f}/{p.total_bytes / 1e6:,.1f} MB"
        self.stream.write(f"\r\033[K{what} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {share:4.0%} {count}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r\033[K")
        self.stream.flush()
