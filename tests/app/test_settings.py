"""Paths and the TOML config: DUET_HOME, round trips, bad files, and `duet --paths`."""

from __future__ import annotations

import tomllib

import pytest

from duet.app.cli import main
from duet.app.settings import Config, load_config, save_config, to_toml, user_paths
from duet.engine.errors import DuetError


def test_duet_home_holds_config_and_data(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    paths = user_paths()
    assert paths.config_file == tmp_path / "config" / "config.toml"
    assert paths.database.parent == paths.models_dir.parent == tmp_path / "data"


def test_platform_dirs_without_duet_home(monkeypatch):
    monkeypatch.delenv("DUET_HOME", raising=False)
    paths = user_paths()
    assert paths.config_dir.name == "duet" and paths.data_dir.name == "duet"


def test_config_round_trips_through_toml(tmp_path):
    config = Config(model="qwen3.5-0.8b", system_prompt='Say "hi"\n\tthen stop \\ \x01', temperature=0.7, top_k=20,
                    seed=5, keys={"chat.new": "ctrl+j", "app.quit": "ctrl+x"})
    save_config(config, tmp_path / "config.toml")
    assert load_config(tmp_path / "config.toml") == config
    assert tomllib.loads(to_toml({"whole": 3, "flag": True})) == {"whole": 3, "flag": True}


def test_missing_config_is_the_defaults(tmp_path):
    assert load_config(tmp_path / "none.toml") == Config()


@pytest.mark.parametrize("text, problem", [
    ("temperature = [", "cannot be read as TOML"),
    ("colour = 'red'", "unknown setting 'colour'"),
    ("max_tokens = 'many'", "max_tokens must be a whole number"),
    ("top_k = true", "top_k must be a whole number"),
    ("temperature = 'hot'", "temperature must be a number"),
    ("max_tokens = 0", "max_tokens must be at least 1"),
    ("[keys]\n'chat.new' = 3", r"every entry of \[keys\] must be a string"),
])
def test_a_bad_config_is_one_line_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(DuetError, match=problem) as error:
        load_config(path)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)
    assert path.read_text() == text  # nothing overwritten


def test_whole_numbers_are_accepted_for_float_settings(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("temperature = 1\ntop_p = 1")
    assert load_config(path).temperature == 1.0


def test_paths_command_prints_where_things_live(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    assert main(["--paths"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "config" / "config.toml") in out and str(tmp_path / "data" / "models") in out


def test_sampling_flags_without_headless_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    assert main(["--temperature", "0.5"]) == 2
    assert capsys.readouterr().err == "duet: --temperature applies to --headless; in the chat UI set replies up with ctrl+s\n"


def test_an_unknown_model_for_the_ui_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no such model folder" in err and err.count("\n") == 1


def test_a_bad_config_stops_the_ui_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUET_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text("max_tokens = -3")
    assert main(["--model", str(tmp_path)]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err
