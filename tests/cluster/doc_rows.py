"""Tables in tracked docs that cluster test runs write (docs/fault-matrix.md,
docs/spares-results.md), one row per test, keyed by the test's name (issue 54).

A test's row goes into the file when the test ends, passed or failed: a failed test's row says
FAILED and the first line of why, with the cells it had set before it failed (or its previous
row's, or its docstring's first line), so a failing scenario shows instead of vanishing. Rows of
tests that did not run this time (`-k`, a skip) are kept as they were, each with its own date, so a
partial run never shrinks the table; only rows of tests the module no longer has are dropped.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

import pytest

from dslurm.durable import atomic_write_text

REPORT = pytest.StashKey[dict[str, pytest.TestReport]]()
"""each phase's report of a test (tests/cluster/conftest.py keeps them)"""
_ROW = re.compile(r"^\| `(?P<test>[^`]+)` \|")


def current_test() -> str:
    """The running test's name (`test_x[param]`), from pytest's own variable."""
    return os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0]


def failure_of(item: pytest.Item) -> str | None:
    """None when the test passed (or was skipped); else the first line of why it failed."""
    reports = item.stash.get(REPORT, {})
    for when in ("setup", "call", "teardown"):
        rep = reports.get(when)
        if rep is not None and rep.failed:
            text = str(getattr(rep.longrepr, "reprcrash", None) and rep.longrepr.reprcrash.message  # type: ignore
                       or rep.longrepr or "").strip()
            first = next((ln for ln in text.splitlines() if ln.strip()), "no message")
            return f"{when}: {first[:160]}".replace("|", "/")
    return None


def skipped(item: pytest.Item) -> bool:
    reports = item.stash.get(REPORT, {})
    return any(r.skipped for r in reports.values())


class DocTable:
    """One tracked table: `set(cells)` while a test runs (once per row it writes), `done(item)`
    when it ends."""

    def __init__(self, path: Path, title: str, intro: str, columns: list[str], module: object) -> None:
        self.path, self.title, self.intro, self.columns, self.module = path, title, intro, columns, module
        self.cells: dict[str, list[list[str]]] = {}

    @property
    def tests(self) -> set[str]:
        """The module's test functions (read when a test ends: at import they are not defined yet)."""
        return {n for n in dir(self.module) if n.startswith("test_")}

    def set(self, cells: list[str], test: str | None = None) -> None:
        assert len(cells) == len(self.columns), (cells, self.columns)
        row = [str(c).replace("|", "/").replace("\n", " ") for c in cells]
        self.cells.setdefault(test or current_test(), []).append(row)

    def rows(self) -> dict[str, list[str]]:
        """The rows the file holds now, by test; those of tests the module no longer has dropped."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return {}
        out: dict[str, list[str]] = {}
        tests = self.tests
        for line in lines:
            m = _ROW.match(line)
            if m and m["test"].split("[")[0] in tests:
                out.setdefault(m["test"], []).append(line)
        return out

    def done(self, item: pytest.Item) -> None:
        """The test's rows into the file (merged), unless it was skipped."""
        if skipped(item):
            return
        test, why = item.name, failure_of(item)
        rows = self.rows()
        cells = self.cells.pop(test, None) or [c for c in map(self._old_cells, rows.get(test, [])) if c] or [
            [(item.obj.__doc__ or test).strip().splitlines()[0], *[""] * (len(self.columns) - 1)]]  # type: ignore
        result = "passed" if why is None else f"**FAILED** ({why})"
        when = (f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}, "
                f"{os.cpu_count()} cores")
        rows[test] = ["| " + " | ".join([f"`{test}`", result, *c, when]) + " |" for c in cells]
        order = sorted(rows, key=lambda t: (_position(item, t), t))
        head = [f"# {self.title} (written by the test run)", "", self.intro, "",
                "Each row is written by its test when it ends, passed or failed (a failure says FAILED and "
                "why); a run of some of the tests (`-k`) replaces only their rows, so rows may come from "
                "different runs: each says when it ran.", "",
                "| test | result | " + " | ".join(self.columns) + " | run |",
                "|" + "---|" * (len(self.columns) + 3)]
        atomic_write_text(self.path, "\n".join(head + [r for t in order for r in rows[t]]) + "\n")

    def _old_cells(self, line: str) -> list[str] | None:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        return cells[2:-1] if len(cells) == len(self.columns) + 3 else None


def _position(item: pytest.Item, test: str) -> int:
    """Where the test is defined in its module (the table follows the file's order)."""
    fn = getattr(item.module, test.split("[")[0], None)  # type: ignore[attr-defined]
    code = getattr(fn, "__code__", None)
    return code.co_firstlineno if code is not None else 1 << 30
