"""Slurm host lists (`node[01-04],gpu7`) expanded into host names, with python-hostlist.

Below every package that reads a node list (the launcher's SLURM_* ranks, requeue-me's node
states, the site's discovery, sbatch's refusals explained): one expander, one error message.
"""

from __future__ import annotations

import hostlist

from dslurm.errors import UserError


def expand_hosts(nodelist: str, var: str = "SLURM_JOB_NODELIST") -> list[str]:
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise UserError(f"environment variable {var}={nodelist!r} is not a valid host list ({exc})") from None
    if not hosts:
        raise UserError(f"environment variable {var}={nodelist!r} names no hosts")
    return [str(h) for h in hosts]
