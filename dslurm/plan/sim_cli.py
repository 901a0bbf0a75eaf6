"""`dslurm plan simulate`: goodput per recovery mechanism and save mode, best interval, spares.

Every cost input comes from, in this order: its flag, a run's ledger (`--from-run`, see
`dslurm.plan.run_inputs`), or SimConfig's default; the output says which for each one.
numpy and rich load inside `run`, so `dslurm --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from dslurm.plan.recovery_sim import ALL_MECHANISMS, MECHANISMS, REPLICA, SAVES

# The cost inputs whose default is another input (SimConfig.cost_inputs resolves them).
DEFAULTS_TO = {"durable_lag_s": "save_s", "relaunch_s": "restart_s", "swap_s": "restart_s",
               "group_restart_s": "relaunch_s"}
REPLICA_INPUTS = ("quorum_s", "step_s", "group_restart_s", "heal_s")  # shown only when the replica mode is asked
# SimConfig fields a flag or a run can set: (flag, help). Flags default to None so an explicit
# value is told apart from SimConfig's default.
COSTS = {
    "save_s": ("--save-s", "seconds to write a checkpoint to durable storage (240)"),
    "async_stall_s": ("--async-stall-s", "training stall of an async save (10)"),
    "local_stall_s": ("--local-stall-s", "training stall of a two-tier save, the node-local write (30)"),
    "durable_lag_s": ("--durable-lag-s", "two tiers: local commit -> durable commit (--save-s)"),
    "restart_s": ("--restart-s", "restore + restart seconds (600)"),
    "requeue_s": ("--requeue-s", "queue wait of a requeue, seconds (300)"),
    "relaunch_s": ("--relaunch-s", "in-allocation relaunch on the same nodes, failure -> training (--restart-s)"),
    "swap_s": ("--swap-s", "in-allocation spare swap or shrink, failure -> training (--restart-s)"),
    "partner_lag_s": ("--partner-lag-s", "two tiers with partner copies: local commit -> partner commit (10)"),
    "durable_restore_s": ("--durable-restore-s", "extra seconds of a restore from durable over a node-local one (0)"),
    "quorum_s": ("--quorum-s", "replica: the survivors' wait until a lost group is out of the quorum (5, torchft's "
                 "heartbeat timeout)"),
    "step_s": ("--step-s", "replica: one training step, the failed one trained again (6, Llama 3 405B's)"),
    "group_restart_s": ("--group-restart-s", "replica: a lost group's failure -> its step in the quorum again "
                        "(--relaunch-s)"),
    "heal_s": ("--heal-s", "replica: a group's heal from a live peer (60, an assumption)"),
}


def add_arguments(sim: argparse.ArgumentParser) -> None:
    sim.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    sim.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (8)")
    sim.add_argument("--mtbf-years", type=float, default=5.0, help="MTBF of one GPU, years (5, seed 004)")
    sim.add_argument("--mechanism", action="append", choices=ALL_MECHANISMS,
                     help="recovery mechanism to simulate (repeatable; default: requeue, spare, shrink; "
                     "replica only when named)")
    sim.add_argument("--save", action="append", choices=SAVES, help="save mode (repeatable; default: all)")
    sim.add_argument("--async", dest="async_save", action="store_true", help="same as --save async")
    for name, (flag, text) in COSTS.items():
        sim.add_argument(flag, dest=name, type=float, default=None, help=text)
    sim.add_argument("--from-run", action="append", default=[], metavar="RUN_DIR",
                     help="take the cost inputs from a run's ledger (repeatable: each input from the "
                     "first run that has it); flags still win")
    sim.add_argument("--node-loss-fraction", type=float, default=None,
                     help="share of failures that take out a node, the rest crash a process (1.0)")
    sim.add_argument("--spares", type=int, default=None,
                     help="spare nodes for spare and shrink (default: the count --probability asks for)")
    sim.add_argument("--probability", type=float, default=0.99,
                     help="chance the spares keep the run at full size all along (0.99)")
    sim.add_argument("--group-nodes", type=int, default=None,
                     help="replica: nodes per replica group (1; Llama 3 405B's TP 8 x PP 16: 16)")
    sim.add_argument("--repair-h", type=float, default=None, help="hours until a lost node is back (24)")
    sim.add_argument("--horizon-days", type=float, default=30.0, help="wall clock per run, days (30)")
    sim.add_argument("--trials", type=_whole, default=1000,
                     help="runs per interval (1000; at most 100000, drawn in chunks: memory stays bounded)")
    sim.add_argument("--seed", type=int, default=0, help="random seed (0)")
    sim.add_argument("--interval-s", type=float, action="append",
                     help="interval to score (repeatable); default: a grid around each save's Young/Daly")
    sim.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _whole(text: str) -> int:
    """A whole number, also written as 1e5."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def inputs(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """SimConfig keyword values and, per cost input, where its value came from."""
    from dslurm.plan.run_inputs import from_runs

    measured = from_runs(args.from_run)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, (flag, _) in COSTS.items():
        given = getattr(args, name)
        if given is not None:
            values[name], sources[name] = given, f"flag {flag}"
        elif name in measured:
            values[name], sources[name] = measured[name]
        else:
            sources[name] = f"default, as {COSTS[DEFAULTS_TO[name]][0]}" if name in DEFAULTS_TO else "default"
    for name in ("node_loss_fraction", "repair_h", "group_nodes"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return values, sources


def run(args: argparse.Namespace) -> int:
    from dslurm.plan._check import positive
    from dslurm.plan.reliability import HOURS_PER_YEAR
    from dslurm.plan.sim_stream import check_trials, score_streamed, size_spares_streamed
    from dslurm.plan.simulate import GRID_POINTS, SimConfig

    check_trials(args.trials)
    positive("--mtbf-years", args.mtbf_years)
    positive("--horizon-days", args.horizon_days)
    values, sources = inputs(args)
    mechanisms = list(dict.fromkeys(args.mechanism or MECHANISMS))
    # The replica mode draws which node each loss took: the others' draws stay as without it.
    base = SimConfig(gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                     mechanism=REPLICA if REPLICA in mechanisms else "requeue",
                     gpu_mtbf_h=args.mtbf_years * HOURS_PER_YEAR, horizon_h=args.horizon_days * 24.0,
                     trials=args.trials, seed=args.seed, **values)
    sizing = size_spares_streamed(base, args.probability)
    spares = sizing.spares if args.spares is None else args.spares
    saves = args.save or (["async"] if args.async_save else list(SAVES))
    results = score_streamed(base, [SimConfig(**{**_kwargs(base), "mechanism": m, "save": s,
                                                 "spares": 0 if m == "requeue" else spares})
                                    for m in mechanisms for s in dict.fromkeys(saves)],
                             args.interval_s)
    shown = [n for n in base.cost_inputs() if REPLICA in mechanisms or n not in REPLICA_INPUTS]
    out = {"inputs": {n: {"value": base.cost_inputs()[n], "source": sources[n]} for n in shown},
           "assumed": {"gpus_per_node": base.gpus_per_node, "node_loss_fraction": base.node_loss_fraction,
                       **({"group_nodes": base.group_nodes} if REPLICA in mechanisms else {}),
                       "repair_h": base.repair_h, "gpu_mtbf_h": base.gpu_mtbf_h},
           "spares": {"probability": sizing.probability, "spares": sizing.spares,
                      "mean_most_in_repair": sizing.mean_most_in_repair, "used": spares},
           "best_interval_from": (f"the best mean goodput of the {len(args.interval_s)} --interval-s given"
                                  if args.interval_s else _SEARCH.format(points=GRID_POINTS)),
           "results": [{**r.summary(), "intervals": [
               {"interval_s": float(t), "mean": float(r.mean[i]), "p05": float(r.p05[i]), "p95": float(r.p95[i])}
               for i, t in enumerate(r.intervals_s)]} for r in results]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out, args)
    return 0


_SEARCH = ("searched: the best mean goodput among the scored intervals, {points} log-spaced from Young/Daly / 8 to "
           "x 8 plus Young/Daly itself and the durable write time; the curve is flat near its top, so the best is "
           "often Young/Daly exactly, meaning no scored neighbour did better on these draws")


def _kwargs(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def _print(out: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.table import Table

    from dslurm.observe.table import console as wide_console
    from dslurm.observe.table import print_table

    console = wide_console()
    first = out["results"][0]
    console.print(f"{first['gpus']} GPUs, job MTBF {first['job_mtbf_h']:.2f} h, {first['failures_per_run']:.1f} "
                  f"failures per {args.horizon_days:g}-day run, {args.trials} trials, seed {args.seed}; "
                  f"node loss share {out['assumed']['node_loss_fraction']:g}, repair {out['assumed']['repair_h']:g} h")
    table = Table(title="inputs")
    for col in ("input", "seconds", "from"):
        table.add_column(col)
    for name, v in out["inputs"].items():
        table.add_row(name, f"{v['value']:g}", v["source"])
    print_table(console, table)
    sp = out["spares"]
    console.print(f"spares: {sp['spares']} keep the run at full size all along with probability "
                  f"{sp['probability']:g} (most nodes under repair at once: {sp['mean_most_in_repair']:.1f} on "
                  f"average); simulated with {sp['used']}")
    table = Table(title="goodput at the best checkpoint interval")
    for col in ("mechanism", "save", "spares", "best interval", "Young/Daly", "goodput", "p5-p95",
                "requeues", "shrinks"):
        table.add_column(col)
    for r in out["results"]:
        table.add_row(r["mechanism"], r["save"], str(r["spares"]), f"{r['best_interval_s'] / 60:.1f} min",
                      f"{r['young_daly_s'] / 60:.1f} min", f"{r['goodput_mean']:.1%}",
                      f"{r['goodput_p05']:.1%}-{r['goodput_p95']:.1%}", f"{r['requeues_per_run']:.1f}",
                      f"{r['shrinks_per_run']:.1f}")
    print_table(console, table)
    for r in out["results"]:
        if r["mechanism"] == REPLICA:  # its requeues are the batch node's losses; the rest never stopped the job
            console.print(f"replica ({r['save']}): {r['groups']} groups; the groups out of the quorum cost "
                          f"{r['lost_to_groups_out_h']:.2f} h of the whole job's training per run; requeues are the "
                          "batch node's losses (the batch shell and the Lighthouse)")
    console.print(f"best interval: {out['best_interval_from']}")
