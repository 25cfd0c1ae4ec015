"""A config from TOML and ``--set section.key=value`` overrides: ``parse_config`` merges the
defaults (config.py's dataclasses), a TOML file and command-line overrides, each key and value
checked against its field's type (old spellings mapped by config_aliases.py), then ``validate``
(config_checks.py); ``dump_toml`` writes the resolved config back."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
from typing import Any, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from bumblebee.config import Config
from bumblebee.config_aliases import canonical
from bumblebee.config_checks import check_filled, validate
from bumblebee.errors import ConfigError

SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _suggest(word: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(word, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{hint}; valid: {', '.join(valid)}"


def coerce(value: Any, hint: Any, where: str) -> Any:
    """Check/convert one value against a field's type hint."""
    origin = get_origin(hint)
    if origin is Union or origin is types.UnionType:  # Union[a, b] and a | b
        errors = []
        for arm in get_args(hint):
            try:
                return coerce(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            f"{where}: {value!r} is not valid ({' or '.join(a.__name__ for a in get_args(hint))})"
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str) and "\x00" in value:
            # no path, name or template may hold one: the OS refuses it deep inside a write
            raise ConfigError(f"{where}: {value!r} holds a NUL character")
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{where}: expected a table, got {value!r}")
    if dataclasses.is_dataclass(hint):  # a nested table (model.lora)
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        hints = get_type_hints(hint)
        out = hint()
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {key!r}{_suggest(key, list(hints))}")
            setattr(out, key, coerce(v, hints[key], f"{where}.{key}"))
        return out
    raise AssertionError(f"unhandled type hint {hint} for {where}")


def _apply(cfg: Config, data: dict, source: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section [{section}]{_suggest(section, list(SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        obj = getattr(cfg, section)
        hints = get_type_hints(type(obj))
        seen: dict[str, str] = {}  # new key -> the spelling it was given as in this table
        for given, value in values.items():
            key, value = canonical(section, given, value)
            if key in seen:
                raise ConfigError(
                    f"{source}: {section}.{given} and {section}.{seen[key]} are one key (give it once)"
                )
            seen[key] = given
            if key not in hints:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}{_suggest(key, list(hints))}"
                )
            setattr(obj, key, coerce(value, hints[key], f"{source}: {section}.{key}"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value). Values are TOML literals;
    a bare word that is not a TOML literal is taken as a string (``--set model.preset=tiny``)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    if "\n" in raw or "\r" in raw:
        # TOML would read the text after the line break as more keys and drop it silently
        raise ConfigError(f"--set {key}: the value holds a line break; give one value per --set")
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def read_toml(path: str) -> dict:
    """A TOML file as a dict; a missing or malformed file is a one-line ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        kind = " (UTF-16: save it as UTF-8)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}){kind}; TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed TOML: nested too deeply") from None


def parse_config(
    path: str | None = None, overrides: list[str] | None = None, check: bool = True
) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides, then ``validate`` unless ``check`` is
    false (values only; see ``bumblebee.load_config`` for the full check)."""
    cfg = Config()
    data = read_toml(path) if path else {}
    check_filled(data, path, overrides or [])
    if path:
        _apply(cfg, data, path)
    dtype_given = isinstance(data.get("train"), dict) and "dtype" in data["train"]
    for item in overrides or []:
        keys, value = parse_override(item)
        if len(keys) > 2 and keys[0] == "model" and keys[1] == "arch":
            cfg.model.arch = {**cfg.model.arch, ".".join(keys[2:]): value}
            continue
        if len(keys) == 3 and keys[:2] == ["model", "lora"]:  # one key of the nested table
            lora = dataclasses.asdict(cfg.model.lora)
            _apply(cfg, {"model": {"lora": {**lora, keys[2]: value}}}, "--set")
            continue
        if len(keys) != 2:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _apply(cfg, {keys[0]: {keys[1]: value}}, "--set")
        dtype_given = dtype_given or keys == ["train", "dtype"]
    if not dtype_given and cfg.model.preset != "tiny" and not cfg.model.hf_path:
        cfg.train.dtype = (
            "bfloat16"  # real-size presets: bf16 compute (the grouped expert GEMM), fp32 masters
        )
    if check:
        validate(cfg)
    return cfg


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (written next to every run's metrics)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{{inner}}}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
