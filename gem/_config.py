"""Config plumbing shared by the layers' typed configs: one error type, one message format, one conversion from
the Hydra tree (or a plain mapping) to typed dataclasses.

Every problem a user can fix (a config value, a data file, a checkpoint) raises a `UserError` whose text is one
line `<key or file:row>: <what> (got <value>)`; the entry point prints it as `gem-train: error: ...`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

_NOTHING = object()


class UserError(ValueError):
    """A problem the user can fix: a config value, an input file, a checkpoint. One line, naming where.

    `UserError(key, what, got)` formats `<key>: <what> (got <value>)`; `UserError(message)` keeps a message that
    already has that shape.
    """

    def __init__(self, key: str, what: str | None = None, got: Any = _NOTHING) -> None:
        self.key = key
        if what is None:
            msg = key
        else:
            msg = f"{key}: {what}" + ("" if got is _NOTHING else f" (got {show(got)})")
        super().__init__(msg)


class ConfigError(UserError):
    """A config value outside its domain, of the wrong type, unknown or inconsistent with another key."""


def show(value: Any) -> str:
    """A config value as the user typed it (true/false/null, strings bare)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def one_of(options: Sequence[Any]) -> str:
    names = [show(o) for o in options]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def to_plain(cfg: Any) -> Any:
    """DictConfig / ListConfig -> plain containers (interpolations resolved, missing values an error); other
    values pass through, so plain dicts work too."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    return cfg


def build(cls: type, data: Any, key: str, error: type[ConfigError] = ConfigError) -> Any:
    """The dataclass `cls` from a mapping (DictConfig or plain), every field coerced to its annotation: `Literal`
    choices, `X | None`, lists, tuples, nested dataclasses. Unknown keys, missing required keys and wrong types
    raise `error` naming the full dotted key."""
    data = to_plain(data)
    if not isinstance(data, Mapping):
        raise error(key, "expected a mapping", data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise error(f"{key}.{unknown[0]}", f"unknown key (expected one of {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{key}.{name}", "missing required key")
            continue
        kwargs[name] = _coerce(hints[name], data[name], f"{key}.{name}", error)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, error: type[ConfigError]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            if type(None) in args:
                return None
            raise error(key, "must not be null")
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key, error)
            except ConfigError as e:
                errs.append(e)
        if len(errs) == 1:
            raise errs[0]
        raise error(key, f"expected {' or '.join(_type_name(a) for a in args)}", value)
    if origin is typing.Literal:
        # compare types too: 1 == True, but `resume: 1` is not `resume: true`
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise error(key, f"must be {one_of(args)}", value)
    if tp is Any:
        return value
    if value is None:
        raise error(key, "must not be null")
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, value, key, error)
    if origin in (list, Sequence, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise error(key, "expected a list", value)
        item = args[0] if args else Any
        out = [_coerce(item, v, f"{key}[{i}]", error) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, Mapping):
            raise error(key, "expected a mapping", value)
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise error(key, "expected true or false", value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(key, "expected an integer", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(key, "expected a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise error(key, "expected a string", value)
        return value
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return one_of(typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


class Checker:
    """Collects domain checks of one config group: `need(ok, key, what, got)` raises `error` on the first failure."""

    def __init__(self, prefix: str, error: type[ConfigError] = ConfigError) -> None:
        self.prefix, self.error = prefix, error

    def need(self, ok: bool, key: str, what: str, got: Any = _NOTHING) -> None:
        if not ok:
            raise self.error(f"{self.prefix}.{key}", what, got)
