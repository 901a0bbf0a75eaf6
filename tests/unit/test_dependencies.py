"""Runtime dependencies are ranges from a tested lower bound (issue 34 item 5): a site's own
transformers or datasets can pick its tokenizers/pyarrow beside dslurm; the exact versions live in
the test path only, and the lower bounds are the versions scripts/test-lower-bounds.sh tests. Pure."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def test_runtime_dependencies_are_ranges_and_the_test_path_pins():
    deps = PROJECT["dependencies"]
    assert [d for d in deps if "==" in d] == [], deps  # no exact pin a site environment must match
    assert all(">=" in d for d in deps), deps  # every range has its lower bound
    test = {_name(d): d for d in PROJECT["optional-dependencies"]["test"]}
    for name in ("tokenizers", "pyarrow"):
        assert "==" in test[name], test[name]  # the suite runs one exact version


def test_the_lower_bounds_are_the_versions_tested():
    script = (ROOT / "scripts" / "test-lower-bounds.sh").read_text()
    tested = dict(re.findall(r'"([a-z]+)==([0-9.]+)"', script))
    for dep in PROJECT["dependencies"]:
        name = _name(dep)
        if name in tested:
            low = re.search(r">=([0-9.]+)", dep)
            assert low is not None
            want = tested[name].split(".")
            assert want[:len(low.group(1).split("."))] == low.group(1).split("."), (dep, tested[name])
    assert set(tested) == {"tokenizers", "pyarrow"}
