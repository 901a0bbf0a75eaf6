"""The tables cluster tests write into tracked docs (tests/cluster/doc_rows.py, issue 54): a
failing test's row says FAILED instead of vanishing, and a `-k` run replaces only its own rows.
Runs pytest on a two-test module in subprocesses (no cluster; a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
CLUSTER = Path(__file__).resolve().parents[1] / "cluster"

CONFTEST = '''
import pytest
from doc_rows import REPORT


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    item.stash.setdefault(REPORT, {})[rep.when] = rep
    return rep
'''

MODULE = '''
import sys
from pathlib import Path

import pytest
from doc_rows import DocTable

TABLE = DocTable(Path(__file__).parent / "table.md", "Demo", "Intro.", ["scenario", "observed"], sys.modules[__name__])


@pytest.fixture(autouse=True)
def _row(request):
    yield
    TABLE.done(request.node)


def test_holds():
    TABLE.set(["a promise kept", "seen"])


def test_breaks():
    """A promise broken."""
    assert 1 + 1 == 3, "the sum was wrong"
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CLUSTER), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(folder), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_failed_scenario_shows_and_a_partial_run_keeps_the_other_rows(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_demo.py").write_text(MODULE)
    table = tmp_path / "table.md"
    first = _pytest(tmp_path)
    assert first.returncode == 1, first.stdout[-2000:]
    rows = [ln for ln in table.read_text().splitlines() if ln.startswith("| `")]
    assert len(rows) == 2, table.read_text()
    holds, breaks = (next(r for r in rows if f"`{n}`" in r) for n in ("test_holds", "test_breaks"))
    assert "| passed | a promise kept | seen |" in holds
    assert "**FAILED** (call: AssertionError: the sum was wrong" in breaks and "A promise broken." in breaks
    assert rows.index(holds) < rows.index(breaks)  # the file's order
    again = _pytest(tmp_path, "-k", "holds")
    assert again.returncode == 0, again.stdout[-2000:]
    after = [ln for ln in table.read_text().splitlines() if ln.startswith("| `")]
    assert len(after) == 2 and breaks in after, table.read_text()  # not shrunk, the failure still shown
    (tmp_path / "test_demo.py").write_text(MODULE.replace("def test_breaks", "def _gone"))
    _pytest(tmp_path)
    assert [ln for ln in table.read_text().splitlines() if ln.startswith("| `")][0].startswith("| `test_holds`")
    assert "test_breaks" not in table.read_text()  # a test the module no longer has loses its row
