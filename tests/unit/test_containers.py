"""Containers in the site config and the rendered script (dslurm/config/container.py,
dslurm/render/container.py). Apptainer, Singularity and Pyxis/enroot cannot be installed here, so
these tests check the validation and the argv each runtime receives, not a container start: the
rendered scripts run under bash with stand-ins for srun and python that record their arguments."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from dslurm.cli.render import render_files
from dslurm.config import load_site
from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.recover.srun import SrunRunner
from dslurm.recover.supervisor import Step
from dslurm.render import LAUNCHER_WRAP, RenderRefs, render_sbatch
from dslurm.render.container import PWD, auto_paths, launcher_prefix, srun_container_flags
from testkit import shellcheck

ROOT = Path(__file__).resolve().parents[2]
SITE, JOB = ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml"
APPTAINER = {"runtime": "apptainer", "image": "/img/pt.sif"}
PYXIS = {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3"}


def _site(tmp_path: Path, container: dict, **extra) -> Path:
    data = yaml.safe_load(SITE.read_text())
    data.update(container=container, **extra)
    p = tmp_path / "site.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _job(tmp_path: Path, **fields) -> Path:
    data = yaml.safe_load(JOB.read_text())
    data.update(fields)
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _resolved(tmp_path: Path, container: dict, site_extra: dict | None = None, **job):
    return load(_site(tmp_path, container, **(site_extra or {})), _job(tmp_path, **job))


# ------------------------------------------------------------------------------ validation

BAD = [
    ({"runtime": "docker", "image": "/x.sif"}, "container.runtime", "'docker' is not allowed",
     "one of 'apptainer', 'singularity', 'pyxis'"),
    ({"runtime": "apptainer", "image": "images/pt.sif"}, "container.image", "must be an absolute path",
     "absolute path of the image"),
    ({"runtime": "singularity", "image": "docker://nvcr.io/nvidia/pytorch:24.05-py3"}, "container.image",
     "registry URI", "singularity pull /shared/images/NAME.sif docker://"),
    ({**APPTAINER, "binds": ["/datasets"]}, "container.binds.0", "'/datasets' is not SRC:DST",
     "/datasets:/datasets:ro"),
    ({**APPTAINER, "binds": ["/a:/b:/c:ro"]}, "container.binds.0", "is not SRC:DST", "the host path, ':'"),
    ({**APPTAINER, "binds": ["data:/data"]}, "container.binds.0", "'data' must be an absolute path",
     "both paths absolute"),
    ({**APPTAINER, "binds": ["/a,/b:/c"]}, "container.binds.0", "without ','", "both paths absolute"),
    ({**APPTAINER, "binds": ["/a:/b:noexec"]}, "container.binds.0", "options 'noexec'", "ro or rw"),
    ({**APPTAINER, "env": {"1BAD": "x"}}, "container.env", "'1BAD' is not a valid", "letters, digits"),
    ({**APPTAINER, "env": {"A": "x,y"}}, "container.env", "splits on ','", "site's env"),
    ({**APPTAINER, "mounts": ["/a:/b"]}, "container.mounts", "runtime pyxis only", "runtime: pyxis"),
    ({**APPTAINER, "workdir": "/w"}, "container.workdir", "runtime pyxis only", "runtime: pyxis"),
    ({"runtime": "pyxis", "image": "images/pt.sqsh"}, "container.image", "relative squashfs path",
     "absolute path"),
    ({"runtime": "pyxis", "image": "nvcr.io#nvidia/py torch"}, "container.image", "without spaces",
     "enroot URI"),
    ({**PYXIS, "mounts": ["/my data:/data"]}, "container.mounts.0", "blanks (enroot reads mounts as fstab",
     "both paths absolute"),
    ({**PYXIS, "mounts": ["/a:/b:ro,rprivate"]}, "container.mounts.0", "options 'ro,rprivate' are not",
     "flags joined with +"),
    ({**PYXIS, "mounts": ["/a,/b:/c"]}, "container.mounts.0", "without ','", "both paths absolute"),
    ({**PYXIS, "workdir": "work"}, "container.workdir", "must be an absolute path", "submit dir"),
    ({**PYXIS, "binds": ["/a:/b"]}, "container.binds", "runtime apptainer or singularity only",
     "runtime: apptainer"),
    ({**PYXIS, "nv": True}, "container.nv", "runtime apptainer or singularity only", "remove container.nv"),
    ({"runtime": "pyxis"}, "container.image", "is required", "add `image:`"),
]


@pytest.mark.parametrize("container,field,what,fix", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_container_settings_name_the_file_field_value_and_fix(tmp_path, container, field, what, fix):
    path = _site(tmp_path, container)
    with pytest.raises(UserError) as exc:
        load_site(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: field '{field}': ") and what in msg, msg
    assert "Fix: " in msg and fix in msg.split("Fix: ", 1)[1], msg


def test_a_bad_container_from_the_cli_exits_2_without_a_traceback(cli):
    res = cli("render", "--site", "site-configs/h100-ib-pyxis.yaml", "--job", "examples/jobs/llama8b-h100.yaml",
              "--site-set", "container.runtime=apptainer")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--site-set container.runtime=apptainer" in res.stderr or "container.image" in res.stderr
    assert "Fix:" in res.stderr


def test_the_shipped_container_sites_load_and_the_others_have_none():
    assert load_site(ROOT / "site-configs/a100-apptainer.yaml").container.runtime == "apptainer"
    assert load_site(ROOT / "site-configs/h100-ib-pyxis.yaml").container.runtime == "pyxis"
    for name in ("local", "h100-ib", "a100-eth"):
        assert load_site(ROOT / f"site-configs/{name}.yaml").container is None


# ------------------------------------------------------------------------------ argv


def test_apptainer_argv_binds_the_submit_dir_run_dir_and_user_binds_then_the_image(tmp_path):
    c = {**APPTAINER, "binds": ["/data sets/it's:/data:ro"], "env": {"HF_HOME": "/hf home", "Q": "a\"b'c$d"}}
    r = _resolved(tmp_path, c, checkpoint={"run_dir": "/runs/tiny"})
    assert launcher_prefix(r) == [
        "apptainer", "exec", "--nv", "--pwd", PWD,
        "--bind", f"{PWD}:{PWD}", "--bind", "/runs/tiny:/runs/tiny",
        "--bind", "/data sets/it's:/data:ro",
        "--env", "HF_HOME=/hf home", "--env", "Q=a\"b'c$d", "/img/pt.sif"]
    assert srun_container_flags(r) == []  # apptainer wraps the launcher; srun stays plain


def test_singularity_and_nv_false(tmp_path):
    r = _resolved(tmp_path, {"runtime": "singularity", "image": "/img/x.sif", "nv": False})
    assert launcher_prefix(r)[:3] == ["singularity", "exec", "--pwd"]


def test_pyxis_flags_mount_the_same_paths_and_default_the_workdir_to_the_submit_dir(tmp_path):
    c = {**PYXIS, "mounts": ["/lustre/data:/data:ro+rprivate"]}
    r = _resolved(tmp_path, c, checkpoint={"run_dir": "/runs/tiny"})
    assert srun_container_flags(r) == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts={PWD}:{PWD},/runs/tiny:/runs/tiny,/lustre/data:/data:ro+rprivate",
        f"--container-workdir={PWD}"]
    assert launcher_prefix(r) == []
    r2 = _resolved(tmp_path, {**PYXIS, "workdir": "/workspace"})
    assert srun_container_flags(r2)[-1] == "--container-workdir=/workspace"


def test_automatic_paths_data_dir_two_tier_scratch_and_a_relative_run_dir(tmp_path):
    site_extra = {"storage": {"durable": "checkpoints", "scratch": "/local/ssd/%n/dslurm"}}
    r = _resolved(tmp_path, APPTAINER, site_extra, data={"path": "/datasets/tok/train.h5"},
                  checkpoint={"tiers": "two_tier"})
    # run dir checkpoints/tiny-2node is relative: inside the submit dir, bound already
    assert auto_paths(r) == [PWD, "/datasets/tok", "/local/ssd"]
    r = _resolved(tmp_path, APPTAINER, site_extra)  # durable tier: scratch unused, not bound
    assert auto_paths(r) == [PWD]
    r = _resolved(tmp_path, APPTAINER, {"storage": {"scratch": "$TMPDIR/x"}}, checkpoint={"tiers": "two_tier"})
    assert auto_paths(r) == [PWD]  # nothing fixed to bind: docs/containers.md says to bind it yourself


def test_a_run_dir_the_runtime_cannot_bind_is_refused_at_render(tmp_path):
    r = _resolved(tmp_path, PYXIS, checkpoint={"run_dir": "/runs/my run"})
    with pytest.raises(UserError, match=r"'/runs/my run'.*pyxis binds only a path without ',', ':' or blanks"):
        render_sbatch(r, RenderRefs(site="s", job="j"))
    r = _resolved(tmp_path, APPTAINER, checkpoint={"run_dir": "/runs/a,b"})
    with pytest.raises(UserError, match=r"Fix: move the run dir"):
        render_sbatch(r, RenderRefs(site="s", job="j"))
    ok = _resolved(tmp_path, APPTAINER, checkpoint={"run_dir": "/runs/my run"})  # apptainer takes blanks
    assert "--bind '/runs/my run:/runs/my run'" in render_sbatch(ok, RenderRefs(site="s", job="j"))


# ------------------------------------------------------------------------------ the script run by bash

EVIL = "$(touch {p})`touch {p}`'\"$HOME ${{HOME}} !x"


def _stub(bindir: Path, name: str, out: Path) -> None:
    exe = bindir / name
    exe.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {out}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def _run_script(tmp_path: Path, text: str) -> tuple[list[str], list[str]]:
    """Run the rendered script with stand-ins for srun and python; return their argument lists."""
    lint = subprocess.run([shellcheck(), "-"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _stub(bindir, "srun", tmp_path / "srun.args")
    _stub(bindir, "python", tmp_path / "python.args")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    workdir = tmp_path / "submit dir"  # a blank in $PWD: the "$PWD" words must stay one word
    workdir.mkdir()
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, cwd=workdir)
    assert res.returncode == 0, res.stderr
    return ((tmp_path / "srun.args").read_text().splitlines(), (tmp_path / "python.args").read_text().splitlines())


def _hostile(tmp_path: Path, container: dict):
    r = _resolved(tmp_path, container, checkpoint={"run_dir": str(tmp_path / "run")})
    r.site.setup.clear()  # no venv here
    return r, render_sbatch(r, RenderRefs(site="site.yaml", job="job.yaml"))


def test_apptainer_words_arrive_verbatim_through_bash(tmp_path):
    owned = tmp_path / "owned"
    evil = EVIL.format(p=owned)
    r, text = _hostile(tmp_path, {"runtime": "apptainer", "image": f"/img/{evil}.sif",
                                  "binds": [f"/data/{evil}:/data:ro"], "env": {"EVIL": evil}})
    srun, after = _run_script(tmp_path, text)
    cwd = str(tmp_path / "submit dir")
    start = srun.index("apptainer")
    expected = [w.replace(PWD, cwd) for w in launcher_prefix(r)]
    assert srun[start:start + len(expected)] == expected and f"/img/{evil}.sif" in expected
    wrap = shlex.split(LAUNCHER_WRAP)  # inside the container: the launcher starts with USR2 ignored
    at = start + len(expected)
    assert srun[at:at + len(wrap)] == wrap and srun[at + len(wrap):at + len(wrap) + 4] == [
        "python", "-m", "dslurm", "launch"]
    assert not owned.exists()
    # The trainer after `--` is started by the launcher inside the container: not wrapped again.
    assert srun[srun.index("--") + 1:srun.index("--") + 4] == ["python", "-m", "train"]
    assert after[:3] == ["-m", "dslurm", "requeue-me"]  # the batch shell's own python: outside


def test_pyxis_flags_arrive_verbatim_on_the_launchers_srun_only(tmp_path):
    owned = tmp_path / "owned"
    evil = EVIL.format(p=owned).replace(" ", "")  # enroot: no blanks in images or mounts
    r, text = _hostile(tmp_path, {"runtime": "pyxis", "image": f"nvcr.io#{evil}",
                                  "mounts": [f"/data/{evil}:/data:ro"], "workdir": f"/w/{evil}"})
    srun, after = _run_script(tmp_path, text)
    cwd = str(tmp_path / "submit dir")
    flags = [w.replace(PWD, cwd) for w in srun_container_flags(r)]
    launch = srun.index("sh")  # the wrapper (LAUNCHER_WRAP), then the launcher
    assert srun[launch - 3:launch] == flags and srun[0] == "--kill-on-bad-exit=1"
    assert srun[launch + 4:launch + 8] == ["python", "-m", "dslurm", "launch"]
    assert flags[0] == f"--container-image=nvcr.io#{evil}" and flags[2] == f"--container-workdir=/w/{evil}"
    assert flags[1].startswith(f"--container-mounts={cwd}:{cwd},")
    assert not owned.exists()
    assert after[:3] == ["-m", "dslurm", "requeue-me"]
    assert text.count("--container-image") == 1  # srun's line only; the batch shell stays outside


# ------------------------------------------------------------------------------ spares: supervise's srun


def test_supervise_puts_pyxis_flags_on_each_steps_srun_with_the_batch_shells_cwd(tmp_path, monkeypatch):
    r = _resolved(tmp_path, PYXIS, checkpoint={"run_dir": "/runs/tiny"}, spares=1)
    monkeypatch.chdir(tmp_path)
    argv = SrunRunner(r, ["python", "-m", "dslurm", "launch"], {}).argv(
        Step(index=1, hosts=("node1", "node2"), facts_dir=tmp_path, grad_accum=None))
    cwd = os.getcwd()
    assert argv[8:11] == ["--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
                          f"--container-mounts={cwd}:{cwd},/runs/tiny:/runs/tiny", f"--container-workdir={cwd}"]
    assert argv[11:] == ["python", "-m", "dslurm", "launch"]
    text = render_sbatch(r, RenderRefs(site="s", job="j"))
    # supervise adds them to the steps it starts, from the frozen config; the script has none
    assert "--container-image" not in text and "supervise stay outside" in text


def test_supervise_with_apptainer_gets_the_wrapped_launcher_and_stays_outside(tmp_path):
    r = _resolved(tmp_path, APPTAINER, spares=1)
    text = render_sbatch(r, RenderRefs(site="s", job="j"))
    lint = subprocess.run([shellcheck(), "-"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert "-m dslurm supervise -- apptainer exec --nv --pwd \"$PWD\"" in text
    assert "supervise stay outside" in text
    runner = SrunRunner(r, ["apptainer", "exec"], {})
    assert "--container-image" not in " ".join(runner.argv(Step(index=1, hosts=("n1",), facts_dir=tmp_path,
                                                                   grad_accum=None)))


# ------------------------------------------------------------------------------ goldens


def test_container_goldens_wrap_only_the_launcher():
    apptainer = render_files("site-configs/a100-apptainer.yaml", "examples/jobs/llama1b-a100-srun.yaml")
    assert (ROOT / "sbatch/llama1b-a100-srun.a100-apptainer.sbatch").read_text() == apptainer
    lines = apptainer.splitlines()
    i = lines.index('  apptainer exec --nv --pwd "$PWD" \\')
    assert lines[i - 2].startswith("srun ")
    assert lines[i + 8].startswith(f"  {LAUNCHER_WRAP} python -m dslurm launch --mode srun")
    assert "    --bind '/nfs/vision/hf cache:/hf-cache' \\" in lines
    pyxis = render_files("site-configs/h100-ib-pyxis.yaml", "examples/jobs/llama8b-h100.yaml")
    assert (ROOT / "sbatch/llama8b-h100.h100-ib-pyxis.sbatch").read_text() == pyxis
    assert "  '--container-image=nvcr.io#nvidia/pytorch:24.05-py3' \\" in pyxis.splitlines()
    # Without a container the example scripts are unchanged: no wrapper and no note.
    plain = render_files("site-configs/h100-ib.yaml", "examples/jobs/llama8b-h100.yaml")
    assert "Container" not in plain and "--container" not in plain


def test_the_examples_check_command_finds_the_goldens(cli):
    res = cli("render", "--examples", "check")
    assert res.returncode == 0, res.stderr


def test_the_submitit_path_refuses_a_container_site_instead_of_running_outside_it(tmp_path):
    from dslurm import api

    site = _site(tmp_path, APPTAINER)
    with pytest.raises(UserError, match=r"field .container.: api.submit cannot run .* Fix: submit with `dslurm sub"):
        api.submit(str(JOB), site=str(site), overrides=[f"checkpoint.run_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("container", [{**APPTAINER, "binds": ["/a b:/c:ro"], "env": {"X": "1"}},
                                       {**PYXIS, "mounts": ["/a:/b"], "workdir": "/w"}])
def test_the_frozen_site_keeps_the_container(tmp_path, container):
    """requeue-me and supervise re-read the run dir's frozen site.yaml: the container survives it."""
    from dslurm.submission import freeze_and_render

    r = _resolved(tmp_path, container, checkpoint={"run_dir": str(tmp_path / "run")})
    freeze_and_render(r)
    again = load_site(tmp_path / "run" / "site.yaml")
    assert again.container == r.site.container
