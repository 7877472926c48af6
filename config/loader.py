"""Load a config: a preset name or a YAML file, `extends:` chains, `--set a.b.c=value` overrides.

Every failure is a `ConfigError` whose message is one line naming the key and the rule, so the
CLI can print it and exit 2 without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from config.schema import TidalConfig

PRESETS_DIR = Path(__file__).parent / "presets"
RESOLVED_FILENAME = "config.resolved.json"


_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@'\"]*:)[^\s'\"]*@")
"""``scheme://user:PASSWORD@`` in free text; the password runs to the last ``@`` before a space or
quote, so one with an unescaped ``@`` or ``/`` is hidden whole."""


class ConfigError(ValueError):
    """Bad config input; the message is one line naming the key and the rule.

    A password inside a URL in the message (`--set storage.url=postgresql://u:PW@h/db` with a
    typo elsewhere) is shown as ``***``: these messages go to stderr and CI logs."""

    def __init__(self, message: str):
        super().__init__(_URL_PASSWORD.sub(r"\1***@", str(message)))


def list_presets() -> list[str]:
    """Preset names relative to `config/presets`, without `.yaml` (e.g. `sim/qwen35-35b-dynamic`)."""
    return sorted(p.relative_to(PRESETS_DIR).with_suffix("").as_posix() for p in PRESETS_DIR.rglob("*.yaml"))


def resolve_config_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A path to an existing file, else a preset name (`tiny-cpu`, `sim/qwen35-35b-dynamic`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = PRESETS_DIR / (str(name_or_path).removesuffix(".yaml") + ".yaml")
    if preset.is_file():
        return preset
    if path.exists():
        raise ConfigError(f"config: {str(name_or_path)!r} is not a file")
    raise ConfigError(f"config: no file or preset named {str(name_or_path)!r} (presets: {', '.join(list_presets())})")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    real = path.resolve()
    if real in seen:
        raise ConfigError(f"extends: cycle through {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise ConfigError(f"config: {path}{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of sections, not {type(data).__name__}")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"extends: must be a path string in {path}")
    base_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    if not base_path.is_file():
        raise ConfigError(f"extends: {parent!r} (from {path}) is not a file")
    return deep_merge(_read_yaml(base_path, (*seen, real)), data)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` wins; nested mappings merge key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings; values are parsed as YAML scalars (`true`, `0.5`, `null`)."""
    out = deep_merge({}, data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r}") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def _one_line(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and first["type"] not in ("missing",) and not isinstance(first["input"], dict):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{more}"


def validate(data: Mapping[str, Any]) -> TidalConfig:
    """Validate a plain mapping into a `TidalConfig`, raising a one-line `ConfigError`."""
    try:
        return TidalConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None


def load_config(name_or_path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> TidalConfig:
    """Preset name or YAML path (+ `extends:` chain) + overrides → validated config."""
    data = _read_yaml(resolve_config_path(name_or_path))
    return validate(apply_overrides(data, overrides))


def to_plain(cfg: TidalConfig) -> dict[str, Any]:
    """JSON-ready dict of every field, defaults included."""
    return cfg.model_dump(mode="json")


def write_resolved(cfg: TidalConfig, directory: str | os.PathLike[str]) -> Path:
    """Write the resolved config as JSON next to a run's outputs (atomically: never half-written)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / RESOLVED_FILENAME
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".config.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(to_plain(cfg), fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
