"""Every script under bench/ is run by the suite in its tiny mode (testkit.TINY_BENCHES, issue 40),
and each Python bench documents the command it runs with. Pure, but for bench/gpu_check.sh's
usage error (bash, milliseconds)."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

from testkit import TINY_BENCHES

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_has_a_tiny_run_in_the_suite():
    assert {p.name for p in BENCH.glob("*.py")} == set(TINY_BENCHES)


def test_every_bench_docstring_names_its_command_and_every_flag_of_its_tiny_run_exists():
    for name, (args, _, _) in TINY_BENCHES.items():
        src = (BENCH / name).read_text()
        doc = ast.get_docstring(ast.parse(src)) or ""
        assert f"bench/{name}" in doc, f"{name}: the docstring does not say how to run it"
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in src, f"{name}: no {flag} option"


def test_every_tiny_run_expects_a_line_its_bench_prints():
    """An empty expected line is in every output (a check that cannot fail): each tiny run
    names a piece of its figure line (tests/integration/test_benches.py looks for it)."""
    for name, (_, expect, _) in TINY_BENCHES.items():
        assert len(expect.strip()) >= 5, f"{name}: expects {expect!r}: the tiny run checks nothing"


def test_gpu_check_names_its_usage_and_what_the_python_lacks(tmp_path):
    usage = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: bash bench/gpu_check.sh OUT.json" in usage.stderr
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho torch pyyaml\n")
    fake.chmod(0o755)
    lacks = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), str(tmp_path / "out.json")], capture_output=True,
                           text=True, env={**os.environ, "PYTHON": str(fake)})
    assert lacks.returncode == 2 and "lacks: torch pyyaml" in lacks.stderr
