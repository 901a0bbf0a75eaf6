"""dslurm commands run on the cluster from another machine, over ssh (docs/remote.md).

submit: the run is validated here (a bad site or job fails before anything moves), the login
host is asked whether dslurm runs there, then ONE ssh call ships the code snapshot into
`<run_dir>/code/<digest>` and the resolved site and job (the site without `login`, the job
with the cluster's run dir), and runs `dslurm submit --code` there; the job's script runs that
snapshot on every start. The local handle (dslurm.remote.handle) remembers where the run is.

A refusal there (sbatch's, said as a field and its fix by dslurm.slurm.refusals, naming the files
as given here: `submit/origin.json`) comes back as the cluster said it (`failed_there`).
`submit --run-dir HANDLE` (`resubmit`) continues the run there from its frozen config and snapshot.

status, watch, doctor, ctl, cancel: the same command runs there on the run (its output streams back;
watch without a terminal prints a line per change, so it streams too). report: the text, the
JSON, the timeline PNG and `dslurm ckpt ls` come back as files into the local handle.
"""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dslurm.config import SiteConfig
from dslurm.config.resolve import Resolved, run_dir_for
from dslurm.durable import atomic_write_bytes
from dslurm.errors import UserError
from dslurm.remote import handle as hd
from dslurm.remote import ssh
from dslurm.remote.snapshot import MARKER, Snapshot, take, tar_bytes
from dslurm.run import CODE_CURRENT, JOB, SITE

FETCHED = ("report.txt", "report.json", "report.png", "ckpt-ls.txt")


def login_of(site: SiteConfig) -> ssh.Login:
    if site.login is None:
        raise UserError("this site has no `login`: its runs are on this machine")
    return ssh.Login(host=site.login, config=site.remote.ssh_config, dslurm=tuple(shlex.split(site.remote.dslurm)),
                     setup=tuple(site.setup))


def places(r: Resolved, cwd: str | Path) -> tuple[str, Path]:
    """(run dir on the cluster, local handle dir). Relative run dirs resolve against
    remote.workdir there and against `cwd` here; an absolute one keeps its name here, under
    `cwd/remote-runs/`, since the path is the cluster's."""
    there = run_dir_for(r.site, r.job, r.site.remote.workdir)
    here = run_dir_for(r.site, r.job, cwd)
    if here.is_absolute() and Path(cwd) not in here.parents:
        here = Path(cwd) / "remote-runs" / here.name
    if here.resolve() == there.resolve():  # the same machine, the same directory: the handle would hide the run
        raise UserError(f"the local handle and the cluster's run directory are both {there}. Fix: submit from "
                        "another directory than remote.workdir, or keep run directories relative")
    return str(there), here


def probe(login: ssh.Login) -> str:
    """`dslurm --version` there: the host answers, dslurm runs, and it is this dslurm's version
    (else a UserError with the fix). Laptop and cluster speak one protocol (the submit body, the
    handle, the JSON they pass), so two versions are refused rather than half understood."""
    from dslurm import __version__

    res = ssh.run(login, ssh.script(login, [f"{ssh.DSLURM} --version"]), timeout=120)
    if res.returncode != 0:
        raise UserError(f"login host {login.host!r}: `dslurm --version` failed there (exit {res.returncode}): "
                        f"{res.stderr.decode(errors='replace').strip()}. Fix: repair the dslurm install on the "
                        "cluster, or point remote.dslurm at a working one")
    said = res.stdout.decode(errors="replace").strip()
    if (why := version_mismatch(__version__, said)) is not None:
        raise UserError(f"login host {login.host!r}: {why}; nothing was done there. Fix: install dslurm "
                        f"{__version__} in the cluster's environment (the one remote.dslurm runs), or run the "
                        "cluster's version here")
    return said


def version_mismatch(here: str, there_said: str) -> str | None:
    """Why `dslurm --version`'s answer there (`dslurm X`) is not this dslurm's version; None when
    it is. Pure."""
    there = there_said.split()[-1] if there_said.split() else "?"
    if there == here:
        return None
    return f"dslurm there is version {there} ({there_said!r}), here {here}"


@dataclass(frozen=True, slots=True)
class Submitted:
    handle: hd.Handle
    note: str | None
    """the cluster's reason for submitting nothing (a run already complete), else None"""
    script: str | None
    job_ids: tuple[int, ...] = ()
    """the jobs this submit queued (the handle lists the run's jobs so far)"""


def submit_body(run_dir: str, code: str, flags: list[str]) -> list[str]:
    """The remote script after setup: unpack stdin (the snapshot under code/<name>, site and job
    under submit/) into a temp dir in the run dir, move the code into place unless a complete
    copy is there, submit from the snapshot directory, then drop the temp dir. Pure."""
    run, name = shlex.quote(run_dir), shlex.quote(code)
    return [
        "set -e",
        f"mkdir -p {run}/code",
        f'tmp=$(mktemp -d {run}/.incoming.XXXXXX)',
        "trap 'rm -rf \"$tmp\"' EXIT",
        'tar -xf - -C "$tmp"',
        f"if [ ! -f {run}/code/{name}/{MARKER} ]; then rm -rf {run}/code/{name}; "
        f'mv "$tmp/code/{code}" {run}/code/{name}; fi',
        f"cd {run}/code/{name}",
        "set +e",
        f'{ssh.DSLURM} submit --site "$tmp/submit/{SITE}" --job "$tmp/submit/{JOB}" --code {run}/code/{name} '
        f'--origin "$tmp/submit/origin.json" --json {ssh.quote_words(flags)}',
    ]


def resubmit_body(run_dir: str, code: str | None, flags: list[str]) -> list[str]:
    """The remote script of `submit --run-dir HANDLE`: the run must be there; with `code` (a new
    snapshot on stdin, under code/<name>) it is moved into place as on a first submit, else the
    snapshot the run was last submitted with (code/CURRENT) is named again; submit from that
    snapshot's directory. Pure."""
    run = shlex.quote(run_dir)
    missing = shlex.quote(f"dslurm submit: error: {run_dir}: no {JOB} there, so no run dslurm submitted. "
                          "Fix: check the handle's run_dir (remote.json), or submit with --site and --job")
    lines = ["set -e", f"if [ ! -f {run}/{JOB} ]; then echo {missing} >&2; exit 2; fi"]
    if code is not None:
        name = shlex.quote(code)
        lines += [
            f'tmp=$(mktemp -d {run}/.incoming.XXXXXX)',
            "trap 'rm -rf \"$tmp\"' EXIT",
            'tar -xf - -C "$tmp"',
            f"mkdir -p {run}/code",
            f"if [ ! -f {run}/code/{name}/{MARKER} ]; then rm -rf {run}/code/{name}; "
            f'mv "$tmp/code/{code}" {run}/code/{name}; fi',
            f"snap={name}",
        ]
    else:
        lines += [f'snap=$(cat {run}/code/{CODE_CURRENT} 2>/dev/null || true)']
    lines += [
        'if [ -n "$snap" ] && [ -d ' + f'{run}/code/"$snap" ]; then cd {run}/code/"$snap"; '
        f'code=(--code {run}/code/"$snap"); else cd {run}; code=(); fi',
        "set +e",
        f'{ssh.DSLURM} submit --run-dir {run} "${{code[@]}}" --json {ssh.quote_words(flags)}',
    ]
    return lines


def failed_there(login: ssh.Login, returncode: int, stderr: bytes) -> UserError:
    """The cluster's `dslurm submit` refused: its message as it said it (the site field and the fix,
    dslurm.slurm.refusals), with the host named; what it said before (warnings) goes to stderr."""
    from dslurm.errors import SlurmError

    err = stderr.decode(errors="replace")
    mark = "dslurm submit: error: "
    at = err.rfind(mark)
    if at < 0:
        return UserError(f"login host {login.host!r}: dslurm submit failed there (exit {returncode}); nothing "
                         f"was submitted:\n{err.strip()}")
    sys.stderr.write(err[:at])
    kind = SlurmError if returncode == SlurmError.exit_code else UserError
    return kind(f"on login host {login.host!r}: {err[at + len(mark):].strip()}")


def _result(login: ssh.Login, res: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    if res.returncode != 0:
        raise failed_there(login, res.returncode, res.stderr or b"")
    sys.stderr.write((res.stderr or b"").decode(errors="replace"))  # the cluster's warnings (a busy run dir, the plan)
    try:
        out: dict[str, Any] = json.loads(res.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        said = res.stdout.decode(errors="replace")
        raise UserError(f"login host {login.host!r}: dslurm submit there printed no result: {said!r}. "
                        "Fix: install the same dslurm version there") from None
    return out


def submit(r: Resolved, snap: Snapshot | None = None, *, cwd: str | Path, chain: int = 1, force: bool = False,
           strict: bool = False, dry_run: bool = False, origin: dict[str, Any] | None = None) -> Submitted:
    """Ship and submit `r` on its site's cluster; write the local handle. `origin`: the site and
    job files and overrides as named here, so that a refusal there names what the user edits."""
    from dslurm.config import yaml12
    from dslurm.config.schema import to_dict

    login = login_of(r.site)
    there, here = places(r, cwd)
    snap = snap or take("git", cwd)
    probe(login)
    site_data = to_dict(r.site)
    site_data["login"] = None  # there, the site is local
    job_data = to_dict(r.job)
    job_data["checkpoint"]["run_dir"] = there
    # the submit inputs there carry the run directory's own names (dslurm/run.py)
    files = {f"submit/{SITE}": yaml12.dump(site_data).encode(), f"submit/{JOB}": yaml12.dump(job_data).encode()}
    flags = [f"--chain={chain}", *(["--force"] if force else []), *(["--strict"] if strict else []),
             *(["--dry-run"] if dry_run else [])]
    body = submit_body(there, snap.name, flags)
    files["submit/origin.json"] = json.dumps(origin or {"site": r.site_path, "job": r.job_path}).encode()
    res = ssh.run(login, ssh.script(login, body), input=tar_bytes(snap, files, prefix=f"code/{snap.name}/"))
    out = _result(login, res)
    ids = tuple(int(i) for i in out.get("job_ids") or [])
    h = hd.Handle(path=here, login=login, run_dir=there, job_ids=ids, code=snap.name, source=snap.source)
    if h.job_ids:
        hd.write(h)
    return Submitted(h, out.get("note"), out.get("script"), ids)


def resubmit(h: hd.Handle, snap: Snapshot | None = None, *, chain: int = 1, force: bool = False,
             strict: bool = False, dry_run: bool = False, overrides: list[str] | None = None,
             site_overrides: list[str] | None = None) -> Submitted:
    """`dslurm submit --run-dir HANDLE`: continue the run on its cluster from its frozen config there
    (a completed run is refused there unless `force`); with `snap` the job runs that code from
    now on, else the snapshot it ran. The handle gains the new job ids."""
    flags = [f"--chain={chain}", *(["--force"] if force else []), *(["--strict"] if strict else []),
             *(["--dry-run"] if dry_run else []), *(f"--set={o}" for o in overrides or ()),
             *(f"--site-set={o}" for o in site_overrides or ())]
    probe(h.login)
    body = resubmit_body(h.run_dir, snap.name if snap else None, flags)
    data = tar_bytes(snap, prefix=f"code/{snap.name}/") if snap else None
    out = _result(h.login, ssh.run(h.login, ssh.script(h.login, body), input=data))
    ids = tuple(int(i) for i in out.get("job_ids") or [])
    new = replace(h, job_ids=(*h.job_ids, *ids), code=snap.name if snap else h.code,
                  source=snap.source if snap else h.source)
    if ids:
        hd.write(new)
    return Submitted(new, out.get("note"), out.get("script"), ids)


def passthrough(h: hd.Handle, argv: list[str]) -> int:
    """Run `dslurm ARGV` there; its output streams here. Returns its exit code."""
    res = ssh.run(h.login, ssh.script(h.login, [f"exec {ssh.DSLURM} " + ssh.quote_words(argv)]), capture=False)
    return res.returncode


def fetch_body(run_dir: str, png: bool) -> list[str]:
    """Report text, JSON (and the PNG), `ckpt ls`, into a temp dir; the dir as a tar on stdout. Pure."""
    run = shlex.quote(run_dir)
    draw = '--png "$out/report.png"' if png else "--no-png"
    return [
        'out=$(mktemp -d)',
        "trap 'rm -rf \"$out\"' EXIT",
        f'{ssh.DSLURM} report {run} --no-png > "$out/report.txt" 2> "$out/errors.txt"',
        f'{ssh.DSLURM} report {run} --json {draw} > "$out/report.json" 2>> "$out/errors.txt"',
        f'{ssh.DSLURM} ckpt ls {run} > "$out/ckpt-ls.txt" 2>> "$out/errors.txt"',
        'tar -cf - -C "$out" .',
    ]


def fetch_report(h: hd.Handle, png: bool = True) -> dict[str, Path]:
    """Bring the run's report back into the handle directory; name -> local path."""
    res = ssh.run(h.login, ssh.script(h.login, fetch_body(h.run_dir, png)), timeout=600)
    if res.returncode != 0:
        raise UserError(f"login host {h.login.host!r}: the report could not be made there (exit {res.returncode}): "
                        f"{res.stderr.decode(errors='replace').strip()}")
    got: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(res.stdout), mode="r:") as tar:
        for m in tar.getmembers():
            name = Path(m.name).name
            if m.isfile() and name in (*FETCHED, "errors.txt"):
                f = tar.extractfile(m)
                got[name] = f.read() if f is not None else b""
    if not got.get("report.txt", b"").strip():
        raise UserError(f"{h.run_dir} on {h.login.host}: no report: "
                        f"{got.get('errors.txt', b'').decode(errors='replace').strip() or 'nothing said'}")
    out = {}
    for name in FETCHED:
        if name in got:
            atomic_write_bytes(h.path / name, got[name])
            out[name] = h.path / name
    return out


class RemoteRun:
    """What `dslurm.api.submit` returns for a site with `login:` (a notebook's handle)."""

    def __init__(self, handle: hd.Handle) -> None:
        self.handle = handle
        self.job_id = handle.job_id
        self.run_dir = handle.path  # the local handle; the run itself is handle.run_dir on the cluster

    def __repr__(self) -> str:
        return f"RemoteRun(job {self.job_id} on {self.handle.login.host}: {self.handle.run_dir})"

    def status(self) -> dict[str, object]:
        """`dslurm status JOB --json`, asked there."""
        h = self.handle
        res = ssh.run(h.login, ssh.script(h.login, [f"exec {ssh.DSLURM} status {h.job_id} --json"]), timeout=120)
        if res.returncode != 0:
            raise UserError(f"{h.login.host}: dslurm status {h.job_id} failed: {res.stderr.decode(errors='replace')}")
        data: dict[str, object] = json.loads(res.stdout)
        return data

    def report(self, png: bool = True) -> dict[str, object]:
        """The run's report (`dslurm report --json`), brought back into the handle with the PNG."""
        got = fetch_report(self.handle, png=png)
        data: dict[str, object] = json.loads(got["report.json"].read_text())
        return data
