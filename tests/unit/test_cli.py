"""The CLI as a user meets it: instant (no torch), errors without tracebacks, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def test_cli_import_does_not_import_torch():
    code = "import sys, dslurm, dslurm.cli; dslurm.cli.build_parser(); print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_render_prints_script(cli):
    res = cli("render", "--site", "site-configs/h100-ib.yaml", "--job", "examples/jobs/llama8b-h100.yaml")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("#!/bin/bash") and "#SBATCH --exclusive" in res.stdout


def test_render_writes_file(cli, tmp_path):
    out = tmp_path / "x.sbatch"
    res = cli("render", "--site", "site-configs/local.yaml", "--job", "examples/jobs/tiny-2node.yaml",
              "-o", str(out))
    assert res.returncode == 0 and out.read_text().startswith("#!/bin/bash")
    assert out.stat().st_mode & 0o111


def _bad(tmp_path, data):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_bad_configs_exit_2_with_one_paragraph(cli, tmp_path):
    cases = [
        ({"name": "j", "nodes": 2, "nodez": 1}, "unknown key(s) 'nodez'"),
        ({"name": "j", "nodes": "two"}, "field 'nodes': expected an integer"),
        ({"name": "j", "nodes": 2, "parallel": {"dp_shard": 3}}, "=3 != world_size(4)"),
        ({"name": "x$(touch /tmp/owned)", "nodes": 1}, "may only hold letters"),
    ]
    for data, expect in cases:
        path = _bad(tmp_path, data)
        res = cli("render", "--site", "site-configs/local.yaml", "--job", path)
        assert res.returncode == 2, (data, res.stderr)
        assert expect in res.stderr and path in res.stderr and "Fix:" in res.stderr
        assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1
        assert res.stdout == ""


def test_set_override_errors(cli):
    res = cli("render", "--site", "site-configs/local.yaml", "--job", "examples/jobs/tiny-2node.yaml",
              "--set", "train.steps=lots")
    assert res.returncode == 2 and "train.steps" in res.stderr and "Traceback" not in res.stderr


def test_readme_says_how_dslurm_gets_on_path():
    """The README uses `dslurm ...`; after scripts/setup.sh the command lives in .venv/bin only."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    using = readme[readme.index("## Using it"):]
    first_use = using.index("dslurm render")
    assert "source .venv/bin/activate" in using[:first_use] and ".venv/bin/dslurm" in using[:first_use]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["dslurm"] == "dslurm.cli:main"  # what pip puts in .venv/bin/dslurm
    setup = (root / "scripts" / "setup.sh").read_text()
    assert "-m venv .venv" in setup and "pip install -q -e" in setup


def test_every_option_of_every_command_says_what_it_does():
    """Issue 54: `submit --set/--site-set` and `status --json` had no help text, and `selftest
    chaos` was in no help. Every option has one (or is hidden on purpose)."""
    import argparse

    from dslurm.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, child in a.choices.items():
                    walk(child, [*path, name])
            elif a.option_strings and a.help is None:
                missing.append(f"dslurm {' '.join(path)} {'/'.join(a.option_strings)}")

    walk(build_parser([]), [])
    assert not missing, missing
    top = build_parser([]).format_help()
    assert "chaos" in top and "selftest" in top
