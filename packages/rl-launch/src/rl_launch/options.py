"""Command-line options and config files for any tree of msgspec structs.

A command's configuration is a tree of (frozen) msgspec structs: a field whose type is a struct
is a *section*, any other field is an *option*. This module turns such a tree into a command line
and back, without knowing what the tree is for (`rl-launch ppo` uses it with `PPOConfig`, later
commands with their own roots):

    parser = argparse.ArgumentParser(prog="rl-launch ppo")
    build_parser(PPOConfig, parser)          # --config, --print-config, --algo.advantage.estimator, ...
    args = parser.parse_args(argv)
    config = load_config(PPOConfig, args.config, overrides_from_namespace(PPOConfig, args))
    print(dump_config(config))

Options are named by their dotted path (`ray.policy.num_actors`); the documentation of an option
is the string literal written right under its field (an attribute docstring), shown by `--help`
with the default and, for `Literal` types, the allowed values.

Layers, in increasing priority: the struct defaults, `base` (a nested dict, e.g. a preset's
settings), a YAML or JSON file, dotted command-line overrides (strings, parsed by `parse_value`
with the field's type). The merged dict is converted with `msgspec.convert`, which runs each
struct's `__post_init__` checks; every failure becomes one `ConfigError` whose message starts
with the dotted field (`train.max_norm: expected float, got str 'abc'`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import operator
import pathlib
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import yaml

from .config import ConfigError

__all__ = [
    "ConfigError",
    "HelpFormatter",
    "Option",
    "build_parser",
    "check_unknown_args",
    "dump_config",
    "field_docs",
    "iter_options",
    "load_config",
    "overrides_from_namespace",
    "parse_entry",
    "parse_value",
    "read_config_file",
    "split_mapping_entries",
]

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null"})
# The sentinel of a field without a default (a required option).
REQUIRED = msgspec.NODEFAULT


# --------------------------------------------------------------------------------------------
# Introspection: docs and the flat list of options.


@functools.cache
def _module_classes(filename: str) -> Mapping[str, ast.ClassDef]:
    """Qualified name -> class statement of every class in a source file, parsed once per file
    (`inspect.getsource` parses the whole module again for each class it is asked about)."""
    try:
        tree = ast.parse(pathlib.Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    found: dict[str, ast.ClassDef] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(prefix + node.name, node)
                walk(node.body, f"{prefix}{node.name}.")

    walk(tree.body, "")
    return types.MappingProxyType(found)


def _class_statement(cls: type) -> ast.ClassDef | None:
    try:
        filename = inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None
    statement = _module_classes(filename).get(cls.__qualname__) if filename else None
    if statement is not None:
        return statement
    try:  # not at module level under its qualified name (made in a function): inspect's search
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    return next((node for node in tree.body if isinstance(node, ast.ClassDef)), None)


@functools.cache
def _class_field_docs(cls: type) -> Mapping[str, str]:
    statement = _class_statement(cls)
    if statement is None:
        return {}
    docs: dict[str, str] = {}
    for field, following in itertools.pairwise(statement.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(following.value.value)
    return types.MappingProxyType(docs)


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string literal right under the field).

    Read from the source of `cls` and of its struct base classes (a subclass's doc wins); cached
    per class. Fields without a docstring are absent; a class whose source cannot be read (built
    in a REPL, `exec`) gives {}.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, msgspec.Struct) or not isinstance(klass, type):
            continue
        docs.update(_class_field_docs(klass))
    return docs


def _is_struct_type(type_: Any) -> bool:
    return isinstance(type_, type) and issubclass(type_, msgspec.Struct)


def _unannotated(type_: Any) -> Any:
    """`X` for `Annotated[X, msgspec.Meta(...)]` (a range checked by msgspec); other types unchanged."""
    while typing.get_origin(type_) is typing.Annotated:
        type_ = typing.get_args(type_)[0]
    return type_


def _bounds(type_: Any) -> str:
    """The range of an `Annotated[X, Meta(ge=..., ...)]` type (or of its `| None` arm) as text: `>= 1`."""
    for arm in (
        typing.get_args(type_) if typing.get_origin(type_) in (typing.Union, types.UnionType) else (type_,)
    ):
        if typing.get_origin(arm) is typing.Annotated:
            words = []
            for meta in typing.get_args(arm)[1:]:
                for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                    value = getattr(meta, name, None)
                    if value is not None:
                        words.append(f"{symbol} {value:g}")
            return ", ".join(words)
    return ""


def _strip_none(type_: Any) -> tuple[Any, bool]:
    """(the type without None and without its `Annotated` range, whether None was allowed) for
    `X | None`; other types unchanged."""
    type_ = _unannotated(type_)
    origin = typing.get_origin(type_)
    if origin in (typing.Union, types.UnionType):
        arms = [_unannotated(arm) for arm in typing.get_args(type_) if arm is not type(None)]
        if len(arms) < len(typing.get_args(type_)):
            return (arms[0] if len(arms) == 1 else functools.reduce(operator.or_, arms)), True
    return type_, False


def _literal_values(type_: Any) -> tuple[Any, ...] | None:
    inner, _ = _strip_none(type_)
    if typing.get_origin(inner) is typing.Literal:
        return typing.get_args(inner)
    return None


@dataclasses.dataclass(frozen=True)
class Option:
    """One field of a struct tree, named by its dotted path.

    `default` is the evaluated default (a `default_factory` is called), `REQUIRED` when the field
    has none; `choices` holds the allowed values of a `Literal` type (else None); sections
    (fields whose type is a struct) have `is_section=True` and their own options follow them.
    """

    name: str
    type: Any
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    is_section: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def _field_default(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return REQUIRED


def _struct_fields(cls: type) -> tuple[msgspec.structs.FieldInfo, ...]:
    if not _is_struct_type(cls):
        raise TypeError(f"cls: expected a msgspec.Struct subclass, got {cls!r}")
    return msgspec.structs.fields(cls)


def iter_options(cls: type, prefix: str = "") -> list[Option]:
    """Every field of the struct tree rooted at `cls`, depth first in field order.

    A section comes right before its own options (`algo`, `algo.advantage`,
    `algo.advantage.estimator`, ...). `prefix` is prepended to every name (`prefix.field`).
    """
    docs = field_docs(cls)
    options: list[Option] = []
    for field in _struct_fields(cls):
        name = f"{prefix}.{field.name}" if prefix else field.name
        doc = docs.get(field.name, "")
        if _is_struct_type(field.type):
            if not doc:
                doc = inspect.cleandoc(field.type.__doc__ or "")
            options.append(Option(name, field.type, _field_default(field), doc, None, True))
            options.extend(iter_options(field.type, name))
        else:
            options.append(Option(name, field.type, _field_default(field), doc, _literal_values(field.type)))
    return options


# --------------------------------------------------------------------------------------------
# Parsing one command-line value.


def _type_name(type_: Any) -> str:
    inner, optional = _strip_none(type_)
    if optional:
        return f"{_type_name(inner)} or none"
    choices = _literal_values(inner)
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin is tuple and args and args[-1] is not Ellipsis:
        names = {_type_name(arg) for arg in args}
        what = f"{len(args)} {names.pop()} values" if len(names) == 1 else f"{len(args)} values"
        return f"{what} (comma-separated or a JSON list)"
    if origin in (tuple, list):
        item = _type_name(args[0]) if args else "any"
        return f"a list of {item} (comma-separated or a JSON list)"
    if inner is bool:
        return "bool (true/false, yes/no, on/off, 1/0)"
    return getattr(inner, "__name__", str(inner))


def _parse_sequence(text: str, type_: Any, name: str) -> Any:
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{name}: expected {_type_name(type_)}, got {text!r} (not a JSON list: {error.msg})"
            ) from None
        items = [item if isinstance(item, str) else json.dumps(item) for item in loaded]
    else:
        items = [item.strip() for item in stripped.split(",")] if stripped else []
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise ConfigError(f"{name}: expected {_type_name(type_)}, got {len(items)} in {text!r}")
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(items)
    values = [parse_value(item, item_type, name=name) for item, item_type in zip(items, item_types)]
    return tuple(values) if origin is tuple else values


def parse_value(text: str, type_: Any, *, name: str = "value") -> Any:
    """The value of type `type_` written as `text` on the command line.

    bool: true/false, 1/0, yes/no, on/off (any case); int; float (`1e-6` too); str (as is);
    `Literal[...]`: one of the allowed values, compared as text (`"2"` -> 2 for `Literal[0, 1, 2]`);
    `X | None`: none/null (any case) -> None, else an `X`; `tuple[...]` / `list[...]`:
    comma-separated items (`0.9,0.95`) or a JSON list (`[0.9, 0.95]`), each parsed as the item
    type; any other type: the text read as a YAML scalar (checked later by `msgspec.convert`).

    Raises:
        ConfigError: `text` is not a valid `type_` (names `name`, the text and what is expected).
    """
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected the command-line text (str), got {type(text).__name__}")
    inner, optional = _strip_none(type_)
    lowered = text.strip().lower()
    if optional and lowered in _NONE:
        return None
    if _is_struct_type(inner):
        raise ConfigError(f"{name}: is a section, not an option; set its options ({name}.<option>)")
    choices = _literal_values(inner)
    if choices is not None:
        for choice in choices:
            if isinstance(choice, bool):
                if (choice and lowered in _TRUE) or (not choice and lowered in _FALSE):
                    return choice
            elif str(choice) == text.strip():
                return choice
        allowed = ", ".join(map(str, choices)) + (", none" if optional else "")
        raise ConfigError(f"{name}: {text!r} is not one of {allowed}")
    origin = typing.get_origin(inner)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(inner):
            try:
                return parse_value(text, arm, name=name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}: expected {_type_name(type_)}, got {text!r}")
    if origin in (tuple, list) or inner in (tuple, list):
        return _parse_sequence(text, inner, name)
    try:
        if inner is bool:
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(text)
        if inner is int:
            return int(text.strip())
        if inner is float:
            return float(text.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected {_type_name(type_)}, got {text!r}") from None
    if inner is str:
        return text
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


# --------------------------------------------------------------------------------------------
# argparse.


class HelpFormatter(argparse.HelpFormatter):
    """Wraps help text between words only: `token-mean` or `1e-06` never break across lines."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False) or [""]


def _format_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(_format_default(item) for item in value) if value else "[]"
    if isinstance(value, str) and value == "":
        return '""'
    return str(value)


def _help_text(option: Option) -> str:
    parts = [" ".join(option.doc.split())] if option.doc else []
    bounds = _bounds(option.type)
    if bounds:
        parts.append(f"[{bounds}]")
    parts.append("(required)" if option.required else f"(default: {_format_default(option.default)})")
    # argparse %-formats help strings.
    return " ".join(parts).replace("%", "%%")


def _metavar(option: Option) -> str:
    if option.choices is not None:
        inner, optional = _strip_none(option.type)
        names = [_format_default(choice) for choice in option.choices] + (["none"] if optional else [])
        return "{" + ",".join(names) + "}"
    inner, _ = _strip_none(option.type)
    if inner is bool:
        return "{true,false}"
    origin = typing.get_origin(inner)
    if origin in (tuple, list):
        return "A,B,..." if origin is list or Ellipsis in typing.get_args(inner) else "A,B"
    return getattr(inner, "__name__", "VALUE").upper()


def build_parser(cls: type, parser: argparse.ArgumentParser) -> None:
    """Add the options of the struct tree `cls` to `parser`.

    Adds `--config FILE` (YAML or JSON), `--print-config` (print the resolved config and exit),
    and one `--<dotted.name> VALUE` per option, in one argument group per section (title: the
    dotted section name, description: its docstring; the root's own options go to a group
    "general"). Values stay strings (`load_config` parses them); options not given are absent
    from the namespace (`argparse.SUPPRESS`). A bool option also works as a bare flag meaning
    true (`--ckpt.load_checkpoint`). Prefix abbreviations are turned off on `parser`, so a typo
    is never silently taken for another option, and a short usage line is set when it has none.
    """
    options = iter_options(cls)
    parser.allow_abbrev = False
    if parser.usage is None:
        parser.usage = "%(prog)s [--config FILE] [--print-config] [--SECTION.OPTION VALUE ...]"
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = HelpFormatter
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file of settings (nested sections); command-line options override it.",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="Print the resolved configuration as YAML and exit without running anything.",
    )
    # One group per section that has options of its own, in the order sections appear.
    with_leaves = {option.name.rpartition(".")[0] for option in options if not option.is_section}
    root_doc = " ".join(inspect.cleandoc(cls.__doc__ or "").split()).replace("%", "%%")
    groups: dict[str, Any] = {}
    if "" in with_leaves:
        groups[""] = parser.add_argument_group("general", root_doc or None)
    for option in options:
        if option.is_section and option.name in with_leaves:
            doc = " ".join(option.doc.split()).replace("%", "%%")
            groups[option.name] = parser.add_argument_group(option.name, doc or None)
    for option in options:
        if option.is_section:
            continue
        section = option.name.rpartition(".")[0]
        inner, _ = _strip_none(option.type)
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if inner is bool else {}
        groups[section].add_argument(
            f"--{option.name}",
            dest=option.name,
            default=argparse.SUPPRESS,
            metavar=_metavar(option),
            help=_help_text(option),
            **extra,
        )


def overrides_from_namespace(cls: type, namespace: argparse.Namespace) -> dict[str, str]:
    """The dotted options given on the command line (name -> text) in a parsed namespace."""
    given = vars(namespace)
    return {
        option.name: given[option.name]
        for option in iter_options(cls)
        if not option.is_section and option.name in given
    }


def _close_match(word: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(word, allowed, n=1)
    return f" (did you mean {match[0]}?)" if match else ""


def _unknown_key_message(cls: type, dotted: str) -> str | None:
    """A message for the first unknown component of `dotted` in the tree of `cls`, or None."""
    current: Any = cls
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        if not _is_struct_type(current):
            path = ".".join(parts[:index])
            return f"{dotted}: unknown option; {path} is an option, not a section"
        fields = {field.name: field for field in msgspec.structs.fields(current)}
        if part not in fields:
            path = ".".join(parts[: index + 1])
            allowed = list(fields)
            return f"{path}: unknown option; allowed: {', '.join(allowed)}{_close_match(part, allowed)}"
        current = fields[part].type
    return None


def check_unknown_args(cls: type, extras: list[str]) -> None:
    """Reject arguments argparse did not recognise (from `parse_known_args`) with a helpful message.

    Raises:
        ConfigError: for the first unknown `--x.y` option, naming the unknown part, the allowed
            names there and the closest one; or listing stray arguments that are not options.
    """
    for argument in extras:
        if argument.startswith("--"):
            dotted = argument[2:].partition("=")[0]
            message = _unknown_key_message(cls, dotted)
            if message is None:  # a section given as an option: `--algo x`
                message = f"{dotted}: is a section, not an option; set its options (--{dotted}.<option>)"
            raise ConfigError(message)
    if extras:
        raise ConfigError(f"unrecognized arguments: {' '.join(extras)}")


# --------------------------------------------------------------------------------------------
# Files, layers, conversion.


class _Loader(yaml.SafeLoader):
    """safe_load, with YAML 1.2 floats: `1e-6` is a float (YAML 1.1 reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in a YAML or JSON config file (`.json`: JSON, anything else: YAML; empty: {}).

    Raises:
        ConfigError: the file is missing or unreadable, has a syntax error (names file, line and
            column), or does not hold a mapping at the top.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path}: cannot be read ({error})") from None
    if str(path).endswith(".json"):
        try:
            data = json.loads(text) if text.strip() else None
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"config file {path}, line {error.lineno}, column {error.colno}: invalid JSON: {error.msg}"
            ) from None
    else:
        try:
            data = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error)
            raise ConfigError(f"config file {path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: expected a mapping of sections and options at the top, "
            f"got {type(data).__name__}"
        )
    return data


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str, source: str) -> None:
    """Reject unknown keys and non-mapping sections in one layer, before merging hides them."""
    fields = {field.name: field for field in msgspec.structs.fields(cls)}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            allowed = list(fields)
            hint = _close_match(str(key), allowed)
            if not hint and isinstance(key, str) and "." in key:
                hint = " (sections nest: write `a: {b: ...}`, not `a.b: ...`)"
            raise ConfigError(f"{dotted}: unknown option; allowed: {', '.join(allowed)}{hint}{source}")
        type_ = fields[key].type
        if _is_struct_type(type_):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{dotted}: is a section; expected a mapping of its options, "
                    f"got {type(value).__name__} {value!r}{source}"
                )
            _check_keys(type_, value, dotted, source)


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = _copy(value)
    return into


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def _is_mapping_type(type_: Any) -> bool:
    inner, _ = _strip_none(type_)
    return inner is dict or typing.get_origin(inner) is dict


def _mapping_option(cls: type, dotted: str) -> str | None:
    """The dict-typed option that `dotted` is an entry of (`algo.policy.options` for
    `algo.policy.options.epsilon_high`; `train.deepspeed_config` for the nested entry
    `train.deepspeed_config.zero_optimization.overlap_comm`), or None."""
    leaves = {option.name: option for option in iter_options(cls) if not option.is_section}
    parts = dotted.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in leaves:
            return prefix if _is_mapping_type(leaves[prefix].type) else None
    return None


def parse_entry(text: str) -> Any:
    """A dict entry's command-line text read as YAML (`0.28`, `true`, `null`, `[1, 2]`); the text
    itself when it is not valid YAML. `none` stays the string "none" (a value some options take)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def split_mapping_entries(cls: type, extras: list[str]) -> tuple[dict[str, str], list[str]]:
    """Pick the entries of dict-typed options out of arguments argparse did not know.

    `--algo.policy.options.epsilon_high 0.28` (or `=0.28`) is the entry `epsilon_high` of the
    dict option `algo.policy.options`; argparse cannot declare such open-ended names. Returns
    (dotted entry -> text, the arguments left over).
    """
    entries: dict[str, str] = {}
    rest: list[str] = []
    index = 0
    while index < len(extras):
        argument = extras[index]
        name, equals, value = argument[2:].partition("=") if argument.startswith("--") else ("", "", "")
        if name and _mapping_option(cls, name) is not None:
            if not equals:
                if index + 1 >= len(extras) or extras[index + 1].startswith("--"):
                    raise ConfigError(f"{name}: expected a value")
                index += 1
                value = extras[index]
            entries[name] = value
        else:
            rest.append(argument)
        index += 1
    return entries, rest


def _nest_overrides(cls: type, overrides: Mapping[str, Any]) -> dict[str, Any]:
    leaves = {option.name: option for option in iter_options(cls) if not option.is_section}
    nested: dict[str, Any] = {}
    for dotted, text in overrides.items():
        if dotted not in leaves:
            if _mapping_option(cls, dotted) is None:
                message = _unknown_key_message(cls, dotted)
                raise ConfigError(message or f"{dotted}: is a section, not an option; set its options")
            value = parse_entry(text) if isinstance(text, str) else text
            *sections, last = dotted.split(".")
            level = nested
            for section in sections:
                level = level.setdefault(section, {})
            level[last] = value
            continue
        value = parse_value(text, leaves[dotted].type, name=dotted) if isinstance(text, str) else text
        *sections, last = dotted.split(".")
        level = nested
        for section in sections:
            level = level.setdefault(section, {})
        level[last] = value
    return nested


_PATH_SUFFIX = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_EXPECTED = re.compile(r"^Expected `(?P<expected>[^`]+)`(?P<rest>.*?)(?:, got `(?P<got>[^`]+)`)?$")
_TYPE_WORDS = {"array": "list", "object": "mapping", "null": "None"}


def _lookup(data: Any, path: str) -> Any:
    for key in re.findall(r"[^.\[\]]+", path):
        try:
            data = data[int(key)] if isinstance(data, list) else data[key]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return data


def _lookup_type(cls: type, path: str) -> Any:
    current: Any = cls
    for key in path.split("."):
        if not _is_struct_type(current):
            return None
        fields = {field.name: field.type for field in msgspec.structs.fields(current)}
        current = fields.get(key.partition("[")[0])
    return current


def _translate(cls: type, error: msgspec.ValidationError, data: Mapping[str, Any]) -> ConfigError:
    message = str(error)
    match = _PATH_SUFFIX.search(message)
    path = ""
    if match:
        message = message[: match.start()]
        path = match.group("path").lstrip(".")
    if error.__cause__ is not None:
        # A struct's own check (__post_init__): its message names the field within its struct.
        own = str(error.__cause__)
        if not path or own.startswith(f"{path}.") or own.startswith(f"{path}:"):
            return ConfigError(own)
        head = own.partition(":")[0]
        if re.fullmatch(r"[A-Za-z_][\w.\[\]]*", head):
            return ConfigError(f"{path}.{own}")
        return ConfigError(f"{path}: {own}")
    where = path or "<root>"
    unknown = re.fullmatch(r"Object contains unknown field `(?P<key>[^`]+)`", message)
    if unknown:
        dotted = f"{path}.{unknown.group('key')}" if path else unknown.group("key")
        return ConfigError(_unknown_key_message(cls, dotted) or f"{dotted}: unknown option")
    if message.startswith("Invalid enum value"):
        choices = _literal_values(_lookup_type(cls, path)) if path else None
        value = _lookup(data, path)
        if choices is not None:
            return ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return ConfigError(f"{where}: {value!r} is not an allowed value")
    expected = _EXPECTED.match(message)
    if expected:
        value = _lookup(data, path)
        want = _TYPE_WORDS.get(expected.group("expected"), expected.group("expected"))
        text = f"expected {want}{expected.group('rest')}"
        if expected.group("got"):
            got = _TYPE_WORDS.get(expected.group("got"), expected.group("got"))
            return ConfigError(f"{where}: {text}, got {got} {value!r}")
        bound = re.fullmatch(r"\s*(?P<op>[<>]=?)\s*(?P<limit>\S+)", expected.group("rest"))
        if bound:  # a msgspec.Meta range: `train.max_steps: 0 must be >= 1`
            return ConfigError(f"{where}: {value!r} must be {bound.group('op')} {bound.group('limit')}")
        return ConfigError(f"{where}: {text.replace('`', '')} (value: {value!r})")
    return ConfigError(f"{where}: {message}")


def load_config(
    cls: type,
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    rewrite: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Any:
    """The `cls` struct built from, in increasing priority: its defaults, `base`, the file, `overrides`.

    Args:
        cls: root struct type.
        path: a YAML or JSON file of nested sections (`read_config_file`), or None.
        overrides: dotted option -> command-line text (parsed with `parse_value` and the field's
            type; a non-str value is taken as already parsed).
        base: a nested dict of settings under the file (e.g. a preset's).
        rewrite: applied to the file's settings before they are checked (e.g. renaming an
            option's former name), or None.

    Raises:
        ConfigError: a missing/invalid file, an unknown option (with the allowed names and the
            closest one), a value of the wrong type or outside a `Literal`, or a failed
            `__post_init__` check; the message starts with the dotted field.
    """
    merged: dict[str, Any] = {}
    layers: list[tuple[Mapping[str, Any], str]] = []
    if base is not None:
        if not isinstance(base, Mapping):
            raise ConfigError(f"base: expected a mapping of settings, got {type(base).__name__}")
        layers.append((base, " (in the base settings)"))
    if path is not None:
        settings = read_config_file(path)
        layers.append((rewrite(settings) if rewrite is not None else settings, f" (in {path})"))
    for layer, source in layers:
        _check_keys(cls, layer, "", source)
        _merge(merged, layer)
    if overrides:
        _merge(merged, _nest_overrides(cls, overrides))
    try:
        return msgspec.convert(merged, cls)
    except msgspec.ValidationError as error:
        raise _translate(cls, error, merged) from None


class _Dumper(yaml.SafeDumper):
    """Block-style mappings, flow-style lists of scalars (`adam_betas: [0.9, 0.95]`)."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(not isinstance(item, (dict, list)) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(tuple, _represent_list)


def dump_config(config: Any) -> str:
    """The struct tree `config` as YAML, sections and options in field order.

    `load_config(type(config), path_of_this_text)` gives back an equal struct (tuples are written
    as lists and converted back to tuples by their field type).
    """
    data = msgspec.to_builtins(config)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
