"""CLI flags derived from config dataclasses: one source of truth for names, defaults and help.

``--<section>-<field>`` for every field of every section (e.g. ``--cache-write-policy``,
``--tiers-host-pages``); a flag left out keeps the config file's value, else the
dataclass default. Choices come from ``Literal`` annotations.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

import typer

from kvtier.errors import ConfigError


def _base_type(tp: Any) -> tuple[type, tuple[str, ...]]:
    if get_origin(tp) in (Union, types.UnionType):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if get_origin(tp) is Literal:
        return str, tuple(str(a) for a in get_args(tp))
    return tp, ()


def section_parameters(sections: dict[str, type]) -> list[inspect.Parameter]:
    params = []
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            typ, choices = _base_type(hints[f.name])
            if typ not in (int, float, str, bool):
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            text = f.metadata.get("help", "")
            if choices:
                text += f"; one of: {', '.join(choices)}"
            text += f" (default: {default})"
            flag = f"--{section}-{f.name}".replace("_", "-")
            decls = [f"{flag}/--no-{flag[2:]}"] if typ is bool else [flag]
            params.append(
                inspect.Parameter(
                    f"{section}__{f.name}",
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(None, *decls, help=text, rich_help_panel=section),
                    annotation=Optional[typ],
                )
            )
    return params


def load_config_file(path: str | None) -> dict[str, dict[str, Any]]:
    """A JSON or TOML file with one table per section (``[cache]``, ``[tiers]``, ...)."""
    if not path:
        return {}
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table per section")
    return data


def _check_file_types(section: str, cls: type, values: dict[str, Any]) -> None:
    """A config file's values must have their field's type (flags are converted by the CLI itself)."""
    hints = typing.get_type_hints(cls)
    for name, v in values.items():
        if name not in hints:
            continue  # reported as unknown below
        typ, choices = _base_type(hints[name])
        optional = get_origin(hints[name]) in (Union, types.UnionType) and type(None) in get_args(hints[name])
        if v is None and optional:
            continue
        ok = {
            bool: isinstance(v, bool),
            int: isinstance(v, int) and not isinstance(v, bool),
            float: isinstance(v, (int, float)) and not isinstance(v, bool),
            str: isinstance(v, str),
        }.get(typ, True)
        if not ok:
            raise ConfigError(f"config [{section}] {name} = {v!r}: expected {'one of ' + ', '.join(choices) if choices else typ.__name__}")


def build_sections(sections: dict[str, type], file_values: dict[str, dict[str, Any]], flags: dict[str, Any]) -> dict[str, Any]:
    """Dataclass defaults < config file < flags; unknown keys are errors."""
    out = {}
    for section, cls in sections.items():
        names = {f.name for f in dataclasses.fields(cls)}
        table = file_values.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"config section [{section}] must be a table of settings, got {type(table).__name__} {table!r}")
        values = dict(table)
        _check_file_types(section, cls, values)
        unknown = set(values) - names
        if unknown:
            raise ConfigError(f"config section [{section}] has unknown keys {sorted(unknown)}; valid: {sorted(names)}")
        for name in names:
            v = flags.get(f"{section}__{name}")
            if v is not None:
                values[name] = v
        try:
            out[section] = cls(**values)
        except TypeError as e:
            raise ConfigError(f"config section [{section}]: {e}") from None
    extra = set(file_values) - set(sections)
    if extra:
        raise ConfigError(f"config file has unknown sections {sorted(extra)}; valid: {sorted(sections)}")
    return out
