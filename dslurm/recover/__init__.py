"""Recovery inside the allocation: which nodes train next after a failed job step. Pure.

A job with `spares: k` holds `nodes + k` whole nodes (`--no-kill`). `dslurm supervise`
(dslurm/recover/supervise.py) runs training on `nodes` of them; when a step ends in a failure
that a requeue would retry, it asks `plan_recovery` what to do instead of going through the
queue:

- no node at fault (a rank crashed, a process was killed): the same nodes again;
- nodes at fault (Slurm reports them down, the burn-in rejected them): swap in as many healthy
  spares as were lost;
- too few spares: the job's `on_spares_exhausted` decides: `shrink` goes on with the healthy
  nodes left (fewer data-parallel ranks, the same global batch through more gradient
  accumulation: `shrink_grad_accum`), `requeue` goes back through the queue without the bad nodes.

Which nodes are at fault is read from the facts (`nodes_at_fault`), never from srun's code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dslurm import endings as E
from dslurm.config.resolve import Resolved, resolve


@dataclass(frozen=True, kw_only=True, slots=True)
class Nodes:
    """The allocation's nodes as the supervisor sees them."""

    training: tuple[str, ...]
    """the nodes the next job step trains on"""
    spares: tuple[str, ...] = ()
    """healthy nodes waiting, in the order they are taken"""
    bad: tuple[str, ...] = ()
    """nodes taken out (down, rejected, blocklisted): never used again by this run"""


def initial_nodes(alloc: Sequence[str], nodes: int, blocked: Iterable[str] = ()) -> Nodes:
    """The first `nodes` usable hosts of the allocation train, the rest wait as spares; hosts on
    the run's blocklist do neither."""
    blocked = set(blocked)
    ok = [h for h in alloc if h not in blocked]
    return Nodes(training=tuple(ok[:nodes]), spares=tuple(ok[nodes:]),
                 bad=tuple(h for h in alloc if h in blocked))


def nodes_at_fault(ending: E.Ending, training: Sequence[str], *, down: Iterable[str] = (),
                   blocklist: Iterable[str] = ()) -> list[str]:
    """The training nodes that ended the step, from the facts: those Slurm reports down (any
    failure), the node a node failure names, and for a burn-in rejection the nodes the burn-in
    just put on the run's blocklist. A crash with every node up is nobody's node: []."""
    bad = set(down)
    if ending.cls == E.NODE_FAILURE and ending.origin_host:
        bad.add(ending.origin_host)
    if ending.cls == E.BURNIN_REJECTED:
        bad |= set(blocklist)
    return [h for h in training if h in bad]


Action = Literal["same_nodes", "spare", "shrink", "requeue"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    action: Action
    nodes: Nodes
    """the nodes after the recovery (for requeue: the survivors, informational)"""
    removed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    reason: str = ""


def plan_recovery(cur: Nodes, bad: Iterable[str], *, wanted: int,
                  on_exhausted: Literal["requeue", "shrink"], spares_down: Iterable[str] = ()) -> Plan:
    """What to do after a failed step that the restart budget allows to retry. `wanted`: the
    job's training nodes; `spares_down`: spares Slurm reports down now (skipped, and taken out)."""
    bad_now = [h for h in cur.training if h in set(bad)]
    lost_spares = [h for h in cur.spares if h in set(spares_down)]
    spares = [h for h in cur.spares if h not in set(spares_down)]
    keep = [h for h in cur.training if h not in bad_now]
    need = max(0, wanted - len(keep))
    take = spares[:need]
    out = tuple(bad_now)
    gone = (*cur.bad, *bad_now, *lost_spares)
    after = Nodes(training=tuple(keep + take), spares=tuple(spares[len(take):]), bad=gone)
    if not bad_now and (len(keep) >= wanted or not spares):  # (fewer than wanted: already shrunk)
        return Plan(action="same_nodes", nodes=after, reason="no node at fault: the same nodes again")
    if len(take) == need:
        return Plan(action="spare", nodes=after, removed=out, added=tuple(take),
                    reason=f"{', '.join(out) or 'no node'} out, spare {', '.join(take) or '-'} in")
    short = f"{len(keep) + len(take)} healthy node(s) left of {wanted}, no spare left"
    if on_exhausted == "shrink" and keep + take:
        return Plan(action="shrink", nodes=after, removed=out, added=tuple(take),
                    reason=f"{short}: shrink to {len(keep) + len(take)} node(s)")
    return Plan(action="requeue", nodes=after, removed=out, added=(),
                reason=f"{short}: requeue without {', '.join(gone) or 'them'}")


def shrink_grad_accum(r: Resolved, nodes: int) -> int:
    """The gradient accumulation that keeps the job's global batch and micro-batch on `nodes`
    nodes (fewer data-parallel ranks). Resolves the smaller job the way the trainer will (its
    world decides `nodes`), so a layout that cannot shrink (a fixed dp_shard, tp or pp that no
    longer divides) raises UserError naming the numbers."""
    from dslurm.config.layout import Layout

    job, par = r.job, r.job.parallel
    micro = r.layout.micro_batch(job.train.global_batch, job.train.grad_accum)
    world = nodes * r.procs_per_node
    where = f"shrink to {nodes} node(s): "
    small = Layout.for_world(world, pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp,
                             tp=par.tp, microbatches=par.microbatches, where=where)
    accum = small.grad_accum_for(job.train.global_batch, micro, where=where)
    shrunk = dataclasses.replace(job, nodes=nodes, train=dataclasses.replace(job.train, grad_accum=accum))
    resolve(r.site, shrunk, site_path=r.site_path, job_path=r.job_path)  # every other rule
    return accum
