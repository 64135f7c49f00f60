"""Resolve a job's config: dataclass defaults < ``--job.config_file`` TOML < command-line flags.

Command-line syntax (tyro; ``_`` and ``-`` are interchangeable in flag names)::

    --section.field=value   or   --section.field value
    bools     --checkpoint.enable            (bare flag: true)
              --checkpoint.enable=false      (also true/false/True/False as a separate token)
    lists     --checkpoint.exclude_from_loading optimizer,dataloader   (comma- or
              space-separated items; the flag alone gives an empty list)
    list[list[str]]
              --x.groups a,b c               -> [["a", "b"], ["c"]]  (one token per inner list,
                                                items split on commas)
              --x.groups '[["a","b"],["c"]]' -> the same, as one JSON token
    None      --training.seed None           (for ``X | None`` fields)

``--job.custom_args_module=pkg.mod`` (flag or the TOML's ``[job]`` table) merges ``pkg.mod``'s
``JobConfig`` into the core one before anything else is parsed, so its fields work in TOML, on
the command line and in ``--help``. After parsing, every section's ``validate(config)`` runs;
a bad value raises :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin

import tyro
from tyro.constructors import ConstructorRegistry, PrimitiveConstructorSpec, PrimitiveTypeInfo

from torchtitan.config.job_config import ConfigError, JobConfig, to_dict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "ConfigError",
    "ConfigManager",
    "apply_toml",
    "check_value",
    "flag_value",
    "load_toml",
    "merge_configs",
    "parse_nested_list",
    "to_toml",
    "validate_config",
    "write_toml",
]

T = TypeVar("T", bound="DataclassInstance")


class ConfigManager:
    """Parses a job's config. ``custom_module`` is the imported ``--job.custom_args_module``
    (None without one) after :meth:`parse_args`, so the caller can pick its trainer class."""

    def __init__(self, config_cls: type[JobConfig] = JobConfig) -> None:
        self.config_cls = config_cls
        self.custom_module: types.ModuleType | None = None

    def parse_args(self, argv: Sequence[str] | None = None) -> JobConfig:
        """The validated config from ``argv`` (default ``sys.argv[1:]``).

        Raises FileNotFoundError for a missing config file, ConfigError for a bad TOML key,
        type or value; exits (SystemExit 2) on an unknown or malformed flag, like argparse,
        and prints help (SystemExit 0) for ``--help``.
        """
        args = list(sys.argv[1:] if argv is None else argv)
        config_file = flag_value(args, "job.config_file")
        toml_data = load_toml(config_file) if config_file else {}

        config_cls = self.config_cls
        self.custom_module = custom_module(args, toml_data, config_cls)
        if self.custom_module is not None:
            config_cls = merge_configs(config_cls, self.custom_module.JobConfig)

        asks_help = any(a in ("-h", "--help") for a in args)
        # --help shows the dataclass defaults (what python -m torchtitan.train, torchrun and
        # Slurm users get) and, after them, what the TOML sets; a run starts from the TOML's.
        defaults = config_cls() if asks_help else apply_toml(config_cls(), toml_data)
        with (
            _indented_docstrings_as_paragraphs(),
            _toml_values_after_help(config_file if asks_help else None, toml_data),
        ):
            config = tyro.cli(
                config_cls,
                prog=_PROG,
                args=args,
                default=defaults,
                description=_class_doc(config_cls),
                registry=_cli_registry(),
                # Bools are parsed by our rule below (bare flag or explicit value), not as
                # tyro's --x/--no-x pairs.
                config=(tyro.conf.FlagConversionOff,),
                use_underscores=True,  # --help shows the names as written in TOML
            )
        validate_config(config)
        return config


_PROG = "./run_train.sh (or python -m torchtitan.train)"


@contextlib.contextmanager
def _toml_values_after_help(config_file: str | None, toml_data: dict[str, Any]) -> Iterator[None]:
    """After tyro's help (it exits), list the values ``config_file`` sets, as flags."""
    try:
        yield
    except SystemExit as e:
        if config_file and e.code in (0, None):
            print(f"\nValues that {config_file} sets (job.config_file; flags override them):")
            for section, table in toml_data.items():
                items = table.items() if isinstance(table, dict) else [("", table)]
                for key, value in items:
                    name = f"{section}.{key}" if key else section
                    print(f"  --{name}={_as_flag_value(value)}")
        raise


def _as_flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(_as_flag_value, value))
    return str(value)


@contextlib.contextmanager
def _indented_docstrings_as_paragraphs() -> Iterator[None]:
    """Make ``--help`` flow multi-line field docstrings as one paragraph.

    tyro joins a docstring's lines only when a line starts with a letter, and it reads our
    attribute docstrings before removing their indentation, so every continuation line would
    start a new help line. Cleaning the indentation first (``inspect.cleandoc``) fixes that;
    the patch lives only for the duration of one ``tyro.cli`` call.
    """
    from tyro import _strings

    original = _strings.remove_single_line_breaks

    def remove_single_line_breaks(helptext: str) -> str:
        return original(inspect.cleandoc(helptext))

    _strings.remove_single_line_breaks = remove_single_line_breaks
    try:
        yield
    finally:
        _strings.remove_single_line_breaks = original


def validate_config(config: Any) -> None:
    """Run ``validate(config)`` of every section that has one, in field order."""
    for f in dataclasses.fields(config):
        validate = getattr(getattr(config, f.name), "validate", None)
        if callable(validate):
            validate(config)


# ---------------------------------------------------------------------------------------------
# Custom args modules


def raw_value(args: Sequence[str], toml_data: dict[str, Any], name: str) -> Any:
    """``section.field``'s value as given, before any parse: the flag's string (the last one;
    ``"true"`` for a bare flag), else the TOML's value, else None."""
    found: Any = None
    for i, arg in enumerate(args):
        flag, has_value, rest = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if flag.replace("-", "_") != name:
            continue
        if has_value:
            found = rest
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            found = args[i + 1]
        else:
            found = "true"
    if found is not None:
        return found
    section, _, field_name = name.partition(".")
    table = toml_data.get(section)
    return table.get(field_name) if isinstance(table, dict) else None


def custom_module(
    args: Sequence[str], toml_data: dict[str, Any], config_cls: type = JobConfig
) -> types.ModuleType | None:
    """The custom args module that ``args`` (or the TOML) name, imported; None without one."""
    name = raw_value(args, toml_data, "job.custom_args_module")
    if not isinstance(name, str):
        name = config_cls().job.custom_args_module
    return _import_custom_module(name) if name else None


def _import_custom_module(name: str) -> types.ModuleType:
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(
            "job.custom_args_module",
            name,
            f"it does not import ({e}); give a dotted module path importable from here, e.g. "
            "torchtitan.experiments.fault_tolerance.job_config",
        ) from e
    custom = getattr(module, "JobConfig", None)
    if not (isinstance(custom, type) and dataclasses.is_dataclass(custom)):
        raise ConfigError(
            "job.custom_args_module",
            name,
            "the module must define a JobConfig dataclass whose fields are the sections it adds",
        )
    return module


def merge_configs(base_cls: type[T], custom_cls: type) -> type[T]:
    """A new JobConfig class: ``base_cls`` extended by ``custom_cls`` (a dataclass whose fields
    are section dataclasses, as in a custom args module).

    A section in both gets the fields of both (the custom one wins on a name clash, and its
    methods, e.g. ``validate``, override and can call ``super()``); a new section is appended.
    Merged classes inherit from both inputs, so ``isinstance`` against either holds, methods
    such as ``to_dict`` survive, and tyro finds every field's docstring along the MRO.
    """
    # The cache sits on an untyped helper: mypy takes a dataclass class for unhashable
    # (its instances are), so it would reject ``type[T]`` as an argument of a cached function.
    return _merge_configs(base_cls, custom_cls)


# Cached so that merging the same pair twice gives the same class: configs parsed separately
# then compare equal (dataclass __eq__ requires the same class).
@functools.cache
def _merge_configs(base_cls: type, custom_cls: type) -> type:
    base_hints = typing.get_type_hints(base_cls)
    custom_hints = typing.get_type_hints(custom_cls)
    sections: dict[str, type] = {f.name: base_hints[f.name] for f in dataclasses.fields(base_cls)}
    for f in dataclasses.fields(custom_cls):
        section = custom_hints[f.name]
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            raise TypeError(
                f"{custom_cls.__module__}.{custom_cls.__qualname__}.{f.name}: a section must be "
                f"a dataclass, got {section!r}"
            )
        base_section = sections.get(f.name)
        sections[f.name] = (
            section if base_section is None else _merge_section(base_section, section)
        )
    namespace: dict[str, Any] = {
        "__annotations__": dict(sections),
        **{name: dataclasses.field(default_factory=cls) for name, cls in sections.items()},
    }
    return _derived_dataclass("config", custom_cls, base_cls, namespace)


@functools.cache
def _merge_section(base: type, custom: type) -> type:
    if issubclass(custom, base):  # written as an extension of ours already
        return custom
    if issubclass(base, custom):
        return base
    return _derived_dataclass("section", custom, base, {})


def _derived_dataclass(
    kind: Literal["config", "section"], custom: type, base: type, namespace: dict[str, Any]
) -> type:
    bases = tuple(
        c
        for c in (custom, base)
        if not any(o is not c and issubclass(o, c) for o in (custom, base))
    )
    # tyro reads field docstrings from source, starting at the class itself and giving up at
    # the first class without source: claiming the identity of a class with source (the
    # custom one, else ours) lets inspect find it, and tyro walks on down the MRO from there.
    named_after = custom if _has_source(custom) else base
    namespace = {
        **namespace,
        "__module__": named_after.__module__,
        "__qualname__": named_after.__qualname__,
        "__doc__": _class_doc(custom) or _class_doc(base),
        # pickle finds classes by name, which would give the claimed class, not this one;
        # rebuilding through the (cached) merge gives this one back, also in a new process.
        "__reduce__": lambda self: (_rebuild, (kind, base, custom, dict(self.__dict__))),
    }
    return dataclasses.dataclass(type(custom.__name__, bases, namespace))


def _rebuild(kind: str, base: type, custom: type, state: dict[str, Any]) -> Any:
    # type[object], not type: for a plain ``type`` mypy takes cls.__new__ for the metaclass's.
    cls: type[object] = (
        merge_configs(base, custom) if kind == "config" else _merge_section(base, custom)
    )
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _has_source(cls: type) -> bool:
    try:
        inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return True


def _class_doc(cls: type) -> str | None:
    # A dataclass without a docstring gets its signature as __doc__; that is no description.
    doc = cls.__doc__
    if doc is None or doc.startswith(f"{cls.__name__}("):
        return None
    return doc


# ---------------------------------------------------------------------------------------------
# TOML


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file as dicts; FileNotFoundError naming ``path`` when it does not exist."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"job.config_file: no such file: {str(path)!r}")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("job.config_file", str(path), f"not valid TOML: {e}") from e


def apply_toml(config: T, data: Mapping[str, Any]) -> T:
    """``config`` with the values of a TOML document (``{section: {key: value}}``) applied,
    each checked against its field's type annotation."""
    sections = [f.name for f in dataclasses.fields(config)]
    updates: dict[str, Any] = {}
    for name, table in data.items():
        if name not in sections:
            raise ConfigError(
                name, table, f"unknown section [{name}]; sections are: {', '.join(sections)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(name, table, f"must be a table: a [{name}] header, then key = value")
        section = getattr(config, name)
        hints = typing.get_type_hints(type(section))
        keys = [f.name for f in dataclasses.fields(section)]
        values = {}
        for key, value in table.items():
            where = f"{name}.{key}"
            if key not in keys:
                raise ConfigError(where, value, f"unknown key; keys of [{name}]: {', '.join(keys)}")
            values[key] = check_value(value, hints[key], where)
        updates[name] = dataclasses.replace(section, **values)
    return dataclasses.replace(config, **updates)


def check_value(value: Any, annotation: Any, where: str) -> Any:
    """``value`` (as read from TOML) if it fits ``annotation``, ints widened to float where a
    float is expected; ConfigError naming ``where`` otherwise.

    Handles bool, int, float, str, Literal, ``X | None``, list[X], dict[str, X] and plain
    classes; anything else passes unchecked (tyro still checks it on the command line).
    """
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        # TOML has no null: None is had by leaving the key out, so only the other arms can match.
        for arm in args:
            if arm is type(None):
                continue
            try:
                return check_value(value, arm, where)
            except ConfigError:
                pass
        raise ConfigError(where, value, f"expected {_type_name(annotation)}")
    if origin is Literal:
        # type() as well as ==, so that true does not pass for 1 nor 1 for 1.0
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(where, value, f"expected {_type_name(annotation)}")
    if origin in (list, dict):
        if not isinstance(value, origin):
            raise ConfigError(where, value, f"expected {_type_name(annotation)}")
        item_type = args[-1] if args else Any
        items = value.items() if isinstance(value, dict) else enumerate(value)
        checked = {}
        for index, item in items:
            try:
                checked[index] = check_value(item, item_type, where)
            except ConfigError:
                raise ConfigError(
                    where,
                    value,
                    f"expected {_type_name(annotation)}; item {index!r} is {item!r}",
                ) from None
        return checked if isinstance(value, dict) else list(checked.values())
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(where, value, "expected float")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(where, value, "expected int")
    if isinstance(annotation, type) and origin is None:
        if isinstance(value, annotation):
            return value
        raise ConfigError(where, value, f"expected {_type_name(annotation)}")
    return value


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        none = " (None: leave the key out)" if type(None) in args else ""
        return " | ".join(names) + none
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", repr(annotation))


_TOML_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def to_toml(config: Any) -> str:
    """The config as a TOML document, one table per section; None values are left out (so
    loading it back gives the field's default, which is None for every optional core field)."""
    blocks = []
    for section, table in to_dict(config).items():
        lines = [f"[{_toml_key(section)}]"]
        for key, value in table.items():
            lines.append(f"{_toml_key(key)} = {_toml_value(value, f'{section}.{key}')}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def write_toml(config: Any, path: str | os.PathLike[str]) -> Path:
    """Write :func:`to_toml` of ``config`` to ``path`` (parents created); returns the path.
    ``--job.config_file=<path>`` gives the same config back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(config), encoding="utf-8")
    return path


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:  # TOML forbids raw control characters
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # always has '.', 'e' or is inf/nan: reads back as a float
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{_toml_key(k)} = {_toml_value(v, where)}" for k, v in value.items())
        return "{ " + ", ".join(items) + " }"
    raise TypeError(f"{where}: {value!r} has no TOML form (type {type(value).__name__})")


# ---------------------------------------------------------------------------------------------
# Command line


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name=v`` or ``--name v`` in argv (last one wins, as in argparse), read
    before tyro runs because it decides what tyro parses (and by a launcher that needs one
    value of its groups' config without parsing the rest)."""
    value = None
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        flag, has_value, rest = arg[2:].partition("=")
        if flag.replace("-", "_") != name:
            continue
        if has_value:
            value = rest
        elif i + 1 < len(argv):
            value = argv[i + 1]
    return value


_TRUE, _FALSE = ("true", "True"), ("false", "False")


def _bool_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    # One flag accepting 0 or 1 value: `--x.enable` and `--x.enable=true/false` both work.
    if info.type is not bool:
        return None
    return PrimitiveConstructorSpec(
        nargs=(0, 1),
        metavar="[{true,false}]",
        instance_from_str=lambda tokens: not tokens or tokens[0] in _TRUE,
        is_instance=lambda value: isinstance(value, bool),
        str_from_instance=lambda value: ["true" if value else "false"],
        choices=_TRUE + _FALSE,
    )


def _nested_list_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    # tyro's own syntax for list[list[X]] cannot give more than one inner list in one flag;
    # ours: one token per inner list, items split on commas, or the whole value as JSON.
    outer = get_args(info.type) if info.type_origin is list else ()
    if len(outer) != 1 or get_origin(outer[0]) is not list:
        return None
    inner = get_args(outer[0])
    item_type = inner[0] if inner else str
    if item_type not in (str, int, float):
        return None
    name = item_type.__name__.upper()
    return PrimitiveConstructorSpec(
        nargs="*",
        metavar=f"{name},{name}... [{name},{name}... ...] | JSON",
        instance_from_str=lambda tokens: parse_nested_list(tokens, item_type),
        is_instance=lambda value: (
            isinstance(value, list) and all(isinstance(v, list) for v in value)
        ),
        str_from_instance=lambda value: [",".join(str(v) for v in inner) for inner in value],
    )


def _flat_list_rule(info: PrimitiveTypeInfo) -> PrimitiveConstructorSpec | None:
    # list[X] takes space-separated tokens, and each token may hold several items separated by
    # commas, as torchtitan writes them: `--checkpoint.exclude_from_loading optimizer,dataloader`.
    args = get_args(info.type) if info.type_origin is list else ()
    if len(args) != 1 or args[0] not in (str, int, float):
        return None
    item_type = args[0]
    name = item_type.__name__.upper()
    return PrimitiveConstructorSpec(
        nargs="*",
        metavar=f"{name}[,{name}...] [{name} ...]",
        instance_from_str=lambda tokens: parse_flat_list(tokens, item_type),
        is_instance=lambda value: (
            isinstance(value, list) and not any(isinstance(v, list) for v in value)
        ),
        str_from_instance=lambda value: [str(v) for v in value],
    )


def parse_flat_list(tokens: Sequence[str], item_type: type = str) -> list[Any]:
    """Command-line tokens to a list: ``["a,b", "c"]`` gives ``["a", "b", "c"]``."""
    return [item_type(item) for token in tokens for item in token.split(",") if item]


def parse_nested_list(tokens: Sequence[str], item_type: type = str) -> list[list[Any]]:
    """Command-line tokens to a list of lists: ``["a,b", "c"]`` or ``['[["a","b"],["c"]]']``
    (one JSON token) both give ``[["a", "b"], ["c"]]``; an empty token is an empty inner list."""
    if len(tokens) == 1 and tokens[0].lstrip().startswith("["):
        try:
            value = json.loads(tokens[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{tokens[0]!r} is not valid JSON: {e}") from None
        if not (isinstance(value, list) and all(isinstance(v, list) for v in value)):
            raise ValueError(f"{tokens[0]!r} is not a JSON list of lists")
        return [[_nested_item(item, item_type) for item in inner] for inner in value]
    return [[item_type(item) for item in token.split(",") if item] for token in tokens]


def _nested_item(item: Any, item_type: type) -> Any:
    if item_type is str and not isinstance(item, str):
        raise ValueError(f"{item!r} is not a string; quote it in the JSON")
    return item_type(item)


def _cli_registry() -> ConstructorRegistry:
    registry = ConstructorRegistry()
    registry.primitive_rule(_bool_rule)
    registry.primitive_rule(_nested_list_rule)
    registry.primitive_rule(_flat_list_rule)
    return registry
