"""The rendered sbatch script: whole-node directives, quoting, shellcheck, golden files."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from dslurm.cli.render import EXAMPLES, examples, golden_path, render_files
from dslurm.config.resolve import load
from dslurm.render import LAUNCHER_WRAP, RenderRefs, render_sbatch
from testkit import sbatch_flags, shellcheck

ROOT = Path(__file__).resolve().parents[2]


def test_h100_script_has_every_whole_node_directive():
    text = render_files("site-configs/h100-ib.yaml", "examples/jobs/llama8b-h100.yaml")
    d = sbatch_flags(text)
    assert d["nodes"] == "4" and d["ntasks-per-node"] == "1" and "exclusive" in d
    assert d["gpus-per-node"] == "8" and d["cpus-per-task"] == "96" and d["mem"] == "0"
    assert d["time"] == "1-00:00:00" and d["signal"] == "B:USR2@300" and "requeue" in d
    assert d["open-mode"] == "append"
    assert d["output"] == "logs/%x-%j.out" and d["error"] == "logs/%x-%j.err"
    assert (d["partition"], d["account"], d["qos"]) == ("gpu", "ml-research", "normal")
    assert 'srun --kill-on-bad-exit=1 --nodes="$NNODES"' in text
    assert "-m dslurm launch --mode torchrun --nproc-per-node \"$NPROC_PER_NODE\"" in text
    assert "trap 'forward USR2' USR2" in text and "trap 'forward TERM' TERM" in text
    # Node and process counts are written once and used everywhere else by name.
    assert text.count("NNODES=4") == 1 and text.count("NPROC_PER_NODE=8") == 1


def test_gres_sites_and_srun_mode():
    text = render_files("site-configs/a100-eth.yaml", "examples/jobs/llama1b-a100-srun.yaml")
    d = sbatch_flags(text)
    assert d["gres"] == "gpu:a100:4" and "gpus-per-node" not in d
    assert d["ntasks-per-node"] == "4" and d["cpus-per-task"] == "16"  # one task per GPU
    assert '--ntasks-per-node="$NPROC_PER_NODE"' in text and "--mode srun" in text


def test_dependency_and_no_requeue(tmp_path):
    job = yaml.safe_load((ROOT / "examples/jobs/tiny-2node.yaml").read_text())
    job.update(dependency="afterany:123", requeue={"enabled": False})
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    d = sbatch_flags(render_files(str(ROOT / "site-configs/local.yaml"), str(p)))
    assert d["dependency"] == "afterany:123" and "no-requeue" in d
    assert "requeue" not in d and "signal" not in d


@pytest.mark.parametrize("site,job", EXAMPLES)
def test_rendered_examples_are_shellcheck_clean(site, job):
    text = golden_path(site, job, ROOT).read_text()
    res = subprocess.run([shellcheck(), "-"], input=text, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout


def test_golden_files_equal_a_fresh_render():
    # A missing golden counts as stale: nothing here writes one (use `dslurm render --examples write`).
    assert examples(ROOT, write=False) == []


def test_missing_golden_fails(tmp_path):
    fake_root = tmp_path / "repo"
    for d in ("site-configs", "examples"):
        shutil.copytree(ROOT / d, fake_root / d)
    assert len(examples(fake_root, write=False)) == len(EXAMPLES)


EVIL = "$(touch {p})`touch {p}`;touch {p}'\"$HOME ${{HOME}} $((1+1)) \\$ !x"


def test_hostile_values_cannot_execute_when_the_script_runs(tmp_path):
    """Every value is quoted: run the script with stub srun/python and check that the
    values arrive verbatim, nothing got executed, and the script is shellcheck-clean
    (SC2016: a single-quoted `$` looks like a forgotten expansion)."""
    owned = tmp_path / "owned"
    evil = EVIL.format(p=owned)
    job = yaml.safe_load((ROOT / "examples/jobs/tiny-2node.yaml").read_text())
    job["env"] = {"EVIL": evil, "TICK": "`date`", "DOLLAR": "$HOME"}
    job["data"] = {"path": evil}
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(job))
    r = load(ROOT / "site-configs/local.yaml", job_path, overrides=[f"checkpoint.run_dir={evil}"],
             site_overrides=["python=python -X dev"])
    site = r.site
    site.setup.clear()  # no venv here; the stubs below stand in for srun
    text = render_sbatch(r, RenderRefs(site=str(ROOT / "site-configs/local.yaml"), job=str(job_path),
                                       overrides=(f"data.path={evil}",), site_overrides=(f"description={evil}",)))
    lint = subprocess.run([shellcheck(), "-"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    bindir = tmp_path / "bin"
    bindir.mkdir()
    argfile = tmp_path / "args"
    stub = bindir / "srun"
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {argfile}\nprintf "%s" "$EVIL" > {argfile}.env\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    py = bindir / "python"  # stands in for `python -m dslurm requeue-me` after the step
    py.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/after\n')
    py.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}
    # cwd: the run dir is a relative hostile path; the script creates its facts dir under it.
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert not owned.exists()
    args = argfile.read_text().splitlines()
    assert f"data.path={evil}" in args and f"description={evil}" in args
    assert (tmp_path / "args.env").read_text() == evil
    # The site's `python -X dev` arrives as three words, before `-m`, on both command lines.
    assert args[args.index("--") + 1:args.index("--") + 6] == ["python", "-X", "dev", "-m", "train"]
    assert (tmp_path / "after").read_text().split() == ["-X", "dev", "-m", "dslurm", "requeue-me", "--rc", "0"]


def test_newline_in_a_value_is_refused(tmp_path):
    from dslurm.errors import UserError

    job = yaml.safe_load((ROOT / "examples/jobs/tiny-2node.yaml").read_text())
    job["env"] = {"X": "line1\nline2"}
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    r = load(ROOT / "site-configs/local.yaml", p)
    with pytest.raises(UserError, match="newline"):
        render_sbatch(r, RenderRefs(site="s", job="j"))


def test_spares_allocate_more_nodes_with_no_kill_and_supervise_the_steps():
    text = render_files("site-configs/local.yaml", "examples/jobs/tiny-spares.yaml")
    d = sbatch_flags(text)
    assert d["nodes"] == "3" and "no-kill" in d and "requeue" in d  # 2 training + 1 spare
    assert "-m dslurm supervise -- " + LAUNCHER_WRAP + " python -m dslurm launch --mode torchrun" in text
    # USR2 ignored across exec until supervise's handler exists (dslurm selftest chaos, seed 1)
    assert "( trap '' USR2; exec python -m dslurm supervise -- " in text
    assert not [ln for ln in text.splitlines() if ln.startswith("srun")]  # supervise runs srun itself
    assert "dslurm requeue-me" not in text and 'exit "$rc"' in text
    plain = sbatch_flags(render_files("site-configs/local.yaml", "examples/jobs/tiny-2node.yaml"))
    assert plain["nodes"] == "2" and "no-kill" not in plain
