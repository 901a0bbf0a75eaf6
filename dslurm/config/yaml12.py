"""YAML read with the YAML 1.2 core schema's scalar rules, and keys that appear twice refused.

PyYAML implements YAML 1.1, whose implicit typing surprises people who write configs:
`time: 12:00:00` is the base-60 integer 43200, `lr: 3e-4` is a string (1.1 floats need a
dot), `yes`/`no`/`on`/`off` are booleans, `017` is octal and `2024-01-01` is a date. The
1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution) fixes all of these; we
apply its rules to PyYAML's SafeLoader rather than add a dependency. A mapping that names
the same key twice keeps only the last one in YAML 1.1 and in PyYAML; here it is an error
with both line numbers, because a second `model:` block silently replacing the first is
never what someone meant.

`dump` writes YAML that both this loader and a YAML 1.1 reader read back to the same
values: a string either schema would take for something else is quoted.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

_NULL = "tag:yaml.org,2002:null"
_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"

# (tag, pattern, first characters) of the 1.2 core schema, in resolution order.
_CORE: list[tuple[str, re.Pattern[str], list[str]]] = [
    (_NULL, re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]),
    (_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")),
    (_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")),
    (_FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                        r"|[-+]?\.(?:inf|Inf|INF)|\.nan|\.NaN|\.NAN)$"), list("-+.0123456789")),
    (_MERGE, re.compile(r"^(?:<<)$"), ["<"]),  # anchors + `<<: *base` keep working
]


class Int(int):
    """An integer that remembers how it was written: a field that wants text (an env value,
    `time: 90`, a name) gets `007` or `0x1f` back, not `7` or `31`."""

    text: str


class Float(float):
    """A float that remembers how it was written (`NCCL_X: 1e3` stays "1e3", not "1000.0")."""

    text: str


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping names the same key twice; carries the key and both (1-based) lines."""

    def __init__(self, key: Any, first_line: int, second_line: int, mark: Any) -> None:
        self.key, self.first_line, self.second_line = key, first_line, second_line
        super().__init__(None, None, f"key {key!r} appears twice ({self.lines})", mark)

    @property
    def lines(self) -> str:
        if self.first_line == self.second_line:
            return f"both on line {self.first_line}"
        return f"lines {self.first_line} and {self.second_line}"


class Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's implicit types and no duplicate keys."""

    yaml_implicit_resolvers: dict[str, Any] = {}  # a fresh table: SafeLoader's is YAML 1.1's

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:  # `<<: *base` keys may be repeated by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line, key_node.start_mark)
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                continue
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node))
        try:
            if text.startswith("0o"):
                out = Int(text[2:], 8)
            elif text.startswith("0x"):
                out = Int(text[2:], 16)
            else:
                out = Int(text, 10)  # 1.2: a leading 0 is not octal, `1:30` is not base 60
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer",
                                                    node.start_mark) from None
        out.text = text
        return out

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        text = str(self.construct_scalar(node))
        special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
        try:
            out = Float(special.get(text.lower(), text))
        except ValueError:
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a number",
                                                    node.start_mark) from None
        out.text = text
        return out


for _tag, _pattern, _first in _CORE:
    Loader.add_implicit_resolver(_tag, _pattern, _first)
Loader.add_constructor(_INT, Loader.construct_yaml_int)
Loader.add_constructor(_FLOAT, Loader.construct_yaml_float)


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes every string the 1.1 *or* the 1.2 rules would read as another
    type (`'1e3'`, `'12:00:00'`, `'yes'`), so frozen configs read back unchanged by both."""

    yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}


for _tag, _pattern, _first in _CORE:
    Dumper.add_implicit_resolver(_tag, _pattern, _first)
Dumper.add_representer(Int, yaml.SafeDumper.represent_int)
Dumper.add_representer(Float, yaml.SafeDumper.represent_float)


def load(text: str) -> Any:
    """Parse one YAML document with the rules above. Raises yaml.YAMLError (including
    DuplicateKeyError)."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader


def dump(data: Any) -> str:
    return str(yaml.dump(data, Dumper=Dumper, sort_keys=False))
