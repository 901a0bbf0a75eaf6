"""Propose a parallel layout, or check a requested one (seed 000 table 2.2, seed 004).

Order of preference, cheapest communication first: pipeline stages only when nothing
without them fits (they cost bubbles); tensor parallelism only inside the NVLink domain
and as small as fits (it communicates in every layer); full recomputation only when
activations still do not fit (+1/3 arithmetic); then the smallest data-parallel shard
group that holds the state: DDP, HSDP, FSDP over everything.
"""

from __future__ import annotations

from collections.abc import Iterator

from dslurm.config.layout import Layout, stages_per_rank
from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan.layout import Cluster, Plan, Workload, _budget, _gb, _splits, memory_per_gpu
from dslurm.plan.memory import GB
from dslurm.plan.pipeline import schedule_bubble


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(model: ModelShape, cluster: Cluster) -> list[int]:
    """Powers of two inside one node's NVLink domain that split the heads evenly."""
    limit = min(cluster.nvlink_domain or cluster.gpus_per_node, cluster.gpus_per_node)
    out, tp = [], 1
    while tp <= limit:
        if cluster.gpus_per_node % tp == 0 and not Layout(tp=tp).shape_problems(model):
            out.append(tp)
        tp *= 2
    return out


def _pp_options(model: ModelShape, cluster: Cluster, v: int = 1) -> list[int]:
    """Stage counts that give each stage whole nodes (pipeline traffic tolerates InfiniBand)."""
    return [p for p in _divisors(cluster.nodes) if not Layout(pp=p).shape_problems(model, v)]


def _candidates(model: ModelShape, cluster: Cluster,
                work: Workload) -> Iterator[tuple[tuple[Layout, str, int] | tuple[int, int, str], str]]:
    """(layout, recompute, grad_accum) in order of preference; a (pp, tp, recompute) key and a
    note where the batch rules one out."""
    recomputes = [work.recompute] if work.recompute else ["none", "full"]
    for pp in _pp_options(model, cluster, stages_per_rank(work.schedule)):
        for rc in recomputes:
            for tp in _tp_options(model, cluster):
                dp = cluster.world // (tp * pp)
                split = _splits(pp, dp, work)
                if split is None:
                    yield (pp, tp, rc), (f"global_batch={work.global_batch} does not split into "
                                         f"dp({dp}) x micro_batch({work.micro_batch}) x >= "
                                         f"{pp * stages_per_rank(work.schedule)} microbatches")
                    continue
                for g in _divisors(dp):
                    if work.max_shard_gpus and g > 1 and g * tp > work.max_shard_gpus:
                        break  # divisors ascend: every later group is larger still
                    lay = Layout(tp=tp, pp=pp, dp_shard=g, dp_replicate=dp // g, microbatches=split[0])
                    yield (lay, rc, split[1]), ""


def _reasons(plan: Plan, mem: dict[str, float], cluster: Cluster,
             rejected: dict[tuple[int, int, str], tuple[float, str]], budget: float,
             forced: bool) -> dict[str, str]:
    """One sentence per degree: why it is this and not the cheaper one."""
    def need(pp: int, tp: int, rc: str) -> str:
        total, note = rejected.get((pp, tp, rc), (0.0, "not tried"))
        return note or f"needs {total / GB:.1f} GB per GPU with the widest shard group > {budget / GB:.1f} GB"

    r: dict[str, str] = {}
    rc, grad_accum, chosen = plan.recompute, plan.grad_accum, plan.layout
    r["pp"] = ("1: the layer stack fits without pipeline stages" if chosen.pp == 1 else
               f"{chosen.pp} stages of {cluster.nodes // chosen.pp} node(s): the layer stack does not "
               f"fit without them (tp={chosen.tp}: {need(1, chosen.tp, rc)})")
    r["tp"] = (f"1: activations of {mem['activations'] / GB:.1f} GB fit unsplit" if chosen.tp == 1 else
               f"{chosen.tp}, inside the NVLink domain of {cluster.nvlink_domain}: tp={chosen.tp // 2} "
               f"{need(chosen.pp, chosen.tp // 2, rc)}")
    r["microbatches"] = (f"{chosen.microbatches} per schedule step, to keep the bubble small" if chosen.pp > 1 else
                         "1: no pipeline")
    r["grad_accum"] = f"{grad_accum} gradient-accumulation pass(es) per step"
    r["recompute"] = (f"{rc}: requested" if forced else
                      "none: activations fit without recomputation" if rc == "none" else
                      "full: costs ~1/3 more arithmetic; without it "
                      + need(chosen.pp, chosen.tp, "none"))
    state = mem["state"] / GB
    if chosen.dp_shard == 1:
        r["dp"] = f"DDP x{chosen.dp_replicate}: a full replica ({state:.1f} GB of state) fits; cheapest sync"
    elif chosen.dp_replicate == 1:
        r["dp"] = (f"FSDP over all {chosen.dp_shard} data-parallel ranks: no smaller shard group "
                   f"fits ({state:.1f} GB of state per GPU)")
    else:
        where = "inside one node" if chosen.dp_shard * chosen.tp <= cluster.gpus_per_node else \
            f"over {chosen.dp_shard * chosen.tp // cluster.gpus_per_node} nodes"
        r["dp"] = (f"HSDP: shard over {chosen.dp_shard} ({where}), replicate x{chosen.dp_replicate}: "
                   f"the smallest shard group that fits ({state:.1f} GB of state per GPU)")
    return r


def propose_layout(model: ModelShape, cluster: Cluster, work: Workload | None = None) -> Plan:
    """The cheapest layout that fits, with a reason per degree; UserError when none does."""
    work = work or Workload()
    budget = _budget(cluster, work)
    rejected: dict[tuple[int, int, str], tuple[float, str]] = {}
    notes: list[str] = []
    for cand, note in _candidates(model, cluster, work):
        if not isinstance(cand[0], Layout):
            key = (int(cand[0]), int(cand[1]), str(cand[2]))
            rejected[key] = (float("inf"), note)
            notes.append(f"pp={key[0]} tp={key[1]}: {note}")
            continue
        lay, rc, grad_accum = cand
        mem = memory_per_gpu(model, lay, work, rc)
        if mem["total"] <= budget:
            share, overhead = schedule_bubble(work.schedule, lay.pp, lay.microbatches)
            plan = Plan(layout=lay, recompute=rc, grad_accum=grad_accum, memory_gb=_gb(mem),
                        budget_gb=round(budget / GB, 2), bubble=share, bubble_overhead=overhead,
                        schedule=work.schedule, reasons={})
            plan.reasons = _reasons(plan, mem, cluster, rejected, budget, forced=work.recompute is not None)
            return plan
        key = (lay.pp, lay.tp, rc)
        # Keep the smallest need per (pp, tp, recompute): the fully sharded one.
        if mem["total"] < rejected.get(key, (float("inf"), ""))[0]:
            rejected[key] = (mem["total"], "")
    best = min((v[0] for v in rejected.values() if v[0] < float("inf")), default=float("inf"))
    need = (f"the smallest need is {best / GB:.1f} GB per GPU > {budget / GB:.1f} GB usable"
            if best < float("inf") else "no layout splits the global batch")
    raise UserError(
        f"no layout fits {model.num_params() / 1e9:.1f}B parameters on {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} GPU(s) of {cluster.gpu_mem_gb} GB: {need}"
        + (f" ({'; '.join(notes[:2])})" if notes else "")
        + ". Fix: " + ("more nodes or GPUs with more memory, a smaller micro_batch or seq_len"
                       + ("" if work.recompute == "full" else ", or full recomputation (--recompute full)")
                       if best < float("inf") else
                       "a global_batch that micro_batch x the data-parallel degree divides, or other nodes"))


def validate_layout(model: ModelShape, cluster: Cluster, layout: Layout,
                    work: Workload | None = None) -> Plan:
    """Check a requested layout: it must divide the world and suit the model (else UserError),
    and fit memory, the pipeline schedule and the batch rule (else `problems`)."""
    work = work or Workload()
    layout.check_world(cluster.world, detail=f" ({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs)",
                       fix=f"choose degrees whose product is {cluster.world}")
    v = stages_per_rank(work.schedule)
    shape = layout.shape_problems(model, v)
    if shape:
        raise UserError("; ".join(shape) + ". Fix: choose degrees the model divides into")
    budget = _budget(cluster, work)
    recompute = work.recompute or "none"
    mem = memory_per_gpu(model, layout, work, recompute)
    problems, warnings = [], []
    if mem["total"] > budget:
        problems.append(f"needs {mem['total'] / GB:.1f} GB per GPU > {budget / GB:.1f} GB usable "
                        f"({cluster.gpu_mem_gb} GB less {work.reserve:.0%} reserve)")
    schedule = layout.schedule_problem(v)
    if schedule:
        problems.append(schedule)
    if work.global_batch is not None:
        try:
            layout.micro_batch(work.global_batch, work.grad_accum, where="global_batch ")
        except UserError as e:
            problems.append(str(e))
    domain = cluster.nvlink_domain or cluster.gpus_per_node
    if layout.tp > domain or domain % layout.tp:
        warnings.append(f"tp={layout.tp} leaves the NVLink domain of {domain} GPUs: its per-layer "
                        "collectives cross the slower inter-node network")
    bubble, overhead = schedule_bubble(work.schedule, layout.pp, layout.microbatches)
    if bubble > 0.25:
        warnings.append(f"pipeline bubble {bubble:.0%} of the step under {work.schedule}: raise microbatches "
                        f"(idle share = (p-1)/(v*m + p-1), v={v})")
    return Plan(layout=layout, recompute=recompute, grad_accum=work.grad_accum, memory_gb=_gb(mem),
                budget_gb=round(budget / GB, 2), bubble=bubble, bubble_overhead=overhead, schedule=work.schedule,
                reasons={"layout": "requested"}, problems=problems, warnings=warnings)
