"""`duet` command line: argument parsing and dispatch.

    duet [--model M]                      the chat UI
    duet --headless PROMPT [options]      one prompt, text to stdout, stats to stderr
    duet bench decode --model DIR         benchmarks
    duet models {list,pull,rm,info,census,import} the catalog, downloads and models on disk
    duet --paths                          where config, conversations and models live
    duet convert SRC DST --format F       a HF checkpoint to INT4 safetensors or GGUF
    duet serve [--port N]                 an OpenAI-compatible endpoint (app/serve.py)

User errors (DuetError, bad arguments) print one line on stderr and exit 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys

from duet.app.arguments import add_engine_arguments, chat_model_path, engine_choices
from duet.app.bench import BENCHMARKS, add_bench_commands
from duet.app.session import Launch
from duet.app.settings import load_config, user_paths
from duet.engine import DuetError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
SUBCOMMANDS = ("bench", "models", "convert", "serve")
HEADLESS_ONLY = ("raw", "json", "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "seed")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that points at --help."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return _run_subcommand(argv)
        return _run_main(argv)
    except DuetError as error:
        print(f"duet: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _run_main(argv: list[str]) -> int:
    parser = main_parser()
    args = parser.parse_args(argv)
    if args.paths:
        return print_paths()
    if args.headless is None:
        return _run_chat(args, parser)
    from duet.app.headless import run_headless

    return run_headless(args, engine_choices(args))


def _run_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`duet [--model M] [--route R] [--accept A] [--draft D] [--depth N] [--kv K] [--context N]`: the chat UI."""
    given = [name for name in HEADLESS_ONLY if getattr(args, name) != parser.get_default(name)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise DuetError(f"{flag} applies to --headless; in the chat UI set replies up with ctrl+s")
    from duet.app.ui.app import run_ui

    paths = user_paths()
    config = load_config(paths.config_file)
    launch = Launch(chat_model_path(args.model, config, paths), args.route, args.context, engine_choices(args), args.accept)
    return run_ui(paths, config, launch)


def _run_subcommand(argv: list[str]) -> int:
    parser = OneLineParser(prog="duet")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side")
    add_bench_commands(bench)
    models = commands.add_parser("models", help="the model catalog, downloads and models on disk")
    from duet.app.models_cli import add_models_commands

    add_models_commands(models)
    convert = commands.add_parser("convert", help="convert a HF checkpoint to INT4 safetensors or GGUF")
    from duet.app.convert import add_convert_command

    add_convert_command(convert)
    serve = commands.add_parser("serve", help="an OpenAI-compatible endpoint on this machine, one request at a time")
    from duet.app.serve import add_serve_command

    add_serve_command(serve)
    args = parser.parse_args(argv)
    return args.run(args)


def main_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="duet",
        description="Chat with Qwen3.5-family models. Without --headless, opens the chat UI.",
        # One command a line, as written: argparse's wrapping would break a name at its hyphen.
        epilog="Also:\n  duet models {list,pull,rm,info,census,import}\n  duet convert SRC DST --format FORMAT\n"
               "  duet serve [--port N]\n"
               f"  duet bench {{{','.join(b.name for b in BENCHMARKS)}}}\n(each with --help)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(parser)
    parser.add_argument("--headless", metavar="PROMPT", help="answer one prompt without the UI and exit")
    parser.add_argument("--paths", action="store_true", help="print where duet keeps config, conversations and models")
    parser.add_argument("--raw", action="store_true", help="tokenize the prompt as is, no chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout at the end")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate (default 512)")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1: off)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, help="seed for sampling (reproducible runs)")
    return parser


def print_paths() -> int:
    paths = user_paths()
    print(f"config         {paths.config_file}\nconversations  {paths.database}\n"
          f"models         {paths.models_dir}\nexports        {paths.exports_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
