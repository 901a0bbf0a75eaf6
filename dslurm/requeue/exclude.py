"""Requeue a job off the run's blocklist, never into a queue it can never leave.

The run's blocklist (dslurm/run.py) keeps nodes found bad off its later starts: a requeue sets the
job's ExcNodeList. But a blocklist can outgrow the partition: a 2+1 job on a 3-node partition that
blocklisted one node is excluded from a node it needs, and Slurm keeps it PENDING (BadConstraints)
for ever, silently. (The chaos soak found it: a node whose step was killed did not answer the
probe and was swapped out as lost; the next requeue left the job unplaceable.) So the exclusion is
cut to what the partition can spare. Two rooms bound it:

- *ever*: Slurm calls a job never runnable when the partition's nodes, whatever their state, less
  the excluded ones, are fewer than it needs. No exclusion may exceed `members - need`, not even
  of nodes Slurm will not schedule now: a down, drained or silent node comes back (resumed, its
  slurmd re-registered after a slurmctld restart: chaos seed 4444 excluded two nodes that only had
  not registered yet), and an ExcNodeList is never revisited while the job pends.
- *now*: a node Slurm schedules today counts against the job's chance to start now; one it will
  not schedule (down, drained, failing, not responding) costs nothing now. So those are kept
  excluded first, then schedulable ones while the job still has its nodes now.

The rest are *readmitted* for this requeue, said in the batch log and the ledger
(`blocklist_waived`). A readmitted node Slurm will not schedule keeps the job waiting for it
(a reason a wait clears); a readmitted node that is really bad fails its start again, which the
endings and the restart budget deal with; a job pending for ever is nobody's. The blocklist file
itself is left as it is: a larger allocation or another partition still honours it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

UNSCHEDULABLE = ("down", "drain", "fail", "maint", "future", "inval", "unknown", "reboot", "power")
"""sinfo state words (any prefix, any suffix flag) of a node Slurm places no job on"""


@dataclass(frozen=True, slots=True)
class Exclusion:
    exclude: list[str]
    """the nodes the requeued job is kept off"""
    readmitted: list[str] = field(default_factory=list)
    """blocklisted nodes let back for this requeue: without them the job could never be placed"""
    reason: str = ""


def schedulable(state: str) -> bool:
    """Can Slurm place a job on a node in this sinfo state (idle, mixed, allocated, completing)?"""
    s = state.lower().rstrip("*~#!%$@^-+")
    return not s.startswith(UNSCHEDULABLE)


def placeable_exclusion(blocked: Sequence[str], nodes: Sequence[Mapping[str, object]],
                        partition: str | None, need: int) -> Exclusion:
    """The exclusion a requeue of a job needing `need` nodes of `partition` can carry (see the
    module doc). `nodes` as `dslurm.slurm.nodes()` gives them (name, state, responding,
    partitions). Pure.

    With no partition named, or none of its nodes listed, nothing is known to cut by: every
    blocklisted node stays excluded (the old rule). A blocklisted node outside the partition is
    kept excluded and counts for nothing. Readmitted first, within each kind: the blocklisted
    nodes that sort last (the list holds no order of finding).
    """
    blocked = sorted(set(blocked))
    if not blocked or need < 1 or not partition:
        return Exclusion(blocked)
    members = [n for n in nodes if partition in (n.get("partitions") or [])]  # type: ignore[operator]
    if not members:
        return Exclusion(blocked)
    names = {str(n["name"]) for n in members}
    usable = {str(n["name"]) for n in members
              if schedulable(str(n.get("state", ""))) and n.get("responding", True)}
    room_ever = max(0, len(names) - need)
    room_now = max(0, len(usable) - need)
    idle_blocked = [b for b in blocked if b in names and b not in usable]  # out of Slurm's use now
    usable_blocked = [b for b in blocked if b in usable]
    keep = idle_blocked[:room_ever]
    keep += usable_blocked[:min(room_now, room_ever - len(keep))]
    readmit = [b for b in blocked if b in names and b not in keep]
    if not readmit:
        return Exclusion(blocked)
    exclude = [b for b in blocked if b not in readmit]
    cost = ("pending for ever (BadConstraints)" if len(idle_blocked) + len(usable_blocked) > room_ever
            else "from starting on the nodes Slurm schedules now")
    return Exclusion(exclude, readmit, (
        f"partition {partition} has {len(names)} node(s), {len(usable)} schedulable now, and the job needs "
        f"{need}: excluding every blocklisted node ({', '.join(blocked)}) would keep it {cost}; "
        f"{', '.join(readmit)} readmitted for this requeue, the blocklist file unchanged"))


def requeue_excluding(job: str, hosts: list[str]) -> None:
    """Requeue and keep the job off `hosts`. Slurm refuses ExcNodeList on a running job,
    so: requeue held, update while pending, release. SIGTERM (Slurm ends the old run as
    it requeues) is ignored meanwhile: dying between hold and release would strand the
    job held."""
    import signal
    import time

    from dslurm import slurm
    from dslurm.errors import SlurmError

    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        slurm.run_cmd(["scontrol", "requeuehold", job])
        try:
            for attempt in range(40):  # the job may still be completing for a moment
                res = slurm.run_cmd(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(hosts)}"],
                                    check=False)
                if res.returncode == 0:
                    break
                time.sleep(0.25)
            else:
                raise SlurmError(f"could not exclude {','.join(hosts)} from job {job}: {res.stderr.strip()}")
        finally:
            slurm.run_cmd(["scontrol", "release", job])
    finally:
        signal.signal(signal.SIGTERM, old)
