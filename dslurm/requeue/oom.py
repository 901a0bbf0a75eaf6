"""The fix for an out-of-memory ending, from the planner (`dslurm plan` on the frozen config).

An OOM is not retried: the same layout and the same batch reach the same peak again. requeue-me
stops (exit 82) and says what would fit: the job's own layout as the planner sees it (its
estimate per GPU against the usable memory) and the planner's proposal of a layout that fits,
as the `--set` overrides that select it. Torch-free; the planner's arithmetic is
dslurm/plan/choose.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dslurm.errors import UserError
from dslurm.run import RunDir


def _sets(degrees: dict[str, int], recompute: str, micro_batch: int | None, job_cp: int = 1) -> str:
    # the planner proposes no context parallel: cp is named only to undo the job's own
    parts = [f"--set parallel.{k}={v}" for k, v in degrees.items() if k != "cp" or v != job_cp]
    parts.append(f"--set train.activation_checkpoint={recompute}")
    return " ".join(parts) + (f" (micro-batch {micro_batch})" if micro_batch else "")


def oom_fix(run_dir: Path) -> str:
    """One paragraph: the planner's numbers for this job and a layout that fits. Never raises."""
    from dslurm.plan.choose import propose_layout, validate_layout
    from dslurm.plan.inputs import from_files

    rd = RunDir(run_dir)
    site, job = rd.site_yaml, rd.job_yaml
    cmd = f"`dslurm plan --site {site} --job {job}`"
    try:
        ci = from_files(str(site), str(job))
        now = validate_layout(ci.model, ci.cluster, ci.layout, ci.work)
        work = dataclasses.replace(ci.work, micro_batch=1, microbatches=None, grad_accum=1, recompute=None)
        prop = propose_layout(ci.model, ci.cluster, work)
    except (UserError, OSError, ValueError, KeyError) as exc:
        return f"the planner could not propose a layout ({exc}); {cmd} shows why"
    need, budget = now.memory_gb.get("total"), now.budget_gb
    if not now.fits:
        return (f"the planner estimates {need} GB per GPU for this layout, over the {budget} GB usable; a layout "
                f"that fits by its estimate ({prop.memory_gb.get('total')} GB): "
                f"{_sets(prop.layout.degrees(), prop.recompute, work.micro_batch, ci.layout.cp)}; {cmd} shows "
                "the numbers. "
                "Resubmit with it: it resumes from the pointer")
    # Within the estimate: the real peak is higher than the planner's model (long sequences,
    # fragmentation, an extra copy), so a layout "that fits" by the same model is no fix; lower the
    # peak of this one instead, and say what the planner gives for that.
    rc = ci.work.recompute or "none"
    full = validate_layout(ci.model, ci.cluster, ci.layout, dataclasses.replace(ci.work, recompute="full"))
    return (f"the planner estimates {need} GB per GPU for this layout of {budget} GB usable: within its estimate, "
            f"so the real peak is higher than its model; lower the peak: train.activation_checkpoint=full (now "
            f"{rc}; the planner: {full.memory_gb.get('total')} GB), a smaller micro-batch (now "
            f"{ci.work.micro_batch}: raise train.grad_accum), or shard more (parallel.dp_shard, parallel.tp); "
            f"{cmd} shows the numbers. Resubmit with the fix: it resumes from the pointer")
