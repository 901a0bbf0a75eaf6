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
    p = sub.add_parser("plan", help="memory, layout, bubble, collectives and MFU arithmetic; failure simulation",
                       description="Propose a parallel layout that fits (or check a job's own), with its pipeline "
                       "bubble, per-step collective traffic and the tokens/s <-> MFU conversion; or simulate "
                       "goodput under GPU failures with `plan simulate`. Inputs: flags alone; --site with "
                       "--model/--nodes (the site gives the GPUs and links); or --site with --job (the job gives "
                       "the model, nodes, layout and batch). Flags override file values.")
    p.add_argument("--site", help="site YAML: GPUs per node, GPU memory, NVLink domain, links, peak TFLOP/s")
    p.add_argument("--job", help="job YAML (needs --site): nodes, model, parallel degrees, batch, recomputation")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job field, as for render, e.g. --set parallel.microbatches=16 (needs --job)")
    p.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a site field, e.g. --site-set node.gpu_mem_gb=80 (needs --site)")
    p.add_argument("--model", help="model preset (tiny, 1b, 8b, 70b, ...); default 8b, or the job's")
    p.add_argument("--nodes", type=int, help="nodes (default 1; with --job use --set nodes=N)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8, or the site's)")
    p.add_argument("--gpu-mem-gb", type=float, help="memory per GPU, GB (default 80, or the site's)")
    p.add_argument("--nvlink-domain", type=int, help="GPUs per NVLink domain (default: a node)")
    p.add_argument("--peak-tflops", type=float, help="dense BF16 TFLOP/s per GPU, for MFU")
    p.add_argument("--intra-gbytes-per-s", type=float,
                   help="bus bandwidth of a GPU inside its node / NVLink domain, GB/s (site: network.intra_node_...)")
    p.add_argument("--inter-gbytes-per-s", type=float,
                   help="bandwidth of a node to the others, GB/s, shared by its GPUs (site: network.inter_node_...)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batch", type=int, help="sequences per GPU per forward (default 1)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--max-shard-gpus", type=int, help="cap the FSDP shard group (dp_shard x tp GPUs)")
    p.add_argument("--recompute", choices=("none", "selective", "full"), help="force recomputation")
    p.add_argument("--tokens-per-s", type=float, help="a measured throughput to turn into MFU and HFU")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run, plan_command=None)
    s = p.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")
    sim = s.add_parser("simulate", help="Monte Carlo goodput under GPU failures per recovery mechanism and save mode",
                       description="Goodput of a long run under GPU failures for each recovery mechanism (requeue, "
                       "in-allocation spare swap, shrink) and save mode (sync, async, two-tier), the best checkpoint "
                       "interval, and the spares that keep the run at full size. Cost inputs from flags, a real "
                       "run's ledger (--from-run) or defaults; the output names the source of each. See docs/plan.md.")
    from dslurm.plan.sim_cli import add_arguments

    add_arguments(sim)
    chk = s.add_parser("check", help="build the job's real layout at full world size on a fake process group and "
                       "hold what each checked rank allocates and sends against the planner",
                       description="Build the job's model and parallel wrappers exactly as the trainer does, for the "
                       "job's full world size, one CPU process per checked rank, on a fake process group with fake "
                       "tensors (no GPU, no real memory). Per rank: parameter, gradient and optimizer bytes of the "
                       "local shards, the activation peak of one micro-batch's forward and backward, and the bytes of "
                       "each collective kind per mesh dimension, each beside the planner's figure. A gated term more "
                       "than 10%% apart: exit 1. See docs/plan.md.")
    chk.add_argument("--site", required=True, help="site YAML")
    chk.add_argument("--job", required=True, help="job YAML")
    chk.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a job field, e.g. --set parallel.cp=2 (repeatable; YAML 1.2 values)")
    chk.add_argument("--site-set", dest="site_overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a site field, e.g. --site-set slurm.partition=debug (repeatable)")
    chk.add_argument("--ranks", help="comma-separated ranks (default: the first rank of the first and of the last "
                     "pipeline stage, and the world's last rank: a TP edge)")
    chk.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Entry point of `dslurm plan`; returns the exit code."""
    if args.plan_command == "simulate":
        return _simulate(args)
    if args.plan_command == "check":
        from dslurm.plan.check import run_check

        return run_check(args.site, args.job, args.overrides, args.site_overrides, args.ranks, args.json)
    return _plan(args)


def _check_sources(args: argparse.Namespace) -> None:
    """Which inputs go together, said before anything is loaded."""
    if args.job and not args.site:
        raise UserError("--job needs --site: the site gives the GPUs and links, the job the model and layout. "
                        "Fix: add --site site-configs/<site>.yaml, or plan with --model/--nodes alone")
    if args.overrides and not args.job:
        raise UserError(f"--set {args.overrides[0]} changes a job field and needs --job. Fix: add --job JOB.yaml, "
                        "or give the model and batch as flags (--model, --nodes, --seq-len, --global-batch)")
    if args.site_overrides and not args.site:
        raise UserError(f"--site-set {args.site_overrides[0]} changes a site field and needs --site. "
                        "Fix: add --site SITE.yaml, or give the machine as flags (--gpu-mem-gb, --gpus-per-node)")
    for flag, value, example in (("--peak-tflops", args.peak_tflops, "989, an H100 SXM's dense BF16 TFLOP/s"),
                                 ("--tokens-per-s", args.tokens_per_s, "the whole job's measured tokens/s")):
        if value is not None and not value > 0:  # 0 and NaN too: neither is a measurement
            raise UserError(f"{flag} {value:g}: must be greater than 0. Fix: give the number ({example}), "
                            "or leave the flag out")
    if args.job and args.nodes is not None:
        raise UserError(f"--nodes {args.nodes} with --job: the job file sets the nodes and its layout is "
                        f"resolved for them. Fix: --set nodes={args.nodes}")


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(model, cluster, workload, the job's layout or None) from files and flags; flags win."""
    from dataclasses import replace

    from dslurm.config.models import PRESETS
    from dslurm.plan.inputs import MachineFlags, from_files, from_site
    from dslurm.plan.layout import Cluster, Workload

    _check_sources(args)
    if args.model and args.model not in PRESETS:
        raise UserError(f"--model {args.model!r} is unknown; choose one of {', '.join(PRESETS)}")
    flags = MachineFlags(gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb,
                         nvlink_domain=args.nvlink_domain, peak_tflops=args.peak_tflops,
                         intra_gbytes_per_s=args.intra_gbytes_per_s, inter_gbytes_per_s=args.inter_gbytes_per_s)
    base, layout = None, None
    if args.job:
        base = from_files(args.site, args.job, args.overrides, args.site_overrides, flags)
        cluster, layout = base.cluster, base.layout
    elif args.site:
        cluster = from_site(args.site, args.site_overrides, nodes=1 if args.nodes is None else args.nodes,
                            flags=flags)
    else:
        cluster = Cluster(nodes=1 if args.nodes is None else args.nodes,
                          gpus_per_node=8 if flags.gpus_per_node is None else flags.gpus_per_node,
                          gpu_mem_gb=80.0 if flags.gpu_mem_gb is None else flags.gpu_mem_gb,
                          nvlink_domain=flags.nvlink_domain, peak_tflops=flags.peak_tflops or 0.0,
                          intra_gbytes_per_s=flags.intra_gbytes_per_s or 0.0,
                          inter_gbytes_per_s=flags.inter_gbytes_per_s or 0.0)
    model = PRESETS[args.model] if args.model else base.model if base else PRESETS["8b"]
    w = base.work if base else Workload()
    # A flag given on the command line wins (0 included: it must be rejected, not ignored).
    given = {k: v for k, v in (("seq_len", args.seq_len), ("micro_batch", args.micro_batch),
                               ("global_batch", args.global_batch), ("recompute", args.recompute),
                               ("max_shard_gpus", args.max_shard_gpus))
             if v is not None}
    return model, cluster, replace(w, **given), layout


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from dslurm.plan.choose import propose_layout, validate_layout
    from dslurm.plan.mfu import model_flops_per_token

    model, cluster, work, job_layout = _inputs(args)
    if args.tokens_per_s is not None and not cluster.peak_tflops:
        raise UserError(f"--tokens-per-s {args.tokens_per_s:g}: turning it into MFU needs the GPUs' peak, and none "
                        "was given. Fix: add --peak-tflops TFLOPS, or a --site whose node.peak_tflops_bf16 is set")
    seq = work.seq_len or model.seq_len
    out: dict[str, Any] = {"model": {"params": model.num_params(), "layers": model.n_layers,
                                     "dim": model.dim, "seq_len": seq},
                           "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node,
                                       "gpu_mem_gb": cluster.gpu_mem_gb, "memory_note": cluster.memory_note,
                                       "nvlink_domain": cluster.nvlink_domain,
                                       "intra_gbytes_per_s": cluster.intra_gbytes_per_s,
                                       "inter_gbytes_per_s": cluster.inter_gbytes_per_s}}
    flops = model_flops_per_token(params=model.num_params(include_embedding=False), layers=model.n_layers,
                                  heads=model.n_heads, head_dim=model.head_dim, seq_len=seq)
    out["model_flops_per_token"] = flops
    if cluster.peak_tflops:
        # What 40% MFU (a good dense-training figure) would mean in tokens per second.
        out["tokens_per_s_at_40pct_mfu"] = 0.4 * cluster.peak_tflops * 1e12 * cluster.world / flops
    exit_code = 0
    plans = []
    if job_layout is not None:
        checked = validate_layout(model, cluster, job_layout, work)
        out["job_layout"] = _details(checked, model, cluster, work, args.tokens_per_s)
        plans.append(("job_layout", checked))
        exit_code = 0 if checked.fits else 1
    # The proposal chooses micro-batches itself unless a flag fixed them.
    proposal_work = work
    if job_layout is not None:  # propose freely, not bound by the job's own choices
        proposal_work = replace(work, micro_batch=args.micro_batch or 1, microbatches=None, grad_accum=1,
                                recompute=args.recompute)
    proposal = propose_layout(model, cluster, proposal_work)
    out["proposal"] = _details(proposal, model, cluster, proposal_work, args.tokens_per_s)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        from dslurm.plan.show import print_plan

        print_plan(out, primary="job_layout" if job_layout is not None else "proposal")
    return exit_code


def _details(plan: Any, model: Any, cluster: Any, work: Any, tokens_per_s: float | None) -> dict[str, Any]:
    """A plan as a dict, with its pipeline residency, per-step collectives and MFU conversion."""
    from dataclasses import replace

    from dslurm.plan.mfu import conversion, model_flops_per_token, recompute_flops_per_token
    from dslurm.plan.pipeline import stage_in_flight
    from dslurm.plan.traffic import step_traffic, traffic_by_dim

    out: dict[str, Any] = plan.as_dict()
    lay = plan.layout
    w = replace(work, grad_accum=plan.grad_accum, schedule=plan.schedule)
    out["first_stage_in_flight"] = stage_in_flight(plan.schedule, lay.pp, lay.microbatches)
    collectives = step_traffic(model, lay, w, cluster, plan.recompute)
    out["collectives"] = [c.as_dict() for c in collectives]
    out["collectives_by_dim"] = traffic_by_dim(collectives)
    seq = work.seq_len or model.seq_len
    shape = dict(params=model.num_params(include_embedding=False), layers=model.n_layers, heads=model.n_heads,
                 head_dim=model.head_dim, seq_len=seq)
    if cluster.peak_tflops:
        out["mfu"] = conversion(model_flops=model_flops_per_token(**shape),
                                extra_flops=recompute_flops_per_token(recompute=plan.recompute, **shape),
                                gpus=cluster.world, peak_tflops=cluster.peak_tflops, bubble=plan.bubble,
                                tokens_per_step=lay.dp * plan.grad_accum * lay.microbatches * work.micro_batch * seq,
                                tokens_per_s=tokens_per_s)
        out["mfu"]["recompute"] = plan.recompute
    return out


def _simulate(args: argparse.Namespace) -> int:
    from dslurm.plan.sim_cli import run as simulate

    return simulate(args)
