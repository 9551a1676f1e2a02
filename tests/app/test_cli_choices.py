"""One vocabulary for the engine's choices on the command line: the words, what a retired or
planning-only word says, and the chat UI's own checks before it opens."""

from __future__ import annotations

import json

import pytest

from duet.app.cli import main, main_parser
from duet.engine import Accept, Draft, DuetError, GenerateOptions, KVCache, Route
from duet.engine.placement import KV_TYPES
from duet.engine.speculative import DRAFTERS, EXACT, LOSSY


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own exits (usage errors, --help)
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *args: str) -> str:
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_the_words_are_the_engines_own():
    assert set(Draft) == set(DRAFTERS) and set(Accept) == {EXACT, LOSSY}
    assert set(KVCache) == set(KV_TYPES)  # what placement plans
    assert [kv for kv in KVCache if kv.runs] == [KVCache.BF16, KVCache.Q4]  # what the generator runs
    GenerateOptions(kv=KVCache.BF16), GenerateOptions(kv="q4")
    with pytest.raises(DuetError, match="q8"):
        GenerateOptions(kv=KVCache.Q8)


def test_help_lists_one_vocabulary(capsys):
    _, out, _ = run_cli(capsys, "--help")
    for words in ("{auto,bf16,w4a16,w4a8}", "{exact,lossy}", "{auto,mtp,ngram,none}", "{bf16,q4}"):
        assert words in out
    _, out, _ = run_cli(capsys, "models", "info", "--help")
    assert "{bf16,q8,q4}" in out and "planning-only" in out


def test_flags_parse_to_the_engines_enums():
    args = main_parser().parse_args(["--route", "w4a8", "--accept", "lossy", "--draft", "ngram", "--kv", "q4"])
    assert (args.route, args.accept, args.draft, args.kv) == (Route.W4A8, Accept.LOSSY, Draft.NGRAM, KVCache.Q4)
    assert isinstance(args.kv, KVCache) and isinstance(main_parser().parse_args([]).route, Route)


def test_the_old_kv_word_names_the_new_one(capsys):
    err = one_line_error(capsys, "--headless", "hi", "--kv", "full")
    assert "'full' is now called 'bf16'" in err
    assert "'full' is now called 'bf16'" in one_line_error(capsys, "models", "info", "somewhere", "--kv", "full")


def test_a_planning_only_kv_cache_is_refused_by_duet_and_planned_by_models_info(capsys, tiny_model_dir):
    err = one_line_error(capsys, "--headless", "hi", "--kv", "q8")
    assert "planning only" in err and "'bf16' or 'q4'" in err
    code, out, _ = run_cli(capsys, "models", "info", str(tiny_model_dir), "--kv", "q8", "--json")
    assert code == 0 and json.loads(out)["settings"]["kv"] == "q8"


def test_an_unknown_word_names_the_choices(capsys):
    err = one_line_error(capsys, "--headless", "hi", "--route", "fast")
    assert "invalid choice: 'fast' (choose from 'auto', 'bf16', 'w4a16', 'w4a8')" in err


def test_the_q4_kv_cache_runs_headless(capsys, tiny_model_dir):
    code, out, _ = run_cli(capsys, "--headless", "fox", "--model", str(tiny_model_dir), "--kv", "q4",
                           "--max-tokens", "4", "--json")
    assert code == 0 and json.loads(out)["stats"]["generated_tokens"] >= 1


@pytest.mark.parametrize("args,needle", [
    (("--temperature", "0.5"), "--temperature applies to --headless"),
    (("--model", "/nowhere/at-all"), "/nowhere/at-all: no such model folder"),
    (("--depth", "deep"), "--depth takes auto or a whole number"),
])
def test_the_chat_ui_refuses_bad_flags_before_it_opens(capsys, tmp_path, monkeypatch, args, needle):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    assert needle in one_line_error(capsys, *args)
