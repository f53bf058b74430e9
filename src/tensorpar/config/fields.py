"""Command options written once, as dataclass fields: argparse, the `--config` TOML file and the
resolved configuration a run writes are all generated from them.

A field is declared with `option(default, help, ...)`; its type comes from the annotation
(``int``, ``float``, ``str``, ``bool``, ``X | None``, ``list[X]``). From the field:

- `add_options(parser, cls)` adds one flag per field (``--global-batch-size`` for
  ``global_batch_size``), with its type, choices, help and default shown in the help text;
  a ``bool`` field defaulting to False is a switch, one defaulting to True a ``--no-...`` switch;
- `load_toml(path, cls)` reads a flat TOML file whose keys are field names (``global_batch_size``
  or ``global-batch-size``), refusing an unknown key (naming it and the closest known one) and a
  value of the wrong type or outside the choices;
- `options_from_args(cls, namespace)` merges, lowest first: the field defaults, the ``--config``
  file, the flags given on the command line;
- `to_toml(options)` writes the options back in the same format, so a run's resolved
  configuration can be passed to ``--config`` again.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing

from tensorpar.errors import TensorparError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def option(default=None, help: str = "", *, choices=None, flag: str | None = None, metavar: str | None = None,
           group: str | None = None, cli: bool = True, required: bool = False, positional: bool = False,
           repeat: bool = False, hidden: bool = False):
    """A dataclass field that is also a command-line option.

    `flag` overrides the flag's name; `group` puts it under a heading of ``--help``; ``cli=False``
    keeps it out of the command line and the config file (Python-only knobs); `required` is
    checked after the config file and the flags are merged; `positional` makes it an argument
    without a flag; `repeat` makes a list field take one value per use of its flag (instead of
    several values after one flag); `hidden` leaves it out of ``--help``.
    """
    meta = dict(help=help, choices=tuple(choices) if choices is not None else None, flag=flag, metavar=metavar,
                group=group, cli=cli, required=required, positional=positional, repeat=repeat, hidden=hidden)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str
    kind: type  # int, float, str or bool: the type of the value or of each list item
    is_list: bool
    optional: bool
    default: object
    meta: dict

    @property
    def flag(self) -> str:
        return self.meta["flag"] or "--" + self.name.replace("_", "-")


def _specs(cls) -> list[_Spec]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option()")
        kind, optional, is_list = hints[f.name], False, False
        args = typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
            optional = True
            kind = next(a for a in args if a is not type(None))
        if typing.get_origin(kind) is list:
            is_list, kind = True, typing.get_args(kind)[0]
        if kind not in (int, float, str, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported option type {kind}")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out.append(_Spec(f.name, kind, is_list, optional, default, dict(f.metadata)))
    return out


def cli_specs(cls) -> list[_Spec]:
    return [s for s in _specs(cls) if s.meta["cli"]]


def _help(spec: _Spec) -> str:
    if spec.meta["hidden"]:
        return argparse.SUPPRESS
    text = spec.meta["help"]
    if spec.kind is not bool and spec.default not in (None, []) and "default" not in text:
        shown = " ".join(map(str, spec.default)) if spec.is_list else spec.default
        text = f"{text} (default {shown})" if text else f"default {shown}"
    return text.replace("%", "%%")


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a whole number, got '{text}'") from None


def _float_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number, got '{text}'") from None


_ARG_TYPES = {int: _int_arg, float: _float_arg, str: str}


def add_options(parser: argparse.ArgumentParser, cls, *, config_file: bool = False) -> None:
    """One argparse argument per CLI field of `cls` (under its group's heading), plus ``--config`` if asked.

    Defaults are left out of the namespace (``argparse.SUPPRESS``), so that `options_from_args` can tell a
    flag given on the command line from a default and let it override the config file."""
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for spec in cli_specs(cls):
        title = spec.meta["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title) if title else parser
        target = groups[title]
        if spec.meta["positional"]:
            target.add_argument(spec.name, metavar=spec.meta["metavar"] or spec.name.upper(), help=_help(spec))
            continue
        kw = dict(dest=spec.name, default=argparse.SUPPRESS, help=_help(spec))
        if spec.kind is bool:
            if spec.default and not spec.meta["flag"]:
                raise TypeError(f"{cls.__name__}.{spec.name}: a switch defaulting to True needs a --no-... flag")
            kw["action"] = "store_false" if spec.default else "store_true"
        else:
            metavar = spec.meta["metavar"] or {int: "N", float: "X"}.get(spec.kind)
            kw.update(type=_ARG_TYPES[spec.kind], metavar=metavar)
            if spec.meta["choices"] is not None:
                kw["choices"] = spec.meta["choices"]
            if spec.is_list and spec.meta["repeat"]:
                kw["action"] = "append"
            elif spec.is_list:
                kw["nargs"] = "+"
        target.add_argument(spec.flag, **kw)
    if config_file:
        parser.add_argument("--config", metavar="FILE.toml", default=None,
                            help="read options from a TOML file (keys are the flags' names); flags given here "
                                 "override it")


def _comma_separated(spec: _Spec) -> bool:
    """Whether a string option holds a comma-separated list (its metavar reads N,N,... or R,R,...)."""
    return spec.kind is str and not spec.is_list and ",..." in (spec.meta["metavar"] or "")


def _describe(spec: _Spec) -> str:
    if _comma_separated(spec):
        return f"a comma-separated string ({spec.meta['metavar']}) or a list of its items"
    kind = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[spec.kind]
    return f"a list of {kind.split(' ', 1)[1]}s" if spec.is_list else kind


def _coerce(spec: _Spec, value, where: str):
    """`value` from a config file as the field's type, or a TensorparError naming `where` and the field."""
    def one(v):
        if spec.kind is float and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if not isinstance(v, spec.kind) or (spec.kind is int and isinstance(v, bool)):
            raise TypeError
        if spec.meta["choices"] is not None and v not in spec.meta["choices"]:
            raise ValueError
        return v

    try:
        if spec.is_list:
            if not isinstance(value, list):
                raise TypeError
            return [one(v) for v in value]
        if _comma_separated(spec) and isinstance(value, list):
            # A comma-separated flag (--pipeline-layers 4,6,6,4) as the TOML array a file writes naturally, and
            # as `plan --json` and meta.json spell it: [4, 6, 6, 4].
            if not value or not all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
                raise TypeError
            return one(",".join(map(str, value)))
        return one(value)
    except TypeError:
        raise TensorparError(f"{where}: {spec.name} = {_toml_value(value)} should be {_describe(spec)}") from None
    except ValueError:
        choices = ", ".join(map(str, spec.meta["choices"]))
        raise TensorparError(f"{where}: {spec.name} = {_toml_value(value)} is not one of: {choices}") from None


def load_toml(path: str, cls, command: str) -> dict:
    """The options a flat TOML file sets for `cls` (field name -> value); unknown keys and bad values are errors."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TensorparError(f"config file '{path}' does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # TOML is UTF-8 text
        raise TensorparError(f"config file '{path}' is not valid TOML: {e}") from None
    specs = {s.name: s for s in cli_specs(cls)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            raise TensorparError(f"config file '{path}': [{key}] is a table; options are plain 'key = value' lines")
        if name not in specs:
            close = difflib.get_close_matches(name, specs, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise TensorparError(f"config file '{path}': unknown option '{key}' for tensorpar {command}{hint} "
                                 f"(known: {', '.join(specs)})")
        if name in out:  # global-batch-size and global_batch_size: one option given twice
            raise TensorparError(f"config file '{path}': '{key}' sets {name} a second time")
        out[name] = _coerce(specs[name], value, f"config file '{path}'")
    return out


def options_from_args(cls, namespace: argparse.Namespace, command: str):
    """`cls` from the field defaults, then the ``--config`` file (if any), then the flags on the command line."""
    values = {}
    config = getattr(namespace, "config", None)
    if config:
        values.update(load_toml(config, cls, command))
    names = {s.name for s in cli_specs(cls)}
    values.update({k: v for k, v in vars(namespace).items() if k in names})
    options = cls(**values)
    missing = [s for s in cli_specs(cls) if s.meta["required"] and getattr(options, s.name) is None]
    if missing:
        flags = ", ".join(s.flag for s in missing)
        raise TensorparError(f"tensorpar {command} needs {flags}" + (" (on the command line or in --config)"
                                                                     if hasattr(namespace, "config") else ""))
    return options


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def to_toml(options, header: str = "") -> str:
    """The CLI fields of `options` as a flat TOML file that `load_toml` reads back to the same values.
    Fields that are None (a default the program works out) are written as comments."""
    lines = [f"# {line}" for line in header.splitlines()]
    for spec in cli_specs(type(options)):
        value = getattr(options, spec.name)
        if spec.meta["positional"]:
            continue
        lines.append(f"# {spec.name} = (unset)" if value is None else f"{spec.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def to_dict(options) -> dict:
    """The CLI fields of `options` as a JSON-ready dict (what a checkpoint's metadata records)."""
    return {s.name: getattr(options, s.name) for s in cli_specs(type(options))}


def changed_options(old: dict, new, ignore=()) -> list[str]:
    """'name old -> new' for every CLI field of `new` whose value differs from `old` (a `to_dict` of earlier
    options), leaving out the names in `ignore`."""
    out = []
    for name, value in to_dict(new).items():
        if name in ignore or name not in old:
            continue
        if old[name] != value:
            out.append(f"{name} {old[name]!r} -> {value!r}")
    return out


def _of_kind(spec: _Spec, v) -> bool:
    if spec.kind is str:
        return isinstance(v, str) or (_comma_separated(spec) and isinstance(v, (list, tuple)))
    if spec.kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, spec.kind) and (spec.kind is bool or not isinstance(v, bool))


def _paths_as_text(value):
    """A path-like value (pathlib.Path), or a list holding some, with each as the str its flag would have given;
    anything else, the same object."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, os.PathLike) for v in value):
        return [_paths_as_text(v) for v in value]
    return value


def check_choices(options) -> None:
    """Refuse a field whose value is not of its type or not among its choices: options built in Python skip
    argparse's conversions and checks. A text field given a path-like value (pathlib.Path) is set to its str."""
    for spec in _specs(type(options)):
        value = getattr(options, spec.name)
        if spec.kind is str:
            text = _paths_as_text(value)
            if text is not value:
                value = text
                setattr(options, spec.name, value)
        if value is None:
            right = spec.optional or spec.default is None
        elif spec.is_list:
            right = isinstance(value, (list, tuple)) and all(_of_kind(spec, v) for v in value)
        else:
            right = _of_kind(spec, value)
        if not right:
            raise TensorparError(f"{spec.name} ({spec.flag}) = {value!r} should be {_describe(spec)}")
    for spec in cli_specs(type(options)):
        choices, value = spec.meta["choices"], getattr(options, spec.name)
        if choices is None or value is None:
            continue
        for v in value if spec.is_list else [value]:
            if v not in choices:
                raise TensorparError(f"{spec.flag} must be one of {', '.join(map(str, choices))}; got {v!r}")
