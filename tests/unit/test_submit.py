"""submit without Slurm: what lands in the run directory (dry run); a run submitted again
(--run-dir, a completed run) with a fake sbatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.submission import submit
from testkit import GEN, one_start_ended

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_freezes_config_and_renders_absolute_paths(tmp_path):
    r = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
             overrides=[f"checkpoint.run_dir={tmp_path / 'run'}", "train.steps=7"])
    sub = submit(r, dry_run=True)
    text = sub.script.read_text()
    frozen = yaml.safe_load((tmp_path / "run" / "job.yaml").read_text())
    assert frozen["train"]["steps"] == 7 and frozen["checkpoint"]["run_dir"] == str(tmp_path / "run")
    assert f"--job {tmp_path / 'run' / 'job.yaml'}" in text
    assert f"#SBATCH --output={tmp_path / 'run' / 'logs'}/%x-%j.out" in text
    assert (tmp_path / "run" / "logs").is_dir()  # Slurm does not create it
    assert "as they are then" not in text  # frozen copies: no live-file note (dslurm render's scripts have one)


def test_auto_signal_lead_is_measured_from_the_runs_ledger(tmp_path):
    run = tmp_path / "run"
    Ledger(run).append(ev.Steps(step_time_s=40.0))
    Ledger(run).append(ev.CkptSave(total_s=45.0, stall_s=45.0))
    from dslurm.observe import lead

    files = (ROOT / "site-configs/h100-ib.yaml", ROOT / "examples/jobs/llama8b-h100.yaml")
    r = lead.load(*files, overrides=[f"checkpoint.run_dir={run}"])
    assert r.policy.lead_setting == "auto" and r.policy.lead_s == 170  # measured once, passed to resolve
    # The config alone (the ground floor) reads no ledger: the site's default, said so.
    bare = load(*files, overrides=[f"checkpoint.run_dir={run}"])
    assert bare.policy.lead_s != 170 and "no measurements" in bare.policy.lead_reason
    text = submit(r, dry_run=True).script.read_text()
    assert "#SBATCH --signal=B:USR2@170" in text  # 2 x (40 + 45)


# ------------------------------------------------ submitting a run again (--run-dir, a completed run)



@pytest.fixture
def fake_sbatch(monkeypatch):
    """No controller here: sbatch records its calls and answers a job id; no job is active."""
    from dslurm import slurm
    from dslurm.cli import submit as submit_mod

    calls: list[list[str]] = []
    monkeypatch.setattr(slurm, "sbatch", lambda script, extra, **kw: calls.append(list(extra)) or 4242)
    monkeypatch.setattr(submit_mod, "active_jobs_of_run", lambda run_dir, env=None: [])
    return calls


def _cli(*argv: str) -> int:
    from dslurm.cli import build_parser

    args = build_parser(["submit"]).parse_args(["submit", *argv])
    return int(args.func(args))


def _run(tmp_path: Path, steps: int, done: int, ending: str = "completed") -> Path:
    """A run dir `dslurm submit` froze (train.steps=steps) whose one start ended `ending` at step
    `done`, with the pointer at `done`."""
    run = tmp_path / "run"
    submit(load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
                overrides=[f"checkpoint.run_dir={run}", f"train.steps={steps}"]), dry_run=True)
    one_start_ended(run, ending, done)
    return run


def test_a_completed_run_is_not_submitted_again(tmp_path, fake_sbatch, capsys):
    run = _run(tmp_path, steps=7, done=7)
    assert _cli("--run-dir", str(run)) == 0 and fake_sbatch == []
    out = capsys.readouterr().out
    assert out.startswith(f"run {run} already completed at step 7 of 7; nothing submitted")
    assert "--force" in out and "train.steps" in out
    assert _cli("--site", str(ROOT / "site-configs/local.yaml"), "--job", str(run / "job.yaml")) == 0
    assert fake_sbatch == []  # the same check on the plain form


def test_force_submits_a_completed_run_anyway(tmp_path, fake_sbatch, capsys):
    run = _run(tmp_path, steps=7, done=7)
    assert _cli("--run-dir", str(run), "--force") == 0 and len(fake_sbatch) == 1
    assert "submitted job 4242" in capsys.readouterr().out


def test_raised_steps_or_an_incomplete_run_submit_normally_and_resume(tmp_path, fake_sbatch):
    run = _run(tmp_path, steps=7, done=7)
    assert _cli("--run-dir", str(run), "--set", "train.steps=12") == 0 and len(fake_sbatch) == 1
    assert yaml.safe_load((run / "job.yaml").read_text())["train"]["steps"] == 12  # frozen again
    other = _run(tmp_path / "b", steps=7, done=4, ending="cancelled")
    assert _cli("--run-dir", str(other)) == 0 and len(fake_sbatch) == 2


def test_completed_note_reads_the_ledger_and_the_pointer(tmp_path):
    from dslurm.submission import completed_note

    run = _run(tmp_path, steps=7, done=7)
    r = load(run / "site.yaml", run / "job.yaml")
    assert completed_note(r) is not None
    (run / "LATEST").write_text(json.dumps({"generation": GEN.format(5), "step": 5}))
    assert completed_note(r) is None  # the pointer is behind the target: there is training left
    (run / "LATEST").unlink()
    assert completed_note(r) is not None  # no checkpoints: the ledger's completed step says it
    fresh = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
                 overrides=[f"checkpoint.run_dir={tmp_path / 'new'}"])
    assert completed_note(fresh) is None


def test_run_dir_uses_the_frozen_config_where_the_run_is_now(tmp_path, fake_sbatch):
    run = _run(tmp_path, steps=7, done=4, ending="cancelled")
    moved = tmp_path / "moved"
    run.rename(moved)
    assert _cli("--run-dir", str(moved)) == 0 and len(fake_sbatch) == 1
    frozen = yaml.safe_load((moved / "job.yaml").read_text())
    assert frozen["checkpoint"]["run_dir"] == str(moved.resolve()) and frozen["train"]["steps"] == 7


def test_run_dir_misuse_is_a_user_error_naming_the_fix(tmp_path):
    run = _run(tmp_path, steps=7, done=4, ending="cancelled")
    with pytest.raises(UserError, match="--site/--job cannot go with it"):
        _cli("--run-dir", str(run), "--job", str(run / "job.yaml"))
    with pytest.raises(UserError, match=r"empty/site.yaml: missing; --run-dir needs"):
        _cli("--run-dir", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="give --site and --job"):
        _cli("--site", str(ROOT / "site-configs/local.yaml"))
