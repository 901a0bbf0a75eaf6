"""Mistakes a new user makes, through the real CLI entry: each one is exit 2 with the file or flag,
the field, the value and the fix, never a traceback (issue 54)."""

from __future__ import annotations

import argparse

import pytest

from dslurm.cli import build_parser, main
from testkit import ROOT

SITE, JOB = str(ROOT / "site-configs/local.yaml"), str(ROOT / "examples/jobs/tiny-2node.yaml")


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run `dslurm ARGV`: it must exit 2 (an exception would fail the test: no traceback) and
    its stderr must hold every needle."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize(("flag", "name", "why"), [
    ("--set", "SLURM_JOB_ID", "requeue another job"), ("--set", "DSLURM_RUN_DIR", "dslurm's"),
    ("--site-set", "SLURM_NODELIST", "Slurm sets"), ("--set", "MASTER_PORT", "the launcher sets it"),
    ("--set", "RANK", "the launcher sets it"), ("--set", "TORCHELASTIC_RUN_ID", "torchrun's"),
])
def test_reserved_environment_variables_are_refused_naming_them(capsys, flag, name, why):
    refused(capsys, ["render", "--site", SITE, "--job", JOB, flag, f"env.{name}=1"],
            f"{flag} env.{name}=1", f"env.{name}", why, "Fix: remove")


def test_dslurm_inputs_pass_and_path_and_devices_are_warned(capsys):
    assert main(["render", "--site", SITE, "--job", JOB, "--set", "env.DSLURM_FAULT_CRASH=3@0",
                 "--set", "env.PATH=/opt/x", "--set", "env.CUDA_VISIBLE_DEVICES=0"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "field 'env': PATH" in err and "field 'env': CUDA_VISIBLE_DEVICES" in err
    assert main(["render", "--site", SITE, "--job", JOB]) == 0
    assert "warning" not in capsys.readouterr().err


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_accepts_abbreviations(capsys):
    every = list(_parsers(build_parser([])))
    assert len(every) > 30 and all(not p.allow_abbrev for p in every), \
        [p.prog for p in every if p.allow_abbrev]
    refused(capsys, ["render", "--sit", SITE, "--jo", JOB], "unrecognized arguments: --sit")
