"""gem's configuration: the config dir, the one Hydra composition of a run, the one error type and its format, and
the conversion from the composed tree (or a plain mapping) to the layers' typed dataclasses.

Every problem a user can fix (a config value, a data file, a checkpoint, a run dir) raises a `UserError` whose text
is one line `<key or file:row>: <what> (got <value>)`; the command-line tools print it as `gem-train: error: ...`
(`error_line`) and exit with status 2 (`EXIT_USER`).

`MOVED_KEYS`: the keys of the older form that moved to another group; setting one stops the run with one line
naming where it went.

`compose(overrides)` composes `configs/config.yaml` once, with the same override grammar as Hydra's command line;
keys under `sections` (e.g. gem-plan's `topology.*`) are parsed by the same grammar and returned apart.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
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


EXIT_USER = 2  # exit status of every tool for a problem the user can fix


def error_line(tool: str, message: str) -> str:
    """`<tool>: error: <message>`, the one line a tool prints for a UserError."""
    return f"{tool}: error: {message}"


def default_config_dir() -> str:
    """The Hydra config tree: GEM_CONFIG_DIR, else the installed package's gem/configs (the wheel maps the
    checkout's top-level configs/ there), else the checkout's configs/."""
    if os.environ.get("GEM_CONFIG_DIR"):
        return os.environ["GEM_CONFIG_DIR"]
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return str(installed if (installed / "config.yaml").is_file() else package.parent / "configs")


def register_resolvers() -> None:
    """`${gem_run_id:}`: the run's id, the same on every rank (the CLI agrees on it before the run dir is
    resolved)."""
    if not OmegaConf.has_resolver("gem_run_id"):
        OmegaConf.register_new_resolver("gem_run_id", lambda: os.environ.get("GEM_RUN_ID", "local"), use_cache=True)


# Keys that moved to another group (old -> new). Set the old one, on the command line or in a config file, and the
# run stops with one line saying where it went.
MOVED_KEYS = {
    "parallel.compile": "compile.enabled",
    "parallel.compile_backend": "compile.backend",
    "parallel.activation_checkpoint": "activation_checkpoint.mode",
    "parallel.ac_every": "activation_checkpoint.every",
    "parallel.timeout_s": "comm.timeout_s",
    "parallel.param_dtype": "train.param_dtype",
    "parallel.reduce_dtype": "train.reduce_dtype",
}


def check_moved(group: str, data: Any) -> None:
    """Raise ConfigError `<group>.<key>: moved to <new key>` for the first key of the mapping `data` (the config of
    `group`) that moved to another group."""
    if isinstance(data, Mapping):
        for k in data:
            new = MOVED_KEYS.get(f"{group}.{k}")
            if new is not None:
                raise ConfigError(f"{group}.{k}", f"moved to {new}")


def one_line(exc: BaseException) -> str:
    """A one-line message for an exception met while composing or checking a config, naming the key where the
    exception knows it."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, UserError):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, name = exc.missing_cfg_file.rsplit("/", 1)
        options = f" (options: {', '.join(exc.options)})" if exc.options else ""
        return f"{group}={name}: no such config{options}"
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        first = str(cause).splitlines()[0].strip()
        text = str(exc).splitlines()[0].strip()
        if "not in struct" in str(cause) or "Could not override" in text:
            if cause.full_key in MOVED_KEYS:
                return f"{cause.full_key}: moved to {MOVED_KEYS[cause.full_key]}"
            return f"{cause.full_key}: unknown config key (append a new key with '+{cause.full_key}=...')"
        if "Missing mandatory value" in first:
            return f"{cause.full_key}: missing value (set {cause.full_key}=...)"
        return f"{cause.full_key}: {first}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


# Hydra's own command-line flags that take a value; gem's tools accept them as Hydra's app does.
HYDRA_VALUE_FLAGS = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp", "--experimental-rerun")


@dataclasses.dataclass
class Args:
    """A tool's command line split into Hydra's flags and the overrides."""

    overrides: list[str]
    config_dir: str | None = None  # --config-dir: one more directory searched for configs (before the shipped ones)
    config_name: str = "config"
    flags: list[str] = dataclasses.field(default_factory=list)  # other flags, in order (e.g. --check)


def parse_args(argv: Sequence[str]) -> Args:
    """Split `argv` into Hydra's value flags (`--config-dir DIR`, `--config-dir=DIR`, ...), other flags and the
    overrides."""
    out = Args(overrides=[])
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if name in HYDRA_VALUE_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, "needs a value")
                value = argv[i + 1]
                i += 1
            if name in ("--config-dir", "-cd"):
                out.config_dir = value
            elif name in ("--config-name", "-cn"):
                out.config_name = value
            elif name in ("--config-path", "-cp"):
                raise ConfigError(name, "not supported by gem's tools; use --config-dir DIR (or GEM_CONFIG_DIR)")
            else:
                out.flags.append(a)
        elif a.startswith("-"):
            out.flags.append(a)
        else:
            out.overrides.append(a)
        i += 1
    return out


def compose(overrides: Sequence[str], *, config_dir: str | None = None, extra_dir: str | None = None,
            config_name: str = "config", job_name: str = "gem_train", hydra: bool = False,
            sections: Sequence[str] = ()) -> Any:
    """The composed config for `overrides` (Hydra's grammar), composed once; raises ConfigError with a one-line
    message. `extra_dir`: searched for configs before the shipped ones (Hydra's --config-dir). `hydra`: keep the
    `hydra` node (run dir, logging). `sections`: top-level keys that are not part of the config (gem-plan's
    `topology`, `plan`): `section.key=value` overrides are parsed with the same grammar and returned as
    `(cfg, {section: {key: value}})`."""
    from hydra import version
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    register_resolvers()
    if extra_dir is not None and not os.path.isdir(extra_dir):
        raise ConfigError("--config-dir", "no such directory", extra_dir)
    rest, split = list(overrides), {s: {} for s in sections}
    try:
        if sections:
            rest = []
            for text, ov in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
                head, _, key = ov.key_or_group.partition(".")
                if head in split and key and not ov.is_delete() and not ov.package:
                    split[head][key] = ov.value()
                else:
                    rest.append(text)
        csp = create_config_search_path(search_path_dir=os.path.abspath(config_dir or default_config_dir()))
        if extra_dir is not None:  # where Hydra's own --config-dir puts it
            csp.prepend(provider="command-line", path=f"file://{os.path.abspath(extra_dir)}",
                        anchor=SearchPathQuery(provider="schema"))
        version.setbase("1.3")
        GlobalHydra.instance().clear()
        Hydra.create_main_hydra2(task_name=job_name, config_search_path=csp)
        try:
            cfg = GlobalHydra.instance().hydra.compose_config(config_name=config_name, overrides=rest,
                                                              run_mode=RunMode.RUN)
        finally:
            GlobalHydra.instance().clear()
    except Exception as e:  # noqa: BLE001 - any composition problem is a config error
        raise ConfigError(one_line(e)) from None
    if not hydra:
        from omegaconf import open_dict

        with open_dict(cfg):
            del cfg["hydra"]
    return (cfg, split) if sections else cfg


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
    fields = {config_key(f.name): f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise error(f"{key}.{unknown[0]}", f"unknown key (expected one of {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{key}.{name}", "missing required key")
            continue
        kwargs[f.name] = _coerce(hints[f.name], data[name], f"{key}.{name}", error)
    return cls(**kwargs)


def config_key(field_name: str) -> str:
    """The config key of a dataclass field: the name, less the `_` that a Python keyword needs (`async_`)."""
    import keyword

    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


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
