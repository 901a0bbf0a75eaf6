"""The local handle of a run that lives on a cluster reached over ssh.

`dslurm submit` with a `login:` site writes `<local run dir>/remote.json`: the login (host,
ssh config, the dslurm command and setup lines the site had at submit), the run directory on
the cluster, the job ids and the code snapshot. `status`, `watch`, `report`, `doctor`, `ctl`,
`cancel` and `submit --run-dir` given that local directory run on the cluster through it; `report` also leaves what
it brought back (report.txt, report.json, report.png, ckpt-ls.txt) next to it. Torch-free and
cheap: every one of those commands asks `read` first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError
from dslurm.remote.ssh import Login

FILENAME = "remote.json"


@dataclass(frozen=True, slots=True)
class Handle:
    path: Path
    """the local directory"""
    login: Login
    run_dir: str
    """the run directory on the cluster"""
    job_ids: tuple[int, ...]
    code: str
    """the snapshot's directory name under `<run_dir>/code/` (its digest's first 16 hex digits)"""
    source: str = ""

    @property
    def job_id(self) -> int | None:
        return self.job_ids[-1] if self.job_ids else None


def write(h: Handle) -> Path:
    h.path.mkdir(parents=True, exist_ok=True)
    data = {"login": h.login.host, "ssh_config": h.login.config, "dslurm": list(h.login.dslurm),
            "setup": list(h.login.setup), "run_dir": h.run_dir, "job_ids": list(h.job_ids), "code": h.code,
            "source": h.source}
    atomic_write_text(h.path / FILENAME, json.dumps(data, indent=1) + "\n")
    return h.path / FILENAME


def read(path: str | Path) -> Handle | None:
    """The handle in directory `path`; None when there is none (a run directory on this machine,
    or not a directory at all: the caller says what it wanted instead)."""
    if not Path(path).is_dir():
        return None
    p = Path(path) / FILENAME
    try:
        data = json.loads(p.read_text())
        login = Login(host=str(data["login"]), config=data.get("ssh_config"),
                      dslurm=tuple(str(w) for w in data.get("dslurm") or ["dslurm"]),
                      setup=tuple(str(s) for s in data.get("setup") or []))
        return Handle(path=Path(path), login=login, run_dir=str(data["run_dir"]),
                      job_ids=tuple(int(i) for i in data.get("job_ids") or []), code=str(data.get("code", "")),
                      source=str(data.get("source", "")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{p}: not a handle dslurm wrote ({exc}). Fix: submit again, or remove the file") from None
