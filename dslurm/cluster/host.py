"""The two changes `up` makes to this machine outside its state dir, and how `down` undoes them:
a line in /etc/hosts marked `# dslurm-cluster <state dir>`, and /etc/slurm/slurm.conf as a symlink
to the state dir's slurm.conf (an existing file kept as slurm.conf.dslurm-orig and restored).
Each change is recorded in `cluster.json` as soon as it is made, so `down` undoes exactly it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dslurm.cluster import conf as cc
from dslurm.cluster.proc import write_in_place_or_atomic
from dslurm.cluster.state import is_up, save
from dslurm.errors import UserError

log = logging.getLogger(__name__)

ETC_CONF = Path("/etc/slurm/slurm.conf")
ETC_BACKUP = Path("/etc/slurm/slurm.conf.dslurm-orig")
HOSTS = Path("/etc/hosts")


def install_system_changes(spec: cc.ClusterSpec, rec: dict[str, Any]) -> None:
    sdir, changes = spec.state_dir, rec["changes"]
    line = cc.hosts_line(spec.nodes, sdir)
    hosts = HOSTS.read_text() if HOSTS.exists() else ""
    marker = f"# dslurm-cluster {sdir}"
    kept = [ln for ln in hosts.splitlines() if not ln.endswith(marker)]  # stale lines of ours
    write_in_place_or_atomic(HOSTS, "\n".join([*kept, line]) + "\n")
    changes["hosts_line"] = line
    save(sdir, rec)
    target = sdir / "etc" / "slurm.conf"
    if ETC_CONF.is_symlink():
        current = Path(os.readlink(ETC_CONF))
        other = current.parent.parent
        if current != target and other != sdir and is_up(other):
            raise UserError(f"another dslurm cluster is running from {other}; stop it with "
                            f"`dslurm cluster down --state-dir {other}`")
        ETC_CONF.unlink()  # ours, or a stale link of a crashed run
    elif ETC_CONF.exists():
        if ETC_BACKUP.exists():
            raise UserError(f"both {ETC_CONF} and {ETC_BACKUP} exist; move one away")
        ETC_CONF.rename(ETC_BACKUP)
        log.info("kept the existing %s as %s (restored by `cluster down`)", ETC_CONF, ETC_BACKUP)
    ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
    ETC_CONF.symlink_to(target)
    changes["etc_conf_link"] = str(target)
    save(sdir, rec)


def undo_system_changes(changes: dict[str, Any], sdir: Path) -> None:
    line = changes.get("hosts_line")
    if line and HOSTS.exists():
        lines = HOSTS.read_text().splitlines()
        if line in lines:
            write_in_place_or_atomic(
                HOSTS, "".join(ln + "\n" for ln in lines if ln != line))
    link = changes.get("etc_conf_link")
    if link and ETC_CONF.is_symlink() and os.readlink(ETC_CONF) == link:
        ETC_CONF.unlink()
        if ETC_BACKUP.exists():
            ETC_BACKUP.rename(ETC_CONF)
