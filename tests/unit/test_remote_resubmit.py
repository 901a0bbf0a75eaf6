"""`dslurm submit --run-dir HANDLE` and `dslurm doctor HANDLE` (dslurm/remote/proxy.py), with the
remote side run in a local bash: a stand-in `ssh` on PATH runs the script it is handed, the real
dslurm runs "there", and a stand-in `sbatch` answers (or refuses, with Slurm's recorded words)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.remote import handle, proxy, ssh
from dslurm.submission import submit
from testkit import one_start_ended

ROOT = Path(__file__).resolve().parents[2]
DSLURM = str(Path(sys.executable).parent / "dslurm")
FAKE_SSH = '#!/bin/bash\neval "${@: -1}"\n'  # the last word is `bash -c SCRIPT`: run it here
FAKE_SBATCH = '''#!/bin/bash
echo "$@" >> "$(dirname "$0")/sbatch.calls"
if grep -q nosuchpart "${@: -1}"; then
  echo "sbatch: error: invalid partition specified: nosuchpart" >&2
  echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2
  exit 1
fi
echo 4343
'''


@pytest.fixture
def there(tmp_path, monkeypatch):
    """PATH with the stand-ins; scontrol/sacctmgr/squeue answer nothing (no controller here)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("sbatch", FAKE_SBATCH), ("scontrol", "#!/bin/sh\nexit 1\n"),
                       ("sacctmgr", "#!/bin/sh\nexit 1\n"), ("squeue", "#!/bin/sh\nexit 1\n")):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    return bin_


def _remote_run(tmp_path: Path, steps: int, done: int, ending: str) -> tuple[Path, handle.Handle]:
    """A run "on the cluster", submitted with a code snapshot, whose one start ended `ending` at `done`;
    and its local handle."""
    code = tmp_path / "code-v1"
    code.mkdir()
    (code / "m.py").write_text("V = 1\n")
    run = tmp_path / "cluster" / "run"
    r = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
             overrides=[f"checkpoint.run_dir={run}", f"train.steps={steps}"])
    sub = submit(r, dry_run=True, code=str(code))
    one_start_ended(run, ending, done)
    name = sub.script.read_text().split("/code/")[1].split()[0].strip("'\"")
    h = handle.Handle(path=tmp_path / "laptop" / "run", login=ssh.Login(host="clusterA", dslurm=(DSLURM,)),
                      run_dir=str(run), job_ids=(4241,), code=name, source="git wc")
    handle.write(h)
    return run, h


def _cli(*argv: str) -> int:
    from dslurm.cli import build_parser

    args = build_parser([argv[0]]).parse_args(list(argv))
    return int(args.func(args))


def test_resubmit_handle_continues_an_incomplete_run_with_its_snapshot(tmp_path, there, capsys):
    run, h = _remote_run(tmp_path, steps=7, done=4, ending="cancelled")
    before = [ln for ln in (run / "job.sbatch").read_text().splitlines() if "/code/" in ln]
    assert _cli("submit", "--run-dir", str(h.path), "--chain", "1") == 0
    out = capsys.readouterr().out
    assert "submitted job 4343 on clusterA" in out and f"the run's snapshot {h.code}" in out
    assert handle.read(h.path).job_ids == (4241, 4343)  # status/watch now follow the new job
    after = [ln for ln in (run / "job.sbatch").read_text().splitlines() if "/code/" in ln]
    assert after == before and f"/code/{h.code}" in after[0]  # the same snapshot runs
    assert [e.job_ids for e in ev.of(ev.read(run), ev.Submit)][-1] == [4343]


def test_resubmit_handle_refuses_a_completed_run_unless_forced(tmp_path, there, capsys):
    run, h = _remote_run(tmp_path, steps=7, done=7, ending="completed")
    assert _cli("submit", "--run-dir", str(h.path)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"clusterA: run {run} already completed at step 7 of 7; nothing submitted"), out
    assert not (there / "sbatch.calls").exists() and handle.read(h.path).job_ids == (4241,)
    assert _cli("submit", "--run-dir", str(h.path), "--force") == 0
    assert "submitted job 4343" in capsys.readouterr().out


def test_resubmit_handle_with_code_ships_a_new_snapshot(tmp_path, there, capsys):
    run, h = _remote_run(tmp_path, steps=7, done=4, ending="cancelled")
    v2 = tmp_path / "code-v2"
    v2.mkdir()
    (v2 / "m.py").write_text("V = 2\n")
    assert _cli("submit", "--run-dir", str(h.path), "--code", str(v2)) == 0
    new = handle.read(h.path)
    assert new.code != h.code and (run / "code" / new.code / "m.py").read_text() == "V = 2\n"
    assert f"/code/{new.code}" in (run / "job.sbatch").read_text()
    assert (run / "code" / "CURRENT").read_text().strip() == new.code
    assert not list(run.glob(".incoming.*"))


def test_a_refusal_there_reaches_the_laptop_unchanged_and_submits_nothing(tmp_path, there, capsys):
    run, h = _remote_run(tmp_path, steps=7, done=4, ending="cancelled")
    frozen = (run / "site.yaml").read_bytes()
    with pytest.raises(UserError) as exc:
        _cli("submit", "--run-dir", str(h.path), "--site-set", "slurm.partition=nosuchpart")
    msg = str(exc.value)
    assert msg.startswith("on login host 'clusterA': --site-set slurm.partition=nosuchpart: partition 'nosuchpart' "
                          "does not exist on this cluster"), msg
    assert "nothing was submitted" in msg and "Fix: name a partition `sinfo -s` lists" in msg
    assert handle.read(h.path).job_ids == (4241,) and (run / "site.yaml").read_bytes() == frozen
    assert [e.job_ids for e in ev.of(ev.read(run), ev.Submit)] == [[4241]]


def test_failed_there_keeps_the_clusters_message_and_its_exit_code():
    from dslurm.errors import SlurmError

    login = ssh.Login(host="c")
    err = b"warning: busy\ndslurm submit: error: site.yaml: field 'slurm.qos': bad. Fix: x\n"
    got = proxy.failed_there(login, 2, err)
    assert type(got) is UserError and str(got) == "on login host 'c': site.yaml: field 'slurm.qos': bad. Fix: x"
    assert isinstance(proxy.failed_there(login, 1, err), SlurmError)
    assert "dslurm submit failed there (exit 3)" in str(proxy.failed_there(login, 3, b"boom"))


def test_resubmit_of_a_handle_whose_run_is_gone_names_it(tmp_path, there):
    h = handle.Handle(path=tmp_path / "h", login=ssh.Login(host="c", dslurm=(DSLURM,)),
                      run_dir=str(tmp_path / "nowhere"), job_ids=(1,), code="x")
    handle.write(h)
    with pytest.raises(UserError, match=r"on login host 'c': .*nowhere: no job.yaml there"):
        _cli("submit", "--run-dir", str(h.path))


def test_doctor_on_a_handle_runs_there(tmp_path, there, capfd):
    run, h = _remote_run(tmp_path, steps=7, done=4, ending="cancelled")
    rc = _cli("doctor", str(h.path))
    out = capfd.readouterr().out
    assert rc == 1 and "incomplete" in out.lower() and "step 4" in out, out  # the run's doctor, from there
