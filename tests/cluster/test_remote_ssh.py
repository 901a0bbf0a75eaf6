"""Driving the local cluster from "a laptop" over a real ssh (issue 28, docs/remote.md).

An sshd started here on 127.0.0.1 with a host key and a user key made for the test sits in front
of the local cluster; a site with `login:` names it through an ssh config file. From a separate
working copy (a copy of this checkout, its own git repository) the demo job is submitted over
ssh, watched (piped: a line per change), preempted, and its report comes back. The job's entry is
a module of the working copy that records which code each start ran: edited after the submit,
the requeued start still runs the snapshot's version.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cluster_jobs import ROOT, events, wait_for
from dslurm import slurm

ALIAS = "dslurm-test-login"
MARK_MODULE = '''"""Records which code this start runs, then runs the trainer (the remote ssh test)."""
import os
import runpy

MARK = "{mark}"

if __name__ == "__main__":
    if os.environ.get("RANK", "0") == "0":
        with open(os.path.join(os.environ["DSLURM_RUN_DIR"], "marks.txt"), "a") as f:
            f.write(os.environ.get("SLURM_RESTART_COUNT", "0") + " " + MARK + " " + __file__ + "\\n")
    runpy.run_module("train", run_name="__main__", alter_sys=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real sshd on loopback; yields an ssh config file whose Host ALIAS reaches it."""
    if not Path("/usr/sbin/sshd").exists():
        pytest.skip("no sshd: run scripts/install-system-deps.sh (openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port, user = _free_port(), getpass.getuser()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
        f"PidFile {d}/sshd.pid\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        f"PermitRootLogin prohibit-password\nAllowUsers {user}\nStrictModes no\n")
    pub = (d / "host_key.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}\n")
    cfg = d / "ssh_config"
    cfg.write_text(f"Host {ALIAS}\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n  IdentityFile {d}/user_key\n"
                   f"  IdentitiesOnly yes\n  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(d / "sshd.log", "w"))
    try:
        wait_for(lambda: subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", ALIAS, "true"],
                                        capture_output=True).returncode == 0, 20, "the test sshd")
        yield cfg
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def remote_site(tmp_path: Path, cfg: Path, slurm_conf: str, **remote: str) -> Path:
    """site-configs/local.yaml reached over ssh: its setup lines work on the login host and in jobs."""
    site = yaml.safe_load((ROOT / "site-configs/local.yaml").read_text())
    site["setup"] = [f"source {ROOT}/.venv/bin/activate", f"export SLURM_CONF={slurm_conf}"]
    site["login"] = ALIAS
    site["remote"] = {"workdir": str(tmp_path / "cluster-side"), "ssh_config": str(cfg), **remote}
    p = tmp_path / "remote-site.yaml"
    p.write_text(yaml.safe_dump(site))
    return p


def working_copy(tmp_path: Path) -> Path:
    """A separate checkout: this one's files (as they are now) in a git repository of its own."""
    wc = tmp_path / "laptop"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in (f for f in files if f and (ROOT / f).is_file()):
        (wc / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, wc / rel)
    (wc / "remote_mark.py").write_text(MARK_MODULE.format(mark="committed"))
    git = ["git", "-C", str(wc), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "laptop"], check=True)
    return wc


def demo_job(wc: Path) -> Path:
    job = yaml.safe_load((ROOT / "examples/jobs/tiny-2node.yaml").read_text())
    job.update(name="remote-demo", entry="remote_mark", preflight={"enabled": False},
               requeue={"max_restarts": 3})
    job["train"].update(steps=14, log_every=1, step_sleep_s=0.4)
    job["checkpoint"].update(interval=3, async_save=False)
    p = wc / "remote-demo.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


def _lines(proc: subprocess.Popen[str], into: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        into.append(line.rstrip("\n"))


@pytest.mark.timeout(600)
def test_remote_submit_watch_preempt_report_over_real_ssh(slurm_cluster, cli, sshd, tmp_path):
    env = slurm_cluster.env()
    site = remote_site(tmp_path, sshd, env["SLURM_CONF"])
    wc = working_copy(tmp_path)
    job = demo_job(wc)
    (wc / "remote_mark.py").write_text(MARK_MODULE.format(mark="snapshot-v1"))  # uncommitted: shipped too

    res = cli("submit", "--site", str(site), "--job", str(job), cwd=wc)
    assert res.returncode == 0, res.stderr
    assert f"on {ALIAS}" in res.stdout and "uncommitted" in res.stdout, res.stdout
    handle = wc / "checkpoints" / "remote-demo"
    h = json.loads((handle / "remote.json").read_text())
    job_id, run = h["job_ids"][-1], Path(h["run_dir"])
    assert run == tmp_path / "cluster-side" / "checkpoints" / "remote-demo"
    (wc / "remote_mark.py").write_text(MARK_MODULE.format(mark="working-copy-v2"))  # edited after the submit

    watched: list[str] = []
    watch = subprocess.Popen([str(ROOT / ".venv/bin/dslurm"), "watch", str(handle), "--interval", "1"], cwd=wc,
                             stdout=subprocess.PIPE, text=True)
    reader = threading.Thread(target=_lines, args=(watch, watched), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("running" in w and "saved 3" in w for w in watched), 240, "a save, watched over ssh")
        slurm.run_cmd(["scontrol", "requeue", str(job_id)], env=env)  # preemption: TERM, save, requeue
        assert watch.wait(timeout=300) == 0  # piped watch ends with the run
    finally:
        if watch.poll() is None:
            watch.kill()
    reader.join(timeout=10)
    assert "completed" in watched[-1] and "step 14/14" in watched[-1] and "starts 2" in watched[-1], watched
    views = [w.split("  ", 1)[1] for w in watched]
    assert all(a != b for a, b in zip(views, views[1:])), watched  # a line per change, none repeated
    assert any("starts 1" in v for v in views) and any("running" in v and "starts 2" in v for v in views), watched

    marks = (run / "marks.txt").read_text().split("\n")
    assert [m.split()[:2] for m in marks if m] == [["0", "snapshot-v1"], ["1", "snapshot-v1"]], marks
    assert all(f"/code/{h['code']}/remote_mark.py" in m for m in marks if m), marks
    assert [e["code"] for e in events(run, "exit")][-1] == 0

    status = cli("status", str(handle), cwd=wc)
    assert status.returncode == 0 and f"job_id: {job_id}" in status.stdout, status.stdout + status.stderr
    assert "restarts: 1" in status.stdout, status.stdout  # Slurm's own count, asked over ssh
    from dslurm.remote.handle import read
    from dslurm.remote.proxy import RemoteRun

    notebook = RemoteRun(read(handle))  # what dslurm.api.submit returns for a `login:` site
    assert notebook.status()["restarts"] == 1 and notebook.job_id == job_id
    report = cli("report", str(handle), cwd=wc)
    assert report.returncode == 0, report.stderr
    assert "COMPLETED" in report.stdout, report.stdout
    summary = json.loads((handle / "report.json").read_text())
    assert summary["restarts"] == 1 and summary["final_step"] == 14, summary
    assert (handle / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "step" in (handle / "ckpt-ls.txt").read_text()
    doctor, here = cli("doctor", str(handle), cwd=wc), cli("doctor", str(run))
    assert doctor.returncode == here.returncode and doctor.stdout == here.stdout != "", doctor.stdout + doctor.stderr


def test_remote_submit_names_missing_dslurm_and_submits_nothing(slurm_cluster, cli, sshd, tmp_path):
    site = remote_site(tmp_path, sshd, slurm_cluster.env()["SLURM_CONF"], dslurm="/nonexistent/dslurm")
    wc = working_copy(tmp_path)
    res = cli("submit", "--site", str(site), "--job", str(demo_job(wc)), cwd=wc)
    assert res.returncode != 0
    assert "/nonexistent/dslurm" in res.stderr and "remote.dslurm" in res.stderr, res.stderr
    assert not (tmp_path / "cluster-side").exists() and not (wc / "checkpoints" / "remote-demo").exists()
    assert os.path.isdir(wc)


def test_remote_unreachable_login_names_host_and_fix(cli, tmp_path):
    cfg = tmp_path / "closed_config"
    cfg.write_text(f"Host {ALIAS}\n  HostName 127.0.0.1\n  Port {_free_port()}\n")  # nothing listens there
    site = remote_site(tmp_path, cfg, "/nonexistent/slurm.conf")
    wc = working_copy(tmp_path)
    t0 = time.monotonic()
    res = cli("submit", "--site", str(site), "--job", str(demo_job(wc)), cwd=wc)
    assert res.returncode != 0 and time.monotonic() - t0 < 60
    assert f"login host '{ALIAS}'" in res.stderr and "cannot be reached" in res.stderr and "Fix:" in res.stderr
    assert not (wc / "checkpoints" / "remote-demo").exists()


def test_remote_bad_partition_is_named_with_its_fix_nothing_submitted(slurm_cluster, cli, sshd, tmp_path):
    """sbatch (the real one, there) refuses a partition: the laptop user reads the site file, the field, the
    cluster's partitions and the fix; no job, no handle, no frozen run; the fixed site then submits."""
    site = remote_site(tmp_path, sshd, slurm_cluster.env()["SLURM_CONF"])
    wc = working_copy(tmp_path)
    job = demo_job(wc)
    bad = tmp_path / "bad-site.yaml"
    bad.write_text(site.read_text().replace("partition: debug", "partition: nosuchpart"))
    res = cli("submit", "--site", str(bad), "--job", str(job), cwd=wc)
    assert res.returncode == 2, res.stdout + res.stderr
    assert (f"on login host '{ALIAS}': {bad}: field 'slurm.partition': partition 'nosuchpart' does not exist"
            in res.stderr), res.stderr
    assert "debug (default)" in res.stderr and f"Fix: set slurm.partition: debug in {bad}" in res.stderr
    run = tmp_path / "cluster-side" / "checkpoints" / "remote-demo"
    assert not (wc / "checkpoints" / "remote-demo").exists()  # no handle
    assert not [p.name for p in run.iterdir() if p.name not in ("code", "logs")], list(run.iterdir())
    res = cli("submit", "--site", str(site), "--job", str(job), "--dry-run", cwd=wc)  # fixed: it goes through
    assert res.returncode == 0 and "dry run on" in res.stdout, res.stdout + res.stderr
    assert (run / "job.sbatch").is_file()
