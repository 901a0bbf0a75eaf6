"""Turn plain YAML data into a tree of dataclasses, or say exactly what is wrong.

Every error names the file, the dotted field, the value and the fix, because the
person reading it is an ML engineer at a login node, not a Python debugger.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from dslurm.errors import UserError

T = TypeVar("T")


def field(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None) -> Any:
    """A dataclass field with its help text kept for error messages and docs."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping of names to strings"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None)) + " (or null)"
    return str(tp)


class _Where:
    """The place in the input an error talks about."""

    def __init__(self, source: str, path: str = "") -> None:
        self.source, self.path = source, path

    def child(self, name: str) -> _Where:
        return _Where(self.source, f"{self.path}.{name}" if self.path else name)

    def fail(self, what: str, fix: str) -> UserError:
        where = f"field '{self.path}'" if self.path else "top level"
        return UserError(f"{self.source}: {where}: {what}. Fix: {fix}")


def _convert(tp: Any, value: Any, where: _Where) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and type(None) in get_args(tp):
            return None
        for arg in args:  # first alternative that accepts the value wins
            try:
                return _convert(arg, value, where)
            except UserError:
                continue
        raise where.fail(f"expected {_type_name(tp)}, got {value!r}", f"set it to {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)  # type: ignore[arg-type]
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise where.fail(f"{value!r} is not allowed", f"use {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise where.fail(f"expected {_type_name(tp)}, got {value!r}", "write a YAML list")
        return [_convert(get_args(tp)[0], v, where.child(str(i))) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise where.fail(f"expected {_type_name(tp)}, got {value!r}", "write a YAML mapping")
        out = {}
        for k, v in value.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool):
                raise where.child(str(k)).fail(f"expected a string, got {v!r}", "quote the value")
            out[str(k)] = str(v)
        return out
    # bool is an int in Python; refuse it where a number is meant, and vice versa.
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise where.fail(f"expected {_type_name(tp)}, got {value!r}", f"set it to {_type_name(tp)}")


def build(cls: type[T], data: Any, where: _Where | str) -> T:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
    if isinstance(where, str):
        where = _Where(where)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise where.fail(f"expected a mapping, got {data!r}", "write `key: value` lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise where.fail(
            f"unknown key(s) {', '.join(repr(k) for k in unknown)}",
            f"valid keys here are: {', '.join(fields)}",
        )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], where.child(name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise where.child(name).fail("is required", f"add `{name}:` ({f.metadata.get('help', '')})")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # __post_init__ checks carry the field and numbers
        raise where.fail(str(exc), "see the value named above") from None


def load_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(f"{p}: file not found. Fix: pass the path of an existing YAML file") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{p}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: top level must be a mapping of keys to values, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to nested data."""
    import yaml

    out = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"{source} {item!r}: expected KEY=VALUE, e.g. train.steps=200")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"{source} {item!r}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain data (YAML/JSON-ready)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
