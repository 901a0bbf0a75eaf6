"""`dslurm burnin`: parser, torchrun command, exit codes from the report (torchrun mocked)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dslurm.errors import UserError
from dslurm.preflight import EXIT_BAD_NODES, EXIT_NO_REPORT, EXIT_OK, cli
from dslurm.preflight.gate import SCHEMA, write_report


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["burnin", *argv])


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, dslurm.preflight.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_burnin_registered_with_run_as_func():
    args = parse("--local", "--nproc", "4", "--site", "s.yaml")
    assert args.func is cli.run and args.nproc == 4
    cmd = cli.torchrun_command(args)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--exit-zero" in cmd
    assert cmd[cmd.index("--site") + 1] == "s.yaml" and "--thresholds" not in cmd


def test_without_local_is_a_user_error():
    with pytest.raises(UserError, match="--local"):
        cli.run(parse())


def fake_torchrun(mocker, verdict_bad: dict | None):
    """Replace torchrun: write a report with the given bad nodes (None: write nothing)."""
    def run(cmd, env):
        if verdict_bad is not None:
            path = cmd[cmd.index("--report") + 1]
            write_report(path, {"schema": SCHEMA, "verdict": {
                "ok": not verdict_bad, "bad_nodes": verdict_bad, "warnings": {}, "problems": []}})
        return subprocess.CompletedProcess(cmd, 1 if verdict_bad is None else 0)
    return mocker.patch("subprocess.run", side_effect=run)


def test_exit_code_comes_from_the_report(mocker, tmp_path):
    rep = tmp_path / "r.json"
    fake_torchrun(mocker, {})
    assert cli.run(parse("--local", "--report", str(rep))) == EXIT_OK
    fake = fake_torchrun(mocker, {"n3": ["hot"]})
    assert cli.run(parse("--local", "--report", str(rep), "--pseudo-nodes", "3")) == EXIT_BAD_NODES
    assert fake.call_args.kwargs["env"]["DSLURM_PSEUDO_NODES"] == "3"


def test_stale_report_is_not_mistaken_for_this_run(mocker, tmp_path):
    rep = tmp_path / "r.json"
    write_report(rep, {"schema": SCHEMA, "verdict": {"ok": True, "bad_nodes": {},
                                                     "warnings": {}, "problems": []}})
    fake_torchrun(mocker, None)  # the runner crashes before writing
    assert cli.run(parse("--local", "--report", str(rep))) == EXIT_NO_REPORT
