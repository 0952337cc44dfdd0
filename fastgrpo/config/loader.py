"""The config framework: YAML + dotted overrides, strict keys, type coercion, checks and ``--help-config``.

It knows no section: a run config class (``TrainConfig``, ``SFTConfig``, see :mod:`fastgrpo.config.runs`) is a
tree of keyword-only dataclasses, each field with a one-line docstring (the string literal under it) that
:func:`describe` prints. Loading builds that tree from a mapping, naming the closest valid key for an unknown one,
coerces each value to its annotation, then validates: every choice field, then each section's ``validate`` (what
the section accepts on its own), then the checks its components registered for it (:func:`section_check`).

Choice fields have one source each. A closed set is typed ``Literal[...]``. An open set (loss types, rewards,
rollout engines, attention backends, kernel backends, metric sinks) is the registry of the component that
implements it, named in the field's metadata (:func:`registry`) as ``'module:NAME'``: validation, the closest-name
hint and ``--help-config`` read that registry, so a name registered at run time is accepted with no edit here.
The registry's module is imported only when a config is validated or described, so no config module imports a
component (components import their config sections); tests/test_layering.py reads these paths as imports.

What a component serves (an algorithm, a rollout engine, the environments) is checked by that component: its module
registers the check with :func:`section_check` for the section it reads, and :func:`check_section` runs it, so
config never calls up into a component by name. A run config is validated only after
:func:`load_choice_tables` has imported every component its choice fields name, so every section meets its
components' checks whether or not the caller imported them.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import math
import stat
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = ["ConfigError", "check", "check_finite", "check_section", "choices", "describe", "fail", "load_choice_tables",
           "load_config", "not_a_file", "registry", "section_check", "to_dict"]


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field."""


def fail(path: str, msg: str) -> None:
    raise ConfigError(f"{path}: {msg}")


def check(cond: bool, path: str, msg: str) -> None:
    if not cond:
        fail(path, msg)


def registry(source: str, *, also: tuple[str, ...] = (), plugins: bool = False) -> dict[str, Any]:
    """Field metadata: the field's choices are the keys of the registry ``source`` ('module:NAME'), plus ``also``
    (e.g. 'auto'). ``plugins``: entries that contain ':' are 'path/to/file.py:name' specs, checked when loaded."""
    return {"registry": source, "also": also, "plugins": plugins}


def registry_table(source: str) -> Any:
    """The registry ``source`` ('module:NAME') itself, imported when a config is validated (never at import: config
    is the bottom layer, and the registries live in the components above it)."""
    module, _, attr = source.partition(":")
    return getattr(importlib.import_module(module), attr)


def choices(cls: type, name: str) -> list | None:
    """The accepted values of field ``name`` of config class ``cls`` (list fields: of each entry), or None."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if "registry" in f.metadata:
        return [*f.metadata["also"], *registry_table(f.metadata["registry"])]
    tp = _field_types(cls)[name]
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return list(typing.get_args(tp)) if typing.get_origin(tp) is Literal else None


def _check_choice_fields(section: Any, prefix: str) -> None:
    """Every Literal or registry field of ``section`` holds one of its choices (``prefix`` ends with a dot)."""
    for f in dataclasses.fields(section):
        names = choices(type(section), f.name)
        if names is None:
            continue
        value = getattr(section, f.name)
        for v in value if isinstance(value, list) else [value]:
            if f.metadata.get("plugins") and ":" in v:
                continue
            hint = _closest(v, names) if isinstance(v, str) else ""
            check(v in names, f"{prefix}{f.name}", f"unknown {v!r}; choices: {', '.join(map(str, names))}{hint}")


SectionCheck = Callable[[Any, str], None]
"""``check(section, path)``: raises ConfigError naming the dotted field (``path`` is the section's, '' for a run
config's own fields)."""

_SECTION_CHECKS: list[tuple[type, SectionCheck]] = []


def section_check(cls: type) -> Callable[[SectionCheck], SectionCheck]:
    """Decorator: register a component's check of config section ``cls`` (and of its subclasses), run after the
    section's own ``validate`` each time one is checked (:func:`check_section`; a run config's own, ``cls`` a run
    config class: :func:`component_checks`). The component's module registers it, next to the code that reads the
    section."""

    def add(fn: SectionCheck) -> SectionCheck:
        _SECTION_CHECKS.append((cls, fn))
        return fn

    return add


def component_checks(section: Any, path: str) -> None:
    """Run the checks components registered for ``section`` (at dotted ``path``), in the order they registered."""
    for cls, fn in list(_SECTION_CHECKS):
        if isinstance(section, cls):
            fn(section, path)


def load_choice_tables(cls: type) -> None:
    """Import the registry of every choice field of config class ``cls`` (nested sections too, in field order). A
    component registers its section checks when imported, so validating a run config after this meets them all."""
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            load_choice_tables(tp)
        elif "registry" in f.metadata:
            registry_table(f.metadata["registry"])


def check_section(section: Any, path: str) -> Any:
    """Check a config section at dotted ``path`` (e.g. ``'rollout.vllm'``; ``''`` for a run config's own fields):
    its sub-sections first, then its choice fields, then its own ``validate(path)`` if it has one, then the checks
    its components registered (:func:`section_check`; a run config's own ``validate`` runs those of the run config).
    This is the one place a section is checked, whether it came from a file or a component was built from it
    directly. Returns ``section``."""
    prefix = f"{path}." if path else ""
    for f in dataclasses.fields(section):
        sub = getattr(section, f.name)
        if dataclasses.is_dataclass(sub):
            check_section(sub, f"{prefix}{f.name}")
    _check_choice_fields(section, prefix)
    if path:
        if hasattr(section, "validate"):
            section.validate(path)
        component_checks(section, path)
    return section


def check_finite(node: Any, path: str) -> None:
    """Every float in the config (nested sections and lists too) is finite: one NaN or inf in a weight, a rate or
    a clip range would turn every parameter into NaN a few steps later."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            check_finite(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            check_finite(v, f"{path}[{i}]")
    elif isinstance(node, float):
        check(math.isfinite(node), path, f"must be a finite number, got {node}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Coerce a YAML/CLI value to the annotated type, or raise naming the field."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:  # the value's type here; membership in validate(), with registry fields
        if isinstance(value, bool) and str(value).lower() in args:  # YAML's true / false for a 'true' / 'false' choice
            return str(value).lower()
        return _coerce(value, type(args[0]), path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if origin is list:
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            fail(path, f"expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        fail(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            fail(path, f"expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            fail(path, f"expected an integer, got {value!r}")
        if not f.is_integer():
            fail(path, f"expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            fail(path, f"expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            fail(path, f"expected a number, got {value!r}")
    if tp is str:
        if value is None:  # YAML's null (also '~'): str(None) would be the text 'None'
            fail(path, "expected a string, got null (YAML reads ~ and null as no value; quote them for text)")
        if isinstance(value, (dict, list)):
            fail(path, f"expected a string, got {value!r}")
        return str(value)
    return value


def _closest(key: str, options: list[Any]) -> str:
    match = difflib.get_close_matches(key, [o for o in options if isinstance(o, str)], n=1, cutoff=0.0)
    return f"; did you mean {match[0]!r}?" if match else ""


def _closest_key(key: str, root: type) -> str:
    """The hint for an unknown dotted ``key`` of run config class ``root``: the valid keys it is the tail of
    ('lora.rank' -> 'model.lora.rank'), also with another trainer's name for its last part replaced by ours
    (``root.KEY_ALIASES``: 'optim.learning_rate' -> 'optim.lr', 'r' -> 'model.lora.rank'); else the closest
    spelling."""
    keys = _all_keys(root)
    *head, leaf = key.split(".")
    ours = getattr(root, "KEY_ALIASES", {}).get(leaf, leaf)
    # then a part of the key that is a key's last name ('compile.enable' -> 'parallel.compile'), nearest the end first
    for tail in (key, ".".join([*head, ours]), ours, *reversed(head)):
        found = [k for k in keys if k == tail or k.endswith("." + tail)]
        if len(found) == 1:
            return f"; did you mean {found[0]!r}?"
        if found:
            return f"; did you mean one of {', '.join(map(repr, found))}?"
    return _closest(key, keys)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _build(cls: type, data: dict, path: str, root: type) -> Any:
    if not isinstance(data, dict):
        fail(path or "config", f"expected a mapping, got {data!r}")
    types = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            while isinstance(value, dict) and value:  # 'lora: {rank: 8}' is reported as 'lora.rank'
                sub, value = next(iter(value.items()))
                full = f"{full}.{sub}"
            raise ConfigError(f"unknown config key {full!r}{_closest_key(full, root)}")
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, full, root)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a section")
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: the last one would win
    without a word. A merge (``<<: *base``) may still override the keys it brings in."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, (list, dict)) and key in lines:
                    raise ConfigError(f"key {key!r} is given twice in one section (lines {lines[key]} and {line}); "
                                      "keep one")
                if not isinstance(key, (list, dict)):
                    lines[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(p: Path) -> Any:
    try:
        return yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...], *, cls: type) -> Any:
    """Read a YAML file (optional), apply ``key=value`` overrides, build and validate a run config ``cls`` (its
    ``validate()`` runs the checks). A value nested deeper than Python's recursion limit is a ConfigError naming
    the file or the override that holds it."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} {not_a_file(p)}")
        with too_deep(f"config file {str(p)!r}", _CONFIG_DEPTH):
            tree = _read_yaml(p) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        with too_deep(f"override {key.strip()!r}", _CONFIG_DEPTH):
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError:
                raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
            _set_dotted(tree, key.strip(), value)
    with too_deep("the config", _CONFIG_DEPTH):
        return _build(cls, tree, "", cls).validate()


@contextlib.contextmanager
def too_deep(where: str, advice: str, error: type[Exception] = ConfigError) -> Iterator[None]:
    """A RecursionError inside becomes one line: ``error`` naming ``where``, then ``advice``."""
    try:
        yield
    except RecursionError:
        raise error(f"{where}: a value is nested too deeply to read (deeper than Python's recursion limit); "
                    f"{advice}") from None


_CONFIG_DEPTH = "a config holds a few levels of sections and plain values"


def not_a_file(path: Path) -> str:
    """Why ``path``, which is not a regular file, cannot be read as one: 'does not exist', 'is a folder', 'is a FIFO
    (named pipe), not a regular file', ..."""
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a folder, not a file"
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    mode = path.stat().st_mode
    return f"is {next((what for test, what in kinds if test(mode)), 'a special file')}, not a regular file"


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def describe(cls: type) -> str:
    """Every key of the run config ``cls`` with its default and docstring (for --help-config)."""
    lines = []

    def walk(cls: type, prefix: str) -> None:
        docs: dict[str, str] = {}
        for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # a subclass's docs win
            body = ast.parse(inspect.getsource(klass)).body[0].body
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    docs[a.target.id] = str(b.value.value)
        for f in dataclasses.fields(cls):
            tp = _field_types(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                line = f"{prefix}{f.name} = {default!r}\n    {docs.get(f.name, '')}"
                names = choices(cls, f.name)
                if names is not None:
                    line += f"\n    choices: {', '.join(map(str, names))}"
                lines.append(line)

    walk(cls, "")
    return "\n".join(lines)
