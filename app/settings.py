"""Paths duet uses and its TOML config.

Config and data live in platformdirs' per-user folders; `DUET_HOME` puts both under one folder
(tests and portable installs). The config is read with tomllib and written by a small writer for
the flat tables it holds. Secrets (HF_TOKEN) are never written here.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from importlib.resources import files
from pathlib import Path

import platformdirs

from duet.engine.errors import DuetError

APP_NAME = "duet"
FRESH_SEED = -1  # the config's seed for a fresh seed each reply (TOML has no null)
KINDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", dict: "a table"}


def bundled_demo_model() -> Path:
    """The small trained model that ships inside the package (models/demo)."""
    return Path(str(files("duet.models") / "demo"))


@dataclass(frozen=True)
class Paths:
    config_dir: Path
    data_dir: Path

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def database(self) -> Path:
        return self.data_dir / "conversations.sqlite3"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def exports_dir(self) -> Path:
        return self.data_dir / "exports"


def user_paths() -> Paths:
    """DUET_HOME/{config,data} when DUET_HOME is set, else the platform's per-user folders."""
    home = os.environ.get("DUET_HOME")
    if home:
        root = Path(home).expanduser()
        return Paths(root / "config", root / "data")
    return Paths(Path(platformdirs.user_config_dir(APP_NAME)), Path(platformdirs.user_data_dir(APP_NAME)))


@dataclass
class Config:
    """What a user can set once and keep: the default model, reply defaults and key bindings.

    Engine choices (route, draft, depth, KV cache, acceptance) come from the command line each run.
    """

    model: str = ""  # folder or name in the models dir; empty: the bundled demo model
    system_prompt: str = ""
    max_tokens: int = 512
    # Chat defaults sample, as the seed's runs do (temperature 0.7, top-k 20, top-p 0.95): greedy
    # decoding loops on small models, and the exact/lossy switch only differs when sampling.
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int = FRESH_SEED
    keys: dict[str, str] = field(default_factory=dict)  # binding id -> keys, e.g. {"chat.stop": "ctrl+c"}

    def __post_init__(self):
        if self.max_tokens < 1:
            raise DuetError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.seed < FRESH_SEED:
            raise DuetError(f"seed must be {FRESH_SEED} (a fresh seed each reply) or a whole number >= 0 (got {self.seed})")


def load_config(path: Path) -> Config:
    """The config at path, defaults for what it leaves out; a bad file is one line naming it."""
    if not path.is_file():
        return Config()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise DuetError(f"{path}: cannot be read as TOML ({error}); fix or delete it") from error
    known = {f.name: f for f in fields(Config)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise DuetError(f"{path}: unknown setting {unknown[0]!r}; known: {', '.join(known)}")
    defaults = Config()
    for name, value in raw.items():
        expected = type(getattr(defaults, name))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            raw[name] = value = float(value)
        if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
            raise DuetError(f"{path}: {name} must be {KINDS[expected]} (got {value!r})")
    if not all(isinstance(k, str) for k in raw.get("keys", {}).values()):
        raise DuetError(f"{path}: every entry of [keys] must be a string such as \"ctrl+n\"")
    try:
        return Config(**raw)
    except DuetError as error:
        raise DuetError(f"{path}: {error}") from None


def save_config(config: Config, path: Path) -> None:
    """Write the config atomically (a temporary file, then rename), so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".toml.tmp")
    temporary.write_text(to_toml(asdict(config)), encoding="utf-8")
    temporary.replace(path)


def to_toml(table: dict) -> str:
    """TOML for a table of scalars and one level of sub-tables (all the config holds)."""
    scalars = [f"{key} = {_toml_value(value)}" for key, value in table.items() if not isinstance(value, dict)]
    lines = scalars
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", f"[{_toml_key(key)}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else _toml_string(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DuetError(f"cannot store {value} in the config; use a finite number")
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    for char, escape in (("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        escaped = escaped.replace(char, escape)
    escaped = "".join(c if c.isprintable() else f"\\U{ord(c):08x}" for c in escaped)
    return f'"{escaped}"'
