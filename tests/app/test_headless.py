"""`duet --headless`: the CLI contract of DESIGN.md, bad input, and Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
import time

import pytest

from conftest import interruptible
from duet.app.cli import main
from duet.engine import load_model

JSON_STATS = {"prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "cycles", "tokens_per_cycle",
              "drafted", "accepted", "acceptance_rate", "accept_by_position", "n_lossy",
              "lossy_rate", "mean_depth", "routes", "rules"}
# the contract's fields, plus the lossy drift, drafts per cycle, and the routes and rules the passes ran


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed (save_pretrained's progress bars)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_has_the_contract_fields(capsys, tiny_model_dir):
    code, out, err = run_cli(capsys, "--headless", "the quick brown fox", "--model", str(tiny_model_dir),
                             "--max-tokens", "12", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) == {"text", "tokens", "finish_reason", "model", "route", "accept", "stats"}
    assert set(result["stats"]) == JSON_STATS
    lm = load_model(tiny_model_dir)
    text_ids = [t for t in result["tokens"] if t not in lm.tokenizer.eos_ids]
    assert result["text"] == lm.tokenizer.decode(text_ids)
    assert result["stats"]["generated_tokens"] == len(result["tokens"])
    assert result["finish_reason"] in ("stop", "length")
    assert (result["route"], result["accept"]) == ("bf16", "exact")
    assert "tok/s" in err


def test_streamed_text_equals_json_text(capsys, tiny_model_dir):
    args = ("--headless", "over the lazy dog", "--model", str(tiny_model_dir), "--max-tokens", "20")
    code, streamed, _ = run_cli(capsys, *args)
    assert code == 0
    _, out, _ = run_cli(capsys, *args, "--json")
    assert streamed == json.loads(out)["text"] + "\n"


def test_raw_prompt_skips_the_chat_template(capsys, tiny_model_dir):
    _, chat, _ = run_cli(capsys, "--headless", "fox", "--model", str(tiny_model_dir), "--max-tokens", "1", "--json")
    _, raw, _ = run_cli(capsys, "--headless", "fox", "--model", str(tiny_model_dir), "--max-tokens", "1", "--json", "--raw")
    lm = load_model(tiny_model_dir)
    assert json.loads(raw)["stats"]["prompt_tokens"] == len(lm.tokenizer.encode("fox"))
    assert json.loads(chat)["stats"]["prompt_tokens"] > json.loads(raw)["stats"]["prompt_tokens"]


def test_seeded_sampling_is_reproducible(capsys, tiny_model_dir):
    args = ("--headless", "fox", "--model", str(tiny_model_dir), "--max-tokens", "16", "--json",
            "--temperature", "1.0", "--top-k", "40", "--top-p", "0.9", "--seed", "7")
    first = json.loads(run_cli(capsys, *args)[1])["tokens"]
    second = json.loads(run_cli(capsys, *args)[1])["tokens"]
    assert first == second


# ---------------------------------------------------------------------------------------------
# Bad input: one line on stderr naming the file, exit 2, no traceback.


def expect_user_error(capsys, model_dir, *needles: str, extra: tuple[str, ...] = ()) -> None:
    code, out, err = run_cli(capsys, "--headless", "hi", "--model", str(model_dir), *extra)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err


def rewrite_header(path, edit) -> None:
    """Apply `edit` to the parsed safetensors header and write it back, data untouched."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (size - len(new)) if len(new) <= size else b""
    assert len(new) == size, "edit must not grow the header"
    path.write_bytes(raw[:8] + new + raw[8 + size :])


def test_truncated_safetensors(capsys, tiny_model_dir):
    weights = tiny_model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    expect_user_error(capsys, tiny_model_dir, "model.safetensors", "truncated")


def test_corrupt_header_json(capsys, tiny_model_dir):
    weights = tiny_model_dir / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[12:20] = b"\x00{{{{{{{"
    weights.write_bytes(bytes(raw))
    expect_user_error(capsys, tiny_model_dir, "model.safetensors", "not valid JSON")


def test_missing_tensor(capsys, tiny_model_dir):
    name = "model.layers.2.linear_attn.out_proj.weight"
    rewrite_header(tiny_model_dir / "model.safetensors", lambda h: h.pop(name))
    expect_user_error(capsys, tiny_model_dir, name, "missing")


def test_wrong_shape(capsys, tiny_model_dir):
    name = "model.layers.3.self_attn.q_proj.weight"

    def transpose(header):
        header[name]["shape"] = header[name]["shape"][::-1]

    rewrite_header(tiny_model_dir / "model.safetensors", transpose)
    expect_user_error(capsys, tiny_model_dir, "model.safetensors", name, "shape")


def test_unknown_model_type(capsys, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (tiny_model_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    expect_user_error(capsys, tiny_model_dir, "config.json", "llama")


def test_corrupt_config(capsys, tiny_model_dir):
    (tiny_model_dir / "config.json").write_text("{not json")
    expect_user_error(capsys, tiny_model_dir, "config.json", "not valid JSON")


def test_missing_tokenizer(capsys, tiny_model_dir):
    (tiny_model_dir / "tokenizer.json").unlink()
    expect_user_error(capsys, tiny_model_dir, "tokenizer.json")


def test_missing_model_folder(capsys, tmp_path):
    expect_user_error(capsys, tmp_path / "nowhere", "nowhere")


def test_prompt_longer_than_context(capsys, tiny_model_dir):
    expect_user_error(capsys, tiny_model_dir, "context", extra=("--context", "4"))


def test_bad_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--headless", "hi", "--temperature", "warm"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# The real console script, as a user runs it.


def duet_command() -> list[str]:
    """The console script installed beside the running Python (the test venv's), not another on PATH."""
    script = shutil.which("duet", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "duet.app.cli"]


def test_console_script_error_has_no_traceback(tmp_path):
    result = subprocess.run([*duet_command(), "--headless", "hi", "--model", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("duet: ") and "Traceback" not in result.stderr


def test_ctrl_c_prints_what_was_generated_and_exits_130(tiny_model_dir):
    # No eos token, so only Ctrl-C can end this run before the 4,096-token budget.
    tok_config = tiny_model_dir / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items() if k != "eos_token"}))
    proc = subprocess.Popen([*duet_command(), "--headless", "the fox", "--raw", "--model", str(tiny_model_dir),
                             "--max-tokens", "100000", "--context", "4096"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=interruptible)
    first = proc.stdout.read(1)  # wait until text streams
    assert first
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert len(first + rest) > 1
    assert b"Traceback" not in err and b"cancelled" in err
