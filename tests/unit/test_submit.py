"""submit without Slurm: what lands in the run directory (dry run)."""

from __future__ import annotations

from pathlib import Path

import yaml

from dslurm.config.resolve import load
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.submit import submit

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


def test_auto_signal_lead_is_measured_from_the_runs_ledger(tmp_path):
    run = tmp_path / "run"
    Ledger(run).append(ev.Steps(step_time_s=40.0))
    Ledger(run).append(ev.CkptSave(total_s=45.0, stall_s=45.0))
    r = load(ROOT / "site-configs/h100-ib.yaml", ROOT / "examples/jobs/llama8b-h100.yaml",
             overrides=[f"checkpoint.run_dir={run}"])
    assert r.policy.lead_setting == "auto" and r.policy.lead_s == 170  # measured in resolve, once
    text = submit(r, dry_run=True).script.read_text()
    assert "#SBATCH --signal=B:USR2@170" in text  # 2 x (40 + 45)
