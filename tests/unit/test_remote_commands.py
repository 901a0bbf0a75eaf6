"""ssh command building, remote scripts, the site's login fields and the local handle
(dslurm/remote/ssh.py, proxy.py, handle.py). Pure, or a local `bash` standing in for ssh."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from dslurm.config import load_site
from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.remote import handle, proxy, ssh

SITE = "site-configs/local.yaml"
LOGIN = ["login=clusterA", "remote.workdir=/scratch/me"]


def test_login_argv_batch_mode_config_and_one_quoted_script():
    login = ssh.Login(host="clusterA", config="/tmp/cfg x")
    argv = login.argv("echo 'a b' $HOME")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[argv.index("-F") + 1] == "/tmp/cfg x"
    assert argv[-2] == "clusterA"
    assert shlex.split(argv[-1]) == ["bash", "-c", "echo 'a b' $HOME"]  # the remote shell only unquotes it


def test_script_runs_setup_then_checks_and_quotes_dslurm():
    login = ssh.Login(host="h", dslurm=("/opt/my venv/bin/dslurm",), setup=("module load x",))
    text = ssh.script(login, [f"exec {ssh.DSLURM} status 5"])
    lines = text.splitlines()
    assert lines[0] == "module load x"
    assert lines[1] == "dslurm_cmd=('/opt/my venv/bin/dslurm')"
    assert lines[2] == 'command -v "${dslurm_cmd[0]}" >/dev/null 2>&1 || exit 96'
    assert lines[3] == 'exec "${dslurm_cmd[@]}" status 5'


def _echo_dslurm(tmp_path):
    """A stand-in dslurm (in a directory with a space, run with an extra word) that prints its
    arguments one per line, then its working directory."""
    fake = tmp_path / "my bin" / "dslurm"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"; echo "PWD $PWD"\n')
    fake.chmod(0o755)
    return ssh.Login(host="h", dslurm=(str(fake), "--quiet word"))


def test_dslurm_inside_quoted_values_reaches_the_remote_command_unchanged(tmp_path):
    login = _echo_dslurm(tmp_path)
    run = tmp_path / "runs DSLURM" / "it's DSLURM"
    run.mkdir(parents=True)
    (run / "job.yaml").write_text("{}")
    flags = ["--set=env.DSLURM_X=a DSLURM b", "--chain=1"]
    res = subprocess.run(["bash", "-c", ssh.script(login, proxy.resubmit_body(str(run), None, flags))],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["--quiet word", "submit", "--run-dir", str(run), "--json", *flags,
                                       f"PWD {run}"]
    argv = ["report", str(run), "--set=DSLURM=DSLURM", "DSLURM"]  # passthrough argv
    res = subprocess.run(["bash", "-c", ssh.script(login, [f"exec {ssh.DSLURM} " + ssh.quote_words(argv)])],
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[:-1] == ["--quiet word", *argv]


def test_submit_body_quotes_the_run_dir_and_passes_flags():
    body = proxy.submit_body("/runs/it's here", "0123456789abcdef", ["--chain=2", "--force"])
    text = "\n".join(body)
    assert "mkdir -p '/runs/it'\"'\"'s here'/code" in text
    assert text.rstrip().endswith("--json --chain=2 --force")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_remote_script_runs_in_bash_as_ssh_would_run_it(tmp_path):
    """The script as the login host's shell gets it: stdin carries a tar, dslurm is a stand-in."""
    fake = tmp_path / "dslurm"
    fake.write_text("#!/bin/sh\necho \"ARGS $*\"; ls \"$PWD\"\n")
    fake.chmod(0o755)
    login = ssh.Login(host="h", dslurm=(str(fake),))
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("code/abc/m.py", b"X=1\n"), ("submit/site.yaml", b"{}"), ("submit/job.yaml", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    run = tmp_path / "run dir"
    res = subprocess.run(["bash", "-c", ssh.script(login, proxy.submit_body(str(run), "abc", ["--chain=1"]))],
                         input=buf.getvalue(), capture_output=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert f"--code {run}/code/abc --origin {run}/.incoming." in out and "/submit/origin.json --json --chain=1" in out
    assert "m.py" in out
    assert (run / "code" / "abc" / "m.py").read_text() == "X=1\n"
    assert not list(run.glob(".incoming.*"))  # the temp dir is gone


def test_missing_remote_dslurm_is_its_own_code_and_named(tmp_path):
    login = ssh.Login(host="h", dslurm=("/nonexistent/dslurm",))
    res = subprocess.run(["bash", "-c", ssh.script(login, [f"exec {ssh.DSLURM} --version"])])
    assert res.returncode == ssh.MISSING != ssh.NOT_FOUND
    assert "remote.dslurm" in str(ssh.missing_dslurm(login))


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    """An `ssh` on PATH that runs the remote command word here, as the login shell would."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/bash\nexec sh -c "${@: -1}"\n')
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_an_exit_127_of_another_command_is_not_dslurm_missing(tmp_path, fake_ssh):
    # The remote dslurm is there; a command it (or a setup line) runs is not: that command's 127,
    # returned as is with its own message, never "set remote.dslurm".
    login = ssh.Login(host="h", dslurm=("true",))
    res = ssh.run(login, ssh.script(login, ["no-such-tool-xyz --flag"]))
    assert res.returncode == ssh.NOT_FOUND and b"no-such-tool-xyz" in res.stderr
    with pytest.raises(UserError, match="remote.dslurm"):
        gone = ssh.Login(host="h", dslurm=("/nonexistent/dslurm",))
        ssh.run(gone, ssh.script(gone, ["true"]))


def test_a_cluster_dslurm_of_another_version_is_refused_naming_both(tmp_path, fake_ssh):
    from dslurm import __version__

    fake = tmp_path / "dslurm"
    fake.write_text("#!/bin/sh\necho 'dslurm 9.9.9'\n")
    fake.chmod(0o755)
    with pytest.raises(UserError, match=f"version 9.9.9 .*here {__version__}.*install dslurm {__version__}"):
        proxy.probe(ssh.Login(host="h", dslurm=(str(fake),)))
    fake.write_text(f"#!/bin/sh\necho 'dslurm {__version__}'\n")
    assert proxy.probe(ssh.Login(host="h", dslurm=(str(fake),))) == f"dslurm {__version__}"


def test_unreachable_host_is_a_user_error_naming_host_and_fix(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text("Host nowhere\n  HostName 127.0.0.1\n  Port 1\n")  # nothing listens on port 1
    login = ssh.Login(host="nowhere", config=str(cfg))
    with pytest.raises(UserError, match=r"login host 'nowhere'.*cannot be reached.*Fix: make `ssh -F .* true` work"):
        ssh.run(login, "true", timeout=60)


@pytest.mark.parametrize("sets, what", [
    (["login=-oProxyCommand=evil", "remote.workdir=/a"], "not an ssh host alias"),
    (["login=a b", "remote.workdir=/a"], "not an ssh host alias"),
    (["login=clusterA"], "'remote.workdir': is not set"),
    (["login=clusterA", "remote.workdir=runs"], "'runs' is not absolute"),
    (["login=clusterA", "remote.workdir=/a", "remote.dslurm='x"], "'remote.dslurm'"),
    (["remote.nope=1"], "valid keys here are: workdir, dslurm, ssh_config"),
])
def test_bad_login_fields_name_field_value_and_fix(root, sets, what):
    with pytest.raises(UserError, match="Fix:") as exc:
        load_site(root / SITE, sets)
    assert what in str(exc.value)


def test_places_relative_run_dirs_there_and_here(root, tmp_path):
    r = load(root / SITE, root / "examples/jobs/tiny-2node.yaml", site_overrides=LOGIN, base_dir=tmp_path)
    there, here = proxy.places(r, tmp_path)
    assert there == "/scratch/me/checkpoints/tiny-2node" and here == tmp_path / "checkpoints" / "tiny-2node"
    r = load(root / SITE, root / "examples/jobs/tiny-2node.yaml", ["checkpoint.run_dir=/big/runs/x"],
             site_overrides=LOGIN, base_dir=tmp_path)
    assert proxy.places(r, tmp_path) == ("/big/runs/x", tmp_path / "remote-runs" / "x")


def test_places_refuses_a_handle_that_would_be_the_run_itself(root, tmp_path):
    sets = ["login=clusterA", f"remote.workdir={tmp_path}"]
    r = load(root / SITE, root / "examples/jobs/tiny-2node.yaml", site_overrides=sets, base_dir=tmp_path)
    with pytest.raises(UserError, match="both"):
        proxy.places(r, tmp_path)


def test_handle_round_trip_and_a_plain_run_dir_has_none(tmp_path):
    h = handle.Handle(path=tmp_path / "h", login=ssh.Login(host="c", config="/x", dslurm=("dslurm",),
                                                         setup=("source /v/bin/activate",)),
                      run_dir="/scratch/r", job_ids=(12, 13), code="0123456789abcdef", source="git wc")
    handle.write(h)
    assert handle.read(tmp_path / "h") == h and h.job_id == 13
    assert handle.read(tmp_path) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / handle.FILENAME).write_text("{")
    with pytest.raises(UserError, match="not a handle"):
        handle.read(tmp_path / "bad")


def test_fetch_body_makes_text_json_png_and_ckpt_ls():
    text = "\n".join(proxy.fetch_body("/r x", png=True))
    assert f"{ssh.DSLURM} report '/r x' --json --png \"$out/report.png\"" in text
    assert f"{ssh.DSLURM} ckpt ls '/r x'" in text
    assert "--no-png > \"$out/report.txt\"" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_watch_line_is_one_line_per_state(tmp_path):
    from dslurm.observe import events as ev
    from dslurm.observe.watch import line

    es = [ev.TrainStart(t=1.0, step=0), ev.Steps(t=2.0, last=4, loss=1.5), ev.CkptSave(t=3.0, step=5)]
    assert line(es, target=10, status="running") == "running  step 5/10  loss 1.5000  saved 5  starts 1"
    assert line([], target=None, status="queued") == "queued  step 0  saved -  starts 0"

