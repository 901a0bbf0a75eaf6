"""sbatch's rejections, said as dslurm says a bad field: the file, the field, its value, the fix.

`explain(reason, r, origin, facts)` is pure: sbatch's own words (its stderr), the resolved run,
where the fields came from (`Origin`: the site and job files a person edits, the --site-set and
--set given) and what the cluster has (`ClusterFacts`, read by `cluster_facts`, the thin shell:
`scontrol show partition|node`, `sacctmgr show assoc`, each optional) -> the message, or None for
a rejection it does not know (the caller then says sbatch's words as they are). Recorded sbatch
messages of Slurm 22.05 drive the unit tests (tests/unit/test_sbatch_errors.py).
"""

from __future__ import annotations

import getpass
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dslurm.config import format_time, parse_time
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.slurm import facts as F

DISCOVER = "`dslurm site discover --partition P` writes a site file from what Slurm says; `dslurm site check` tests one"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the fields of a submit came from, as the person who submitted would name them."""

    site_file: str
    job_file: str
    site_sets: tuple[str, ...] = ()
    """--site-set KEY=VALUE as given"""
    sets: tuple[str, ...] = ()
    """--set KEY=VALUE as given"""

    def _set(self, key: str, site: bool) -> str | None:
        for o in reversed(self.site_sets if site else self.sets):
            if o.partition("=")[0].strip() == key:
                return o
        return None

    def where(self, key: str, site: bool = True) -> str:
        """`--site-set slurm.partition=x` or `site.yaml: field 'slurm.partition'`."""
        typed = self._set(key, site)
        if typed is not None:
            return f"--site-set {typed}" if site else f"--set {typed}"
        return f"{self.site_file if site else self.job_file}: field '{key}'"

    def shown(self, key: str, value: object, site: bool = True) -> str:
        """`node.gpus=9 (from --site-set)` or `node.gpus=9 (site.yaml)`."""
        typed = self._set(key, site)
        src = ("--site-set" if site else "--set") if typed is not None else (self.site_file if site else self.job_file)
        return f"{key}={value} ({src})"

    def fix(self, key: str, value: str, site: bool = True) -> str:
        """How to give `key` the value `value` where it came from."""
        if self._set(key, site) is not None:
            return f"give {'--site-set' if site else '--set'} {key}={value}"
        return f"set {key}: {value} in {self.site_file if site else self.job_file}"


@dataclass(frozen=True, slots=True)
class Assoc:
    account: str
    partition: str
    """'' = every partition"""
    qos: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClusterFacts:
    """What the cluster has; None where it could not be read."""

    partitions: tuple[F.Partition, ...] | None = None
    nodes: tuple[F.Node, ...] | None = None
    """the nodes of the site's partition"""
    assoc: tuple[Assoc, ...] | None = None
    """the user's associations (None: no accounting, or sacctmgr failed)"""
    user: str = "$USER"


def sbatch_said(text: str) -> str:
    """sbatch's own words, one line: its `error:` lines without the `sbatch: error:` prefix."""
    lines = [re.sub(r"^\s*sbatch:\s*error:\s*", "", ln).strip() for ln in text.splitlines()
             if "error" in ln.lower() or "failure" in ln.lower()]
    lines = [ln for ln in lines if ln] or [ln.strip() for ln in text.splitlines() if ln.strip()]
    seen: list[str] = []
    for ln in lines:
        if ln not in seen:
            seen.append(ln)
    return "; ".join(seen) or "(no message)"


def _partition_list(parts: Sequence[F.Partition]) -> str:
    return ", ".join(f"{p.name}{' (default)' if p.default else ''}"
                     f"{'' if p.state == 'UP' else f' [{p.state}]'}" for p in parts)


def _shapes(nodes: Sequence[F.Node]) -> str:
    groups: dict[F.Shape, int] = {}
    for n in nodes:
        groups[n.shape] = groups.get(n.shape, 0) + 1
    return "; ".join(f"{k} x {s.describe()}" for s, k in sorted(groups.items(), key=lambda kv: -kv[1]))


def _accounts(assoc: Sequence[Assoc]) -> str:
    by: dict[str, list[str]] = {}
    for a in assoc:
        by.setdefault(a.account, []).append(a.partition or "any partition")
    return ", ".join(f"{acct} ({', '.join(sorted(set(ps)))})" for acct, ps in by.items())


def explain(reason: str, r: Resolved, origin: Origin, facts: ClusterFacts) -> str | None:
    """The message for sbatch's rejection `reason` of `r`'s job; None when it is not one known here."""
    said = sbatch_said(reason)
    low = reason.lower()
    head = f"sbatch refused the job ({said}); nothing was submitted"
    s = r.site.slurm
    part = next((p for p in facts.partitions or () if p.name == s.partition), None)
    if "invalid partition" in low:
        parts = [p for p in facts.partitions or () if p.state == "UP"] or list(facts.partitions or ())
        if parts:
            pick = next((p for p in parts if p.default), parts[0]).name
            fix = f"{origin.fix('slurm.partition', pick)} or another of them"
            have = f" This cluster's partitions (scontrol show partition): {_partition_list(facts.partitions or ())}."
        else:
            fix, have = "name a partition `sinfo -s` lists in slurm.partition", ""
        return (f"{origin.where('slurm.partition')}: partition {s.partition!r} does not exist on this cluster: "
                f"{head}.{have} Fix: {fix}")
    if "account/partition combination" in low or "invalid account" in low:
        acct = s.account or "(none: your default account)"
        mine = [a for a in facts.assoc or () if a.partition in ("", s.partition)]
        if facts.assoc:
            have = f" Your accounts (sacctmgr show assoc user={facts.user}): {_accounts(facts.assoc)}."
        else:
            have = f" Your accounts: `sacctmgr show assoc user={facts.user} format=account,partition,qos`."
        fix = (origin.fix("slurm.account", sorted({a.account for a in mine})[0]) + " (or another of yours that "
               f"may use partition {s.partition})" if mine else
               f"set slurm.account to an account of yours that may use partition {s.partition}")
        return (f"{origin.where('slurm.account')}: account {acct} with partition {s.partition!r} "
                f"({origin.where('slurm.partition')}) is not one Slurm lets you use: {head}.{have} Fix: "
                f"{fix}, or choose a partition that account may use")
    if "invalid qos" in low:
        qos = sorted({q for a in facts.assoc or () if a.partition in ("", s.partition) for q in a.qos})
        have = f" Your QOS: {', '.join(qos)}." if qos else ""
        fix = (origin.fix("slurm.qos", qos[0]) + " (or another of them)" if qos else
               f"set slurm.qos to a QOS `sacctmgr show assoc user={facts.user}` lists")
        return (f"{origin.where('slurm.qos')}: QOS {s.qos!r} is not one you may use (with account "
                f"{s.account or 'default'}): {head}.{have} Fix: {fix}, or remove it (your default QOS)")
    if "qos policy" in low or "association policy" in low or "accounting/qos" in low:
        return (f"the job asks for {r.alloc_nodes} node(s) for {r.time_str} under account {s.account or 'default'} "
                f"and QOS {s.qos or 'default'}, over a limit of that account or QOS: {head}. Fix: lower the nodes "
                f"({origin.where('nodes', site=False)}) or the time, or choose another "
                f"{origin.where('slurm.qos')} / {origin.where('slurm.account')} "
                f"(`sacctmgr show assoc user={facts.user}`, `sacctmgr show qos`)")
    if "time limit" in low:
        return _time(r, origin, part, head)
    if "node configuration is not available" in low or "node count specification" in low or \
            "partition configuration not available" in low:
        return _nodes(r, origin, part, facts.nodes, head)
    if "invalid feature" in low:
        feats = sorted({f for n in facts.nodes or () for f in n.features})
        have = f" Partition {s.partition}'s nodes have: {', '.join(feats)}." if feats else \
            f" Partition {s.partition}'s nodes declare no features."
        fix = origin.fix("slurm.constraint", feats[0]) + " (or another of them, or null)" if feats else \
            origin.fix("slurm.constraint", "null")
        return (f"{origin.where('slurm.constraint')}: constraint {s.constraint!r} names a feature no node has: "
                f"{head}.{have} Fix: {fix}")
    if "generic resource" in low or "trackable resource" in low or "invalid gres" in low:
        gpus = max((n.shape.gpus for n in facts.nodes or ()), default=None)
        have = "" if gpus is None else f" Partition {s.partition}'s nodes have at most {gpus} GPU(s) (gres gpu)."
        return (f"{origin.site_file}: {origin.shown('node.gpus', r.site.node.gpus)} with slurm.gpu_directive="
                f"{s.gpu_directive} (gres name {s.gres_name!r}): Slurm knows no such GPU request here: {head}."
                f"{have} Fix: {origin.fix('slurm.gres_name', 'gpu')} (or gpu:TYPE as `scontrol show node` shows "
                f"Gres), or {origin.fix('slurm.gpu_directive', 'gres')} where select/cons_res has no --gpus-per-node. "
                f"{DISCOVER}")
    if "access/permission denied" in low or "user's group not permitted" in low:
        allowed = f" (it allows accounts {part.allow_accounts}, QOS {part.allow_qos})" if part else ""
        return (f"{origin.where('slurm.partition')}: partition {s.partition!r} does not admit you{allowed}: {head}. "
                "Fix: set slurm.partition to a partition you may use, or slurm.account to an account it allows")
    return None


def _time(r: Resolved, origin: Origin, part: F.Partition | None, head: str) -> str:
    job_time = r.job.time is not None
    where = origin.where("time", site=False) if job_time else origin.where("slurm.default_time")
    limit = None
    if part is not None and part.max_time:
        try:
            limit = parse_time(part.max_time)
        except UserError:
            limit = None
    have = f" Partition {part.name} allows at most {part.max_time}." if part and part.max_time else ""
    key = "time" if job_time else "slurm.default_time"
    fix = origin.fix(key, f"'{format_time(limit)}'", site=not job_time) if limit else f"lower {key}"
    return (f"{where}: time limit {r.time_str} is over what partition {r.site.slurm.partition!r} (or your QOS) "
            f"allows: {head}.{have} Fix: {fix} (requeue carries a long run across several jobs), or choose a "
            "partition with a longer MaxTime")


def _nodes(r: Resolved, origin: Origin, part: F.Partition | None, nodes: Sequence[F.Node] | None,
           head: str) -> str:
    """What the site asks of each node against what the partition's nodes have."""
    from dslurm.render import cpus_per_task, tasks_per_node

    site, s = r.site, r.site.slurm
    gpus = site.node.gpus if s.gpu_directive != "none" else 0
    cpus = cpus_per_task(r) * tasks_per_node(r)
    asks = [f"{r.alloc_nodes} node(s) ({origin.shown('nodes', r.job.nodes, site=False)}"
            + (f", spares={r.spares}" if r.spares else "") + ")",
            f"{cpus} CPUs each ({origin.shown('node.cpus', site.node.cpus)})"]
    if gpus:
        asks.append(f"{gpus} GPU(s) each ({origin.shown('node.gpus', gpus)}, slurm.gpu_directive={s.gpu_directive})")
    if s.constraint:
        asks.append(f"feature {s.constraint!r} ({origin.shown('slurm.constraint', s.constraint)})")
    text = f"{origin.site_file}: the job asks partition {s.partition!r} for " + ", ".join(asks) + f": {head}."
    if not nodes:
        return (text + f" Fix: compare with `scontrol show partition {s.partition}` and `scontrol show node`; "
                + DISCOVER.replace(" P`", f" {s.partition}`"))
    text += f" Its nodes: {_shapes(nodes)}."
    fixes: list[str] = []
    most_cpus = max(n.shape.cpus for n in nodes)
    most_gpus = max(n.shape.gpus for n in nodes)
    if cpus > most_cpus:
        fixes.append(origin.fix("node.cpus", str(most_cpus)))
    if gpus > most_gpus:
        fixes.append(origin.fix("node.gpus", str(most_gpus)) if most_gpus else
                     origin.fix("node.gpus", "0") + " and slurm.gpu_directive: none")
    fit = [n for n in nodes if n.shape.cpus >= cpus and n.shape.gpus >= gpus
           and (not s.constraint or s.constraint in n.features)]
    if not fixes and s.constraint and not any(s.constraint in n.features for n in nodes):
        fixes.append(origin.fix("slurm.constraint", "null") + " or a feature its nodes have")
    if not fixes and len(fit) < r.alloc_nodes:
        total = part.total_nodes if part is not None and part.total_nodes else len(nodes)
        text += f" {len(fit)} of its {total} node(s) have that."
        fixes.append(origin.fix("nodes", str(len(fit)), site=False) + " (or fewer spares), or choose a bigger "
                     "partition")
    if not fixes:
        fixes.append(f"compare with `scontrol show partition {s.partition}` (MaxNodes, MaxCPUsPerNode) and "
                     "`scontrol show node`")
    return text + " Fix: " + "; ".join(fixes) + ". " + DISCOVER.replace(" P`", f" {s.partition}`")


# ------------------------------------------------------------------------------ the shell


def parse_assoc_rows(text: str) -> list[Assoc]:
    """`sacctmgr -nP show assoc user=U format=account,partition,qos`. Pure."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            out.append(Assoc(account=parts[0], partition=parts[1], qos=tuple(q for q in parts[2].split(",") if q)))
    return out


def cluster_facts(partition: str, env: Mapping[str, str] | None = None, timeout: float = 20) -> ClusterFacts:
    """What the cluster has, read only after a rejection (each command optional: a failure leaves None)."""
    from dslurm import slurm

    def ask(cmd: list[str]) -> str | None:
        try:
            proc = slurm.run_cmd(cmd, check=False, timeout=timeout, env=env)
        except UserError:
            return None
        return proc.stdout if proc.returncode == 0 else None

    text = ask(["scontrol", "-o", "show", "partition"])
    parts = tuple(F.parse_partitions(text)) if text else None
    nodes: tuple[F.Node, ...] | None = None
    text = ask(["scontrol", "-o", "show", "node"])
    if text:
        nodes = tuple(F.parse_nodes(text, partition))
        part = next((p for p in parts or () if p.name == partition), None)
        if not nodes and part is not None and part.nodes_expr:
            from dslurm.slurm.hosts import expand_hosts

            nodes = tuple(F.hidden_nodes(part, expand_hosts(part.nodes_expr)))
    user = getpass.getuser()
    text = ask(["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account,partition,qos"])
    assoc = tuple(parse_assoc_rows(text)) if text else None
    return ClusterFacts(partitions=parts, nodes=nodes or None, assoc=assoc or None, user=user)
