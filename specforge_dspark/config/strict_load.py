"""Strict loading of nested dataclasses from YAML data: the machinery behind recipe.py.

Every key is checked: an unknown key fails with its dotted path and the closest valid
key; a value of the wrong type fails with its dotted path. Problems are appended to an
`errors` list, so that all of them are reported together. A field with
`metadata={"key": False}` is not a key (set by code, never by the YAML).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal

import yaml

_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number in decimal or exponent notation, as a string (not nan, inf or hex)."""
_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}
"""The words YAML 1.1 turns into each boolean, for a Literal of words."""


def apply_override(raw: dict, item: str, errors: list[str]) -> None:
    """Set `key.sub=value` in the nested mapping `raw` (the value parsed as YAML)."""
    if "=" not in item:
        errors.append(f"override {item!r}: expected key.sub=value")
        return
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            errors.append(f"override {item!r}: {p} is not a section")
            return
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        node[parts[-1]] = text


def build_dataclass(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    """Instantiate dataclass `cls` from `raw` (keys under the dotted `prefix`, "" at the
    top), appending problems to `errors`."""
    where = prefix.rstrip(".") or "recipe"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.append(f"{where}: expected a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("key", True)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            errors.append(f"unknown key {prefix}{key}{hint} (valid: {', '.join(names)})")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}", errors)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str, errors: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path + ".", errors)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path, errors)
    if origin is Literal:
        if isinstance(value, bool) and all(isinstance(a, str) for a in args):
            # YAML 1.1 reads on/off, yes/no, true/false as booleans: take the word back
            value = next((w for w in _BOOL_WORDS[value] if w in args), value)
        if value not in args:
            errors.append(f"{path}: {value!r} is not one of {list(args)}")
            return args[0]
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
            return []
        return [_coerce(args[0], v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return {}
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true/false, got {value!r}")
            return False
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r}")
            return 0
        return value
    if tp is float:
        if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 6e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            errors.append(f"{path}: expected a number, got {value!r}")
            return 0.0
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
            return ""
        return value
    raise TypeError(f"recipe field {path} has an unsupported type {tp}")  # our bug, not theirs
