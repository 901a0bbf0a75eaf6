"""pytest imports test modules by basename (rootdir-relative, no packages): two test files
with one name in different layers stop the whole collection. Caught here, in the unit layer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_unique_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
