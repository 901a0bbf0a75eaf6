"""`dslurm plan`: propose or check a parallel layout; `dslurm plan simulate`: failure goodput.

Imports only argparse at module level so `dslurm --help` stays instant; numpy, rich and
the config tree load inside the commands that need them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dslurm.errors import UserError


def register(sub: Any) -> None:
    """Add `plan` (and `plan simulate`) to the dslurm subparsers."""
    p = sub.add_parser("plan", help="memory, layout, bubble and MFU arithmetic; failure simulation",
                       description="Propose a parallel layout that fits (or check the job's own), "
                       "or simulate goodput under GPU failures with `plan simulate`.")
    p.add_argument("--site", help="site YAML: GPUs per node, GPU memory, NVLink domain, peak TFLOP/s")
    p.add_argument("--job", help="job YAML: nodes, model, parallel degrees, batch, recomputation")
    p.add_argument("--model", help="model preset (tiny, 1b, 8b, 70b, ...); default 8b")
    p.add_argument("--nodes", type=int, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=float, help="memory per GPU, GB (default 80)")
    p.add_argument("--nvlink-domain", type=int, help="GPUs per NVLink domain (default: a node)")
    p.add_argument("--peak-tflops", type=float, help="dense BF16 TFLOP/s per GPU, for MFU")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batch", type=int, help="sequences per GPU per forward (default 1)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--max-shard-gpus", type=int, help="cap the FSDP shard group (dp_shard x tp GPUs)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), help="force recomputation")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run, plan_command=None)
    s = p.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    sim = s.add_parser("simulate", help="Monte Carlo goodput of a long run under GPU failures")
    sim.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    sim.add_argument("--mtbf-years", type=float, default=5.0, help="MTBF of one GPU, years (5)")
    sim.add_argument("--save-s", type=float, required=True, help="seconds to write a checkpoint")
    sim.add_argument("--async", dest="async_save", action="store_true",
                     help="async save: training stalls only --async-stall-s")
    sim.add_argument("--async-stall-s", type=float, default=10.0, help="stall of an async save (10)")
    sim.add_argument("--restart-s", type=float, default=600.0, help="restore + restart seconds (600)")
    sim.add_argument("--requeue-s", type=float, default=300.0, help="requeue wait seconds (300)")
    sim.add_argument("--horizon-days", type=float, default=30.0, help="wall clock per run, days (30)")
    sim.add_argument("--trials", type=int, default=1000, help="runs per interval (1000)")
    sim.add_argument("--seed", type=int, default=0, help="random seed (0)")
    sim.add_argument("--interval-s", type=float, action="append",
                     help="interval to score (repeatable); default: a grid around Young/Daly")
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Entry point of `dslurm plan`; returns the exit code."""
    if args.plan_command == "simulate":
        return _simulate(args)
    return _plan(args)


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(model, cluster, workload, the job's layout or None) from files and flags; flags win."""
    from dataclasses import replace

    from dslurm.config.models import PRESETS
    from dslurm.plan.layout import Cluster, Workload

    if bool(args.site) != bool(args.job):
        raise UserError("--site and --job go together (the site gives the GPUs, the job the model)")
    base = None
    if args.site:
        from dslurm.plan.inputs import from_files
        base = from_files(args.site, args.job)
    name = args.model or "8b"
    if args.model and args.model not in PRESETS:
        raise UserError(f"--model {args.model!r} is unknown; choose one of {', '.join(PRESETS)}")
    model = PRESETS[name] if args.model or base is None else base.model
    c = base.cluster if base else None
    def pick(flag: Any, attr: str, default: Any) -> Any:
        # A flag given on the command line wins (0 included: it must be rejected, not ignored).
        return flag if flag is not None else (getattr(c, attr) if c else default)

    cluster = Cluster(nodes=pick(args.nodes, "nodes", 1),
                      gpus_per_node=pick(args.gpus_per_node, "gpus_per_node", 8),
                      gpu_mem_gb=pick(args.gpu_mem_gb, "gpu_mem_gb", 80.0),
                      nvlink_domain=pick(args.nvlink_domain, "nvlink_domain", None),
                      peak_tflops=pick(args.peak_tflops, "peak_tflops", 0.0))
    w = base.work if base else Workload()
    flags = {k: v for k, v in (("seq_len", args.seq_len), ("micro_batch", args.micro_batch),
                               ("global_batch", args.global_batch), ("recompute", args.recompute),
                               ("max_shard_gpus", args.max_shard_gpus))
             if v is not None}
    work = replace(w, **flags)
    return model, cluster, work, (base.layout if base else None)


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dslurm.plan.choose import propose_layout, validate_layout
    from dslurm.plan.mfu import model_flops_per_token

    model, cluster, work, job_layout = _inputs(args)
    out: dict[str, Any] = {"model": {"params": model.num_params(), "layers": model.n_layers,
                                     "dim": model.dim, "seq_len": work.seq_len or model.seq_len},
                           "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                                       "gpu_mem_gb": cluster.gpu_mem_gb,
                                       "nvlink_domain": cluster.nvlink_domain}}
    flops = model_flops_per_token(params=model.num_params(include_embedding=False), layers=model.n_layers,
                                  heads=model.n_heads, head_dim=model.head_dim,
                                  seq_len=work.seq_len or model.seq_len)
    out["model_flops_per_token"] = flops
    if cluster.peak_tflops:
        # What 40% MFU (a good dense-training figure) would mean in tokens per second.
        out["tokens_per_s_at_40pct_mfu"] = 0.4 * cluster.peak_tflops * 1e12 * cluster.world / flops
    exit_code = 0
    if job_layout is not None:
        checked = validate_layout(model, cluster, job_layout, work)
        out["job_layout"] = checked.as_dict()
        exit_code = 0 if checked.fits else 1
    # The proposal chooses micro-batches itself unless a flag fixed them.
    proposal_work = work
    if job_layout is not None:  # propose freely, not bound by the job's own choices
        proposal_work = replace(work, micro_batch=args.micro_batch or 1, microbatches=None, grad_accum=1,
                                recompute=args.recompute)
    out["proposal"] = propose_layout(model, cluster, proposal_work).as_dict()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_plan(out)
    return exit_code


def _print_plan(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = out["model"]
    console.print(f"model {m['params'] / 1e9:.2f}B params, {m['layers']} layers, seq {m['seq_len']}; "
                  f"{out['model_flops_per_token'] / 1e9:.1f} GFLOP/token (6N + 12LHQT)")
    for key, title in (("job_layout", "job's layout"), ("proposal", "proposed layout")):
        if key not in out:
            continue
        plan = out[key]
        table = Table(title=f"{title}: {'fits' if plan['fits'] else 'DOES NOT FIT'}")
        table.add_column("item")
        table.add_column("value")
        table.add_column("why")
        lay = plan["layout"]
        for name in ("tp", "pp", "dp_shard", "dp_replicate", "recompute", "microbatches", "grad_accum"):
            reason = plan["reasons"].get({"dp_shard": "dp", "dp_replicate": "dp"}.get(name, name), "")
            table.add_row(name, str(lay[name]), reason if name != "dp_replicate" else "")
        for name, gb in plan["memory_gb"].items():
            table.add_row(f"memory {name}", f"{gb:.1f} GB",
                          f"usable {plan['budget_gb']:.1f} GB" if name == "total" else "")
        table.add_row("bubble", f"{plan['bubble']:.1%}", "(p-1)/(m+p-1)")
        console.print(table)
        for line in plan["problems"]:
            console.print(f"[red]problem:[/red] {line}")
        for line in plan["warnings"]:
            console.print(f"[yellow]warning:[/yellow] {line}")
    if "tokens_per_s_at_40pct_mfu" in out:
        console.print(f"at 40% MFU: {out['tokens_per_s_at_40pct_mfu']:,.0f} tokens/s")


def _simulate(args: argparse.Namespace) -> int:
    from dslurm.plan._check import positive
    from dslurm.plan.reliability import HOURS_PER_YEAR
    from dslurm.plan.simulate import SimConfig, simulate

    positive("--mtbf-years", args.mtbf_years)
    positive("--horizon-days", args.horizon_days)
    cfg = SimConfig(gpus=args.gpus, gpu_mtbf_h=args.mtbf_years * HOURS_PER_YEAR, save_s=args.save_s,
                    async_save=args.async_save, async_stall_s=args.async_stall_s,
                    restart_s=args.restart_s, requeue_s=args.requeue_s,
                    horizon_h=args.horizon_days * 24.0, trials=args.trials, seed=args.seed)
    res = simulate(cfg, args.interval_s)
    rows = [{"interval_s": float(t), "mean": float(res.mean[i]), "p05": float(res.p05[i]),
             "p95": float(res.p95[i])} for i, t in enumerate(res.intervals_s)]
    if args.json:
        print(json.dumps({"summary": res.summary(), "intervals": rows}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    s = res.summary()
    console = Console()
    console.print(f"{cfg.gpus} GPUs, job MTBF {s['job_mtbf_h']:.2f} h, {s['failures_per_run']:.1f} "
                  f"failures per {args.horizon_days:g}-day run, {cfg.trials} trials, seed {cfg.seed}")
    table = Table(title=f"goodput by checkpoint interval ({'async' if cfg.async_save else 'sync'} save)")
    for col in ("interval", "mean", "p5", "p95", ""):
        table.add_column(col)
    step = max(1, len(rows) // 12)  # a readable subset, plus the two intervals that matter
    for i, r in enumerate(rows):
        tags = [t for t, hit in (("best", i == res.best),
                                 ("Young/Daly", abs(r["interval_s"] - s["young_daly_s"]) < 1e-6)) if hit]
        if i % step == 0 or tags:
            table.add_row(f"{r['interval_s'] / 60:.1f} min", f"{r['mean']:.2%}", f"{r['p05']:.2%}",
                          f"{r['p95']:.2%}", ", ".join(tags))
    console.print(table)
    return 0
