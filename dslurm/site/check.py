"""`dslurm site check`: each row one promise of a site file, decided from what the cluster said.

Pure: every `row_*` takes facts (Slurm's answers, a probe's record, a job's output and state) and
returns a Row: ok / fail / skip, what was seen, and for a failure the fix. dslurm.site.jobs runs
the commands and the jobs that produce those facts; the unit tests feed recorded ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from dslurm.config import SiteConfig
from dslurm.site.discover import SHARED_FS
from dslurm.slurm import facts as F

Status = Literal["ok", "fail", "skip"]


@dataclass(frozen=True, slots=True)
class Row:
    promise: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def holds(self) -> bool:
        return self.status != "fail"


def ok(promise: str, detail: str) -> Row:
    return Row(promise, "ok", detail)


def fail(promise: str, detail: str, fix: str) -> Row:
    return Row(promise, "fail", detail, fix)


def skip(promise: str, detail: str) -> Row:
    return Row(promise, "skip", detail)


# ---------------------------------------------------------------- static rows (no job submitted)

P_PARTITION = "partition exists and is up"
P_ACCOUNT = "account and QOS are yours"
P_MATCH = "node fields match Slurm's nodes"
P_REQUEUE_CONF = "slurm.conf allows requeue"
P_TEST_ONLY = "an N-node whole-node job is accepted"


def row_partition(site: SiteConfig, partitions: Sequence[F.Partition]) -> Row:
    names = [p.name for p in partitions]
    part = next((p for p in partitions if p.name == site.slurm.partition), None)
    if part is None:
        return fail(P_PARTITION, f"slurm.partition={site.slurm.partition!r} does not exist (partitions: "
                    f"{', '.join(names) or 'none'})", f"set slurm.partition to one of: {', '.join(names)}")
    if part.state != "UP":
        return fail(P_PARTITION, f"partition {part.name} is {part.state}",
                    "ask the admins, or choose another partition (scontrol show partition)")
    return ok(P_PARTITION, f"{part.name}: State=UP, Nodes={part.nodes_expr}")


def row_account(site: SiteConfig, assoc: F.Associations, partition: F.Partition | None) -> Row:
    acct, qos = site.slurm.account, site.slurm.qos
    if not assoc.available:
        if acct or qos:
            return skip(P_ACCOUNT, "the cluster keeps no accounting (AccountingStorageType=none): "
                        "account/qos are not enforced; sbatch --test-only below still tries them")
        return skip(P_ACCOUNT, "no accounting on this cluster; none set")
    if acct and acct not in assoc.accounts:
        return fail(P_ACCOUNT, f"slurm.account={acct!r} is not one of your accounts ({', '.join(assoc.accounts)})",
                    f"set slurm.account to one of: {', '.join(assoc.accounts)} (sacctmgr show assoc user=$USER)")
    if qos and qos not in assoc.qos:
        return fail(P_ACCOUNT, f"slurm.qos={qos!r} is not one of your QOS ({', '.join(assoc.qos)})",
                    f"set slurm.qos to one of: {', '.join(assoc.qos)}, or remove it (the default)")
    if partition is not None and acct and partition.allow_accounts not in ("ALL", "") and \
            acct not in partition.allow_accounts.split(","):
        return fail(P_ACCOUNT, f"partition {partition.name} allows accounts {partition.allow_accounts}, not {acct}",
                    "choose an allowed account or another partition")
    used = acct or f"default ({assoc.default_account or '?'})"
    return ok(P_ACCOUNT, f"account {used}, qos {qos or 'default'}")


def row_matches_slurm(site: SiteConfig, nodes: Sequence[F.Node]) -> Row:
    """The site's node fields against the partition's declared shapes: what discover would say."""
    shapes = {n.shape for n in nodes}
    if not shapes:
        return skip(P_MATCH, "the partition lists no nodes")
    n = site.node
    problems, fixes = [], []
    if n.gpus and site.slurm.gpu_directive != "none" and not any(s.gpus >= n.gpus for s in shapes):
        most = max(s.gpus for s in shapes)
        problems.append(f"node.gpus={n.gpus} but its nodes have at most {most} GPU(s) (Gres)")
        fixes.append(f"set node.gpus: {most}" if most else "set node.gpus: 0 and slurm.gpu_directive: none")
    if not any(s.cpus >= n.cpus for s in shapes):
        most = max(s.cpus for s in shapes)
        problems.append(f"node.cpus={n.cpus} but its nodes have at most {most} (CPUEfctv)")
        fixes.append(f"set node.cpus: {most}")
    want_type = site.slurm.gres_name.partition(":")[2] if site.slurm.gpu_directive == "gres" else ""
    if n.gpus and want_type and not any(s.gpu_type == want_type for s in shapes):
        types = sorted({s.gpu_type or "(untyped)" for s in shapes})
        problems.append(f"slurm.gres_name={site.slurm.gres_name!r} but the nodes' gpu gres types are "
                        f"{', '.join(types)}")
        fixes.append("set slurm.gres_name: gpu" + (f":{types[0]}" if types[0] != "(untyped)" else ""))
    if problems:
        return fail(P_MATCH, "; ".join(problems) + " (scontrol show node)", "; ".join(fixes)
                    + " (`dslurm site discover` writes what Slurm says)")
    return ok(P_MATCH, "shapes: " + "; ".join(s.describe() for s in sorted(shapes, key=lambda s: -s.cpus)))


def row_requeue_config(site: SiteConfig, config: Mapping[str, str]) -> Row:
    value = config.get("JobRequeue", "1 (Slurm's default)")
    if not site.requeue.enabled:
        return skip(P_REQUEUE_CONF, f"requeue.enabled: false in the site (JobRequeue={value})")
    if not F.requeue_enabled(config):
        return fail(P_REQUEUE_CONF, f"scontrol show config: JobRequeue={value}: this cluster does not requeue "
                    "batch jobs by default, so a job that runs out of time or loses a node ends there",
                    "ask the admins for JobRequeue=1, or set requeue.enabled: false in the site "
                    "(a run then ends at its time limit; resubmit it to continue)")
    return ok(P_REQUEUE_CONF, f"JobRequeue={value}")


def row_test_only(nodes: int, returncode: int, output: str) -> Row:
    text = " ".join(output.split())
    if returncode == 0:
        return ok(P_TEST_ONLY, f"sbatch --test-only ({nodes} node(s)): {text[:160]}")
    fix = "fix the field Slurm names, e.g. slurm.partition/account/qos, node.gpus or slurm.gres_name"
    low = text.lower()
    if "account" in low or "association" in low:
        fix = "set slurm.account to one of your accounts (sacctmgr show assoc user=$USER)"
    elif "partition" in low:
        fix = "set slurm.partition to a partition you may use (sinfo -s)"
    elif "qos" in low:
        fix = "set slurm.qos to one of your QOS, or remove it"
    elif "gres" in low or "gpu" in low:
        fix = "set node.gpus and slurm.gres_name to what the nodes have (scontrol show node)"
    elif "node count" in low or "nodes" in low:
        fix = f"the partition cannot give {nodes} whole nodes: lower --nodes or choose a larger partition"
    return fail(P_TEST_ONLY, f"sbatch --test-only ({nodes} node(s)) refused: {text[:300]}", fix)


# --------------------------------------------------------------- rows from the node-check job

P_SETUP = "setup lines make torch and dslurm importable"
P_GPUS = "every rank gets its GPU"
P_SCRATCH = "scratch is writable and node-local"
P_DURABLE = "durable path is shared between nodes"
P_ALLREDUCE = "the interface carries a 2-node all-reduce"
P_REQUEUE = "the signal lead arrives and the job requeues once"
P_CONTAINER = "the container runtime starts the image"
P_WARM = "a warm restart reaches its first step with the same devices"


def failed_lines(site: SiteConfig, setup_failed: Sequence[str]) -> str:
    """The setup lines that exited non-zero, each by its number (from 1) and its text."""
    named = []
    for i in setup_failed:
        k = int(i) if i.isdigit() else -1
        named.append(f"{k + 1} `{site.setup[k]}`" if 0 <= k < len(site.setup) else i)
    return f"setup line {', '.join(named)} failed" if named else ""


def row_setup(site: SiteConfig, records: Sequence[Mapping[str, Any]], setup_failed: Sequence[str],
              job_note: str) -> Row:
    """Torch and dslurm import on the nodes after the setup lines; a failing line is named by its text."""
    if not records:
        failed = f"; {failed_lines(site, setup_failed)}" if setup_failed else ""
        return fail(P_SETUP, f"`{site.python} -m dslurm.site.probe` printed nothing on a compute node{failed}: "
                    f"dslurm is not importable there ({job_note})",
                    "make the setup lines activate the environment dslurm is installed in (module load, "
                    "source VENV/bin/activate) and `python` name its interpreter")
    broken = [r for r in records if not r.get("software", {}).get("torch")]
    if broken:
        r, sw = broken[0], broken[0].get("software", {})
        failed = f" ({failed_lines(site, setup_failed)})" if setup_failed else ""
        return fail(P_SETUP, f"on {r.get('node')}: import torch failed after the setup lines{failed}: "
                    f"{sw.get('torch_error', '?')} (python {sw.get('executable')})",
                    "add the lines that make torch importable on a compute node to `setup` "
                    "(module load ..., source /path/to/venv/bin/activate), or point `python` at that interpreter")
    sw = records[0].get("software", {})
    return ok(P_SETUP, f"python {sw.get('python')}, torch {sw.get('torch')} (CUDA {sw.get('cuda')}), "
              f"dslurm {sw.get('dslurm')} on {', '.join(str(r.get('node')) for r in records)}")


def row_gpus(site: SiteConfig, records: Sequence[Mapping[str, Any]]) -> Row:
    want = site.node.gpus
    if not records:
        return skip(P_GPUS, "no probe record (see the row above)")
    if want == 0 or site.slurm.gpu_directive == "none":
        return skip(P_GPUS, "the site asks for no GPUs")
    for r in records:
        g = r.get("gpus", {})
        visible, nvml = int(g.get("visible") or 0), g.get("nvml")
        count = min(visible, nvml["count"]) if nvml and visible else visible or (nvml or {}).get("count", 0)
        if count < want:
            return fail(P_GPUS, f"on {r.get('node')}: {count} GPU(s) visible to the job (CUDA_VISIBLE_DEVICES="
                        f"{g.get('env', {}).get('CUDA_VISIBLE_DEVICES')}, NVML {nvml['count'] if nvml else 'absent'}); "
                        f"the site promises {want}",
                        f"set node.gpus: {count}" if count else
                        "check slurm.gpu_directive and slurm.gres_name against `scontrol show node` (Gres=)")
    procs = site.procs_per_node
    if procs > want:
        return fail(P_GPUS, f"{procs} processes per node share {want} GPU(s)",
                    f"set node.procs_per_node: {want} or less")
    return ok(P_GPUS, f"{want} GPU(s) visible on each node, {procs} process(es) per node")


def row_scratch(site: SiteConfig, first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> Row:
    pattern = site.storage.scratch
    if not pattern:
        return skip(P_SCRATCH, "no storage.scratch in the site")
    if first is None:
        return skip(P_SCRATCH, "no probe record")
    s = first.get("scratch", {})
    if not s.get("writable"):
        return fail(P_SCRATCH, f"storage.scratch={pattern!r} -> {s.get('path')} on {first.get('node')} is not "
                    f"writable: {s.get('error', '?')}",
                    "set storage.scratch to a node-local directory you may write, e.g. /tmp/$USER/%n or $TMPDIR")
    if "%n" in pattern:
        return ok(P_SCRATCH, f"{s.get('path')} ({s.get('fs')}, {s.get('free_gb')} GB free): writable, one "
                  "directory per node (%n)")
    if s.get("fs") in SHARED_FS or (second is not None and second.get("scratch", {}).get("peer_marker_seen")):
        return fail(P_SCRATCH, f"{s.get('path')} is shared between nodes ({s.get('fs')}; "
                    f"{second.get('node') if second else 'another node'} saw {first.get('node')}'s file)",
                    "use node-local storage (/tmp, /local, $TMPDIR), or add %n to keep nodes apart")
    where = f"; {second.get('node')} did not see it" if second is not None else ""
    return ok(P_SCRATCH, f"{s.get('path')} ({s.get('fs')}, {s.get('free_gb')} GB free): writable{where}")


def row_durable(site: SiteConfig, first: Mapping[str, Any] | None, second: Mapping[str, Any] | None) -> Row:
    d = site.storage.durable
    if first is None:
        return skip(P_DURABLE, "no probe record")
    w = first.get("durable", {})
    if not w.get("written"):
        return fail(P_DURABLE, f"storage.durable={d!r} -> {w.get('path')} is not writable on {first.get('node')}: "
                    f"{w.get('error', '?')}", "set storage.durable to a shared directory you may write")
    if second is None or second.get("node") == first.get("node"):
        return skip(P_DURABLE, "needs 2 nodes (--nodes 2): written on one node, read on another")
    r = second.get("durable", {})
    if r.get("seen_from") != first.get("node"):
        return fail(P_DURABLE, f"{w.get('path')}: written on {first.get('node')} ({w.get('fs')}), not seen on "
                    f"{second.get('node')}: it is node-local",
                    "set storage.durable to a filesystem every node mounts (Lustre, GPFS, NFS: your project space)")
    return ok(P_DURABLE, f"{w.get('path')} ({w.get('fs')}): written on {first.get('node')}, "
              f"read on {second.get('node')}")


_COMM_WORDS = ("inter-node", "slow link", "slow communication")  # the fabric between nodes, not a node's own


def row_allreduce(nodes: int, report: Mapping[str, Any] | None, note: str, setup_holds: bool = True) -> Row:
    """From the burn-in's report: its cross-node all-reduce ran (`inter`) and no finding about
    communication (busbw floors, slow links) failed. Its other findings (GEMM, NVML) are the burn-in's
    own verdict, named here but not this promise: `dslurm burnin` judges them. The burn-in runs torch
    after the site's setup lines: while those fail (`setup_holds` false) it proves nothing about the
    interface, and its fix would point at the wrong field, so the row is not judged."""
    if nodes < 2:
        return skip(P_ALLREDUCE, "needs 2 nodes (--nodes 2)")
    if not setup_holds:
        return skip(P_ALLREDUCE, f"not judged: the burn-in needs torch and dslurm after the setup lines; "
                    f"fix the setup row first ({note})")
    if report is None:
        return fail(P_ALLREDUCE, f"the burn-in job wrote no report ({note})",
                    "read the burn-in job's logs; set env NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to the "
                    "interface between the nodes (`dslurm site discover` names it)")
    verdict = report.get("verdict") or {}
    whys = [f"{h}: {w}" for h, ws in (verdict.get("bad_nodes") or {}).items() for w in ws]
    whys += list(verdict.get("problems") or [])
    comm = [w for w in whys if any(k in w for k in _COMM_WORDS)]
    inter = report.get("inter") or {}
    if not inter.get("busbw_gbps") or comm:
        return fail(P_ALLREDUCE, f"the cross-node all-reduce {'failed: ' + '; '.join(comm) if comm else 'did not run'}"
                    f" ({note})"[:500], "set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (env) to the interface "
                    "between the nodes, or lower burnin.busbw_inter_min_gbytes_per_s to what the fabric gives")
    other = [w for w in whys if w not in comm]
    more = f"; the burn-in's other findings: {'; '.join(other)}"[:300] if other else ""
    return ok(P_ALLREDUCE, f"{inter.get('ranks')} ranks over {report.get('backend')}: busbw "
              f"{inter['busbw_gbps']:.2f} GB/s ({note}){more}")


def row_requeue(site: SiteConfig, state: str | None, restarts: int, output: str, lead_s: int) -> Row:
    if not site.requeue.enabled:
        return skip(P_REQUEUE, "requeue.enabled: false in the site")
    signals = output.count("DSLURM-SITE-SIGNAL")
    requeued = "DSLURM-SITE-RESTARTED" in output
    if signals and requeued and state == "COMPLETED" and restarts == 1:
        return ok(P_REQUEUE, f"USR2 arrived {lead_s} s before the limit; the job requeued itself and started again")
    if not signals:
        return fail(P_REQUEUE, f"no USR2 reached the batch shell (job {state}, restarts {restarts})",
                    "the site may not deliver --signal=B:USR2@LEAD: ask the admins; meanwhile set requeue.enabled: "
                    "false (runs end at their time limit)")
    return fail(P_REQUEUE, f"USR2 arrived but the job did not start again (state {state}, restarts {restarts}; "
                f"{' '.join(ln for ln in output.splitlines() if 'REQUEUE' in ln)[:200]})",
                "the site refuses `scontrol requeue` of your own job: ask the admins, or set requeue.enabled: false")


def row_container(site: SiteConfig, output: str, job_note: str) -> Row:
    if site.container is None:
        return skip(P_CONTAINER, "no container in the site")
    line = next((ln for ln in output.splitlines() if ln.startswith("DSLURM-SITE-CONTAINER")), None)
    if line is None:
        return fail(P_CONTAINER, f"{site.container.runtime} did not start {site.container.image} with torch "
                    f"importable ({job_note})", "check container.image exists on the nodes and holds torch and dslurm")
    return ok(P_CONTAINER, line.removeprefix("DSLURM-SITE-CONTAINER").strip())


def _probe_pairs(records: Mapping[str, Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any] | None]]:
    """Each rank's record of the first job step (the cold one) and of the next (or None)."""
    by_rank: dict[int, list[tuple[tuple[int, int], Mapping[str, Any]]]] = {}
    for name, rec in records.items():  # step-<RESTART>.<STEP>-rank-<R>.json
        start, _, rank = name.removeprefix("step-").removesuffix(".json").partition("-rank-")
        restart, _, step = start.partition(".")
        by_rank.setdefault(int(rank), []).append(((int(restart), int(step)), rec))
    out = []
    for r in sorted(by_rank):
        recs = [rec for _, rec in sorted(by_rank[r], key=lambda x: x[0])]
        out.append((recs[0], recs[1] if len(recs) > 1 else None))
    return out


def row_warm(site: SiteConfig, nodes: int, endings: Sequence[str], modes: Sequence[str],
             records: Mapping[str, Mapping[str, Any]], note: str, setup_holds: bool = True) -> Row:
    """From the warm job (1 node + 1 spare, recovery.warm: true, the probe crashing rank 0 once both
    nodes' pools serve): the next attempt started warm, reached its first step (the probe's
    all-reduce) and completed, and each rank's worker, forked by the pool, opened exactly the GPU
    device files the cold attempt's opened, with the same CUDA_VISIBLE_DEVICES (dslurm/launch/devices.py)."""
    from dslurm.launch.devices import DEFAULT_DEVICES, DEVICES_ENV, same_devices

    if site.container is not None:
        return skip(P_WARM, "warm restarts are not supported with a container runtime yet: attempts start cold")
    if nodes < 2:
        return skip(P_WARM, "needs 2 nodes (--nodes 2): one trains, the other is its spare")
    if not setup_holds:
        return skip(P_WARM, f"not judged: the probe needs torch and dslurm after the setup lines ({note})")
    fix_log = f"read the warm job's log ({note})"
    if list(modes[:2]) != ["torchrun", "warm"]:
        started = modes[1] if len(modes) > 1 else "not at all"
        return fail(P_WARM, f"the attempt after the forced crash started {started} (starts: "
                    f"{', '.join(modes) or 'none'}; endings: {', '.join(endings) or 'none'}; {note})",
                    f"{fix_log}: a pool that did not serve says why there (its step's srun, its import of torch)")
    if list(endings[:2]) != ["crash", "completed"]:
        return fail(P_WARM, f"the warm attempt did not complete (endings: {', '.join(endings) or 'none'}; {note})",
                    f"{fix_log}: a warm worker that cannot open its GPUs fails here (ConstrainDevices): the pool "
                    "step must hold the training step's GPUs (slurm.gpu_directive, slurm.gres_name)")
    pairs = _probe_pairs(records)
    if not pairs or any(w is None for _, w in pairs):
        return fail(P_WARM, f"the probe left no record of the warm attempt on every rank ({note})", fix_log)
    for cold, warm in pairs:
        assert warm is not None
        rank = cold.get("rank")
        if not warm.get("warm"):
            return fail(P_WARM, f"rank {rank}'s worker in the warm attempt was not forked by a pool ({note})", fix_log)
        c, w = cold.get("devices") or {}, warm.get("devices") or {}
        if not same_devices(c, w):
            return fail(P_WARM, f"rank {rank} on {cold.get('hostname')}: the cold attempt opened {c.get('reachable')} "
                        f"(CUDA_VISIBLE_DEVICES={_visible(c)}), the warm one {w.get('reachable')} "
                        f"(CUDA_VISIBLE_DEVICES={_visible(w)})",
                        "the pool step must hold the training step's GPUs: check slurm.gpu_directive and "
                        "slurm.gres_name against `scontrol show node` (dslurm asks for them on both steps)")
        if site.node.gpus and site.slurm.gpu_directive != "none" and not c.get("files"):
            pattern = site.env.get(DEVICES_ENV, DEFAULT_DEVICES)
            return fail(P_WARM, f"on {cold.get('hostname')} no GPU device file matches {pattern}: the devices were "
                        "not compared", f"set env {DEVICES_ENV} in the site to the glob of the nodes' GPU device files")
    first = pairs[0][0].get("devices") or {}
    seen = f"{len(first.get('reachable') or [])} GPU device(s)" if first.get("files") else "no GPU device files"
    return ok(P_WARM, f"forced crash, then a warm attempt: {len(pairs)} rank(s) forked by the pool reached their first "
              f"step with the cold attempt's devices ({seen}, CUDA_VISIBLE_DEVICES={_visible(first)}; {note})")


def _visible(view: Mapping[str, Any]) -> object:
    return (view.get("gpu_env") or {}).get("CUDA_VISIBLE_DEVICES")


def not_run(promises: Sequence[str], why: str) -> list[Row]:
    return [skip(p, f"not run: {why}") for p in promises]


STATIC = (P_PARTITION, P_ACCOUNT, P_MATCH, P_REQUEUE_CONF, P_TEST_ONLY)
LIVE = (P_SETUP, P_GPUS, P_SCRATCH, P_DURABLE, P_ALLREDUCE, P_REQUEUE, P_CONTAINER, P_WARM)
PROMISES = STATIC + LIVE  # every row of the table, in its order


def verdict(rows: Sequence[Row]) -> int:
    """0 only when every row holds (a skipped row holds: it promises nothing)."""
    return 0 if all(r.holds for r in rows) else 1


def table(rows: Sequence[Row]) -> str:
    width = max(len(r.promise) for r in rows)
    out = []
    for r in rows:
        out.append(f"{r.status.upper():4}  {r.promise:<{width}}  {r.detail}")
        if r.fix:
            out.append(f"{'':4}  {'':<{width}}  fix: {r.fix}")
    return "\n".join(out)


def as_json(rows: Sequence[Row]) -> str:
    """`site check --json`: every row (promise, status, holds, detail, fix) and the verdict."""
    import json

    return json.dumps({"holds": verdict(rows) == 0,
                       "rows": [{**asdict(r), "holds": r.holds} for r in rows]}, indent=2)
