"""Turn plain YAML data into a tree of dataclasses, or say exactly what is wrong.

Every error names the file, the dotted field, the value and the fix, because the
person reading it is an ML engineer at a login node, not a Python debugger.
"""

from __future__ import annotations

import dataclasses
import math
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


class FieldError(ValueError):
    """A config class's own check (`__post_init__`) failed: the field(s) it is about (names
    relative to the class), what is wrong with the numbers, and the fix. `build` turns it
    into a UserError that names the file or the override and the dotted field(s)."""

    def __init__(self, fields: str | tuple[str, ...], what: str, fix: str) -> None:
        super().__init__(what)
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)
        self.what, self.fix = what, fix


class Where:
    """The place in the input an error talks about: the file (or "job"/"site" for data
    given in code), the dotted field, and which fields a `--set`/`--site-set` override set
    (`origins`: dotted path -> the override as typed), so that an error caused by an
    override names the override instead of a file that never contained the value."""

    def __init__(self, source: str, path: str = "", origins: dict[str, str] | None = None) -> None:
        self.source, self.path, self.origins = source, path, origins or {}

    def child(self, name: str) -> Where:
        return Where(self.source, f"{self.path}.{name}" if self.path else name, self.origins)

    def origin(self, *paths: str) -> str:
        """What the user typed that the field(s) came from: the override that set a field
        (or a section above it), else the file, "with" any overrides that set parts of it."""
        paths = paths or (self.path,)
        exact, inside = [], []
        for path in paths:
            above = [p for p in self.origins if path == p or path.startswith(p + ".")]
            if above:  # the deepest override that covers the field is the one that set it
                exact.append(self.origins[max(above, key=len)])
            else:
                inside += [o for p, o in self.origins.items() if not path or p.startswith(path + ".")]
        named = list(dict.fromkeys(exact + inside))
        if len(paths) == 1 and exact:
            return exact[0]
        return f"{self.source} with {', '.join(named)}" if named else self.source

    def label(self) -> str:
        """`ORIGIN: field 'a.b'` for messages built elsewhere (parse_time's `where`)."""
        return f"{self.origin()}: field '{self.path}'" if self.path else self.origin()

    def fail(self, what: str, fix: str) -> UserError:
        where = f"field '{self.path}'" if self.path else "top level"
        return UserError(f"{self.origin()}: {where}: {what}. Fix: {fix}")

    def fail_fields(self, names: tuple[str, ...], what: str, fix: str) -> UserError:
        """An error about one or more fields of this section (a class's own cross-field check)."""
        if len(names) == 1:
            return self.child(names[0]).fail(what, fix)
        paths = tuple(self.child(n).path for n in names)
        fields = ", ".join(f"'{p}'" for p in paths)
        return UserError(f"{self.origin(*paths)}: fields {fields}: {what}. Fix: {fix}")


def _whole_number(value: float, where: Where) -> int:
    """`1e3` where an integer is meant: fine when it is a whole number a float holds exactly."""
    if math.isfinite(value) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if not math.isfinite(value):
        raise where.fail(f"expected an integer, got {value!r}", "set it to a whole number")
    if value.is_integer():
        raise where.fail(f"expected an integer, got {value!r}, too large to hold exactly as written",
                         "write the integer out in digits")
    lo, hi = math.floor(value), math.ceil(value)
    raise where.fail(f"expected an integer, got {value!r}, which is not a whole number",
                     f"write a whole number, e.g. {lo} or {hi}")


def as_text(value: Any) -> str:
    """A number where text is wanted, as the user wrote it (yaml12.Int/Float keep `.text`:
    `NCCL_X: 1e3` stays "1e3", not "1000.0"), else str()."""
    return getattr(value, "text", None) or str(value)


_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def _convert(tp: Any, value: Any, where: Where) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None and type(None) in get_args(tp):
            return None
        if len(args) == 1:  # `int | None`: the one type's own message says more
            return _convert(args[0], value, where)
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
            out[str(k)] = as_text(v)
        return out
    # bool is an int in Python; refuse it where a number is meant, and vice versa.
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _YAML11_BOOLS:
            raise where.fail(f"expected true or false, got {value!r} (YAML 1.2 reads yes/no/on/off as text)",
                             "write true or false")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)  # a plain int, not the loader's yaml12.Int
        if isinstance(value, float):
            return _whole_number(value, where)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise where.fail(f"expected a finite number, got {value!r}", "set it to a number such as 3e-4")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return as_text(value)  # `time: 90`, `name: 007`: the text as written
    raise where.fail(f"expected {_type_name(tp)}, got {value!r}", f"set it to {_type_name(tp)}")


def build(cls: type[T], data: Any, where: Where | str, origins: dict[str, str] | None = None) -> T:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types. `origins`:
    which dotted fields `--set`-style overrides set (see `apply_overrides`)."""
    if isinstance(where, str):
        where = Where(where, origins=origins)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise where.fail(f"expected a mapping, got {data!r}", "write `key: value` lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        typed = where.origin(*(where.child(k).path for k in unknown))
        here = f"field '{where.path}'" if where.path else "top level"
        raise UserError(f"{typed}: {here}: unknown key(s) {', '.join(repr(k) for k in unknown)}. "
                        f"Fix: valid keys here are: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], where.child(name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise where.child(name).fail("is required", f"add `{name}:` ({f.metadata.get('help', '')})")
    try:
        return cls(**kwargs)
    except FieldError as exc:  # __post_init__ checks name their field(s), the numbers and the fix
        raise where.fail_fields(exc.fields, exc.what, exc.fix) from None
    except ValueError as exc:  # a check not (yet) written as a FieldError: still no traceback
        raise where.fail(str(exc), "change the value this message names") from None


def utf8_text(path: Path, raw: bytes) -> str:
    """A config file's bytes as text: UTF-8 (YAML's own encoding), else a UserError naming the
    line and the byte (a Latin-1 `é` in a comment is enough), or saying it is not text at all."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        if b"\0" in raw:
            raise UserError(f"{path}: not a text file (binary bytes, e.g. 0x{raw[exc.start]:02x} at line {line}); "
                            "Fix: pass the YAML config file itself") from None
        raise UserError(f"{path}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column {column} "
                        "(Latin-1 or another legacy encoding?). Fix: save the file as UTF-8, e.g. "
                        f"`iconv -f latin1 -t utf-8 {path} > fixed.yaml`") from None
    if "\0" in text:
        raise UserError(f"{path}: not a text file (it holds NUL bytes). Fix: pass the YAML config file itself")
    return text


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file as plain data, read with YAML 1.2 rules (see `yaml12`)."""
    import yaml

    from dslurm.config import yaml12

    p = Path(path)
    try:
        text = utf8_text(p, p.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{p}: file not found. Fix: pass the path of an existing YAML file") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        data = yaml12.load(text)
    except yaml12.DuplicateKeyError as exc:
        raise UserError(f"{p}: key {exc.key!r} appears twice ({exc.lines}); YAML would keep only the last. "
                        "Fix: keep one of them (merge the two blocks)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{p}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: top level must be a mapping of keys to values, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str],
                    flag: str = "--set") -> tuple[dict[str, Any], dict[str, str]]:
    """Apply `a.b.c=value` overrides (values read as YAML 1.2 scalars or flow collections) to
    nested data. Returns the new data and which dotted paths the overrides set, each mapped
    to the override as typed (`--set parallel.tp=abc`), for `build`'s error messages."""
    import yaml

    from dslurm.config import yaml12

    out = _deepcopy(data)
    origins: dict[str, str] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        typed = f"{flag} {item}"
        if not sep or not key.strip():
            raise UserError(f"{typed}: expected KEY=VALUE, e.g. train.steps=200")
        try:
            value = yaml12.load(raw) if raw.strip() else ""
        except yaml12.DuplicateKeyError as exc:
            raise UserError(f"{typed}: key {exc.key!r} appears twice. Fix: give it once") from None
        except yaml.YAMLError:
            value = raw  # not YAML (e.g. `a: b` inside): the text itself
        node = out
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UserError(f"{typed}: '{'.'.join(parts[:i + 1])}' is a value, not a section. "
                                f"Fix: set '{'.'.join(parts[:i + 1])}' itself")
            node = child
        node[parts[-1]] = value
        path = ".".join(parts)
        for p in [p for p in origins if p == path or p.startswith(path + ".")]:
            del origins[p]  # replaced by this override
        origins[path] = typed
    return out, origins


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
