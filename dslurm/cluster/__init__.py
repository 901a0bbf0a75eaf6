"""`dslurm cluster up|down|status`: a real Slurm (22.05) on this one machine.

munged, slurmctld and N slurmd daemons (node1..nodeN, each in its own UTS namespace so
`hostname` differs per node, each under a `tini -s` subreaper), plus slurmdbd + MariaDB with
`--accounting` (so sacct works; submitit needs it). No systemd.

`--gpus-per-node N` declares N placeholder GPUs (gres gpu) per node, so GPU-style jobs
(`--gpus-per-node`, `--gres=gpu:N`) are scheduled by the real slurmctld and get Slurm's GPU
environment (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES); their processes run on
the CPU. `--site-shape FILE[:NODES]` adds a never-started partition shaped like that site for
`sbatch --test-only`; `--constrain-devices` runs task/cgroup with ConstrainDevices=yes, so a
step's processes open only the GPUs Slurm gave it (dslurm/cluster/conf.py says how all three
work; shapes.py reads the site file, devices.py makes the placeholder GPU devices).

State dir (default `$DSLURM_CLUSTER_DIR` or /tmp/dslurm-cluster) holds config, logs, spool,
controller state, MariaDB data and `cluster.json`: the settings, every PID started (with its
start time, so a recycled PID is never killed) and every system change made. `down` stops
exactly those processes and undoes exactly those changes:
  - a line in /etc/hosts marked `# dslurm-cluster <state dir>` (node names -> 127.0.0.1);
  - /etc/slurm/slurm.conf as a symlink to the state dir's slurm.conf, so client commands work
    without SLURM_CONF (an existing file is kept as /etc/slurm/slurm.conf.dslurm-orig and
    restored).
"""
# Where things live: this file is the public API (up, down, status, is_up, ClusterInfo) and the
# CLI; state.py the state dir, its record and the health check; daemons.py starting and
# stopping the daemons; host.py the /etc changes; proc.py the process helpers; conf.py the
# rendered config; shapes.py / devices.py / show.py as their docstrings say.

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from typing import Any

from dslurm import slurm
from dslurm.cluster import conf as cc
from dslurm.cluster.daemons import (
    check_ports_free,
    ensure_packages,
    first_job_id,
    repair,
    restart_controller,
    restore_conf,
    start,
    teardown,
)
from dslurm.cluster.host import ETC_CONF, HOSTS
from dslurm.cluster.proc import alive
from dslurm.cluster.shapes import DEFAULT_SHAPE_NODES as DEFAULT_SHAPE_NODES  # `X as X`: re-exported,
from dslurm.cluster.shapes import parse_site_shape as parse_site_shape  # tests import both from here
from dslurm.cluster.state import DEFAULT_DIR, ENV_DIR, healthy, info_of, load, machine_lock
from dslurm.cluster.state import RECORD as RECORD  # re-exported: tests, benches and the fixture
from dslurm.cluster.state import ClusterInfo as ClusterInfo  # use these as `cluster.X`
from dslurm.cluster.state import is_up as is_up
from dslurm.cluster.state import state_dir_of as state_dir_of
from dslurm.errors import SlurmError, UserError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ public API

def up(nodes: int = 2, accounting: bool = False, state_dir: str | os.PathLike[str] | None = None,
       cpus: int = 4, gpus: int | None = None, shapes: tuple[cc.NodeShape, ...] | None = None,
       constrain_devices: bool | None = None) -> ClusterInfo:
    """Start the cluster (or leave a healthy one with the same settings alone).

    `gpus` / `shapes` / `constrain_devices` None: as the recorded cluster has them (none for a fresh
    one), so a test that brings a killed node back with `up(nodes=3, accounting=True)` keeps the
    session's GPUs and their device constraint."""
    sdir = state_dir_of(state_dir)
    # A healthy cluster with these settings is left alone without taking the machine lock: a test
    # session run under `flock /tmp/dslurm-cluster.lock` (how sessions sharing the cluster take
    # turns) holds that very lock, and would deadlock here. Reading health outside the lock
    # promises no less than inside it: a `down` may follow either way.
    rec = load(sdir)
    if rec and _same(rec, nodes, accounting, cpus, gpus, shapes, constrain_devices) and healthy(sdir, rec):
        restore_conf(sdir, rec)
        return info_of(sdir, rec)
    with machine_lock():
        rec = load(sdir)
        old = rec.get("settings", {}) if rec else {}
        # Validate first: a bad --nodes must not tear down a running cluster.
        spec = cc.ClusterSpec(state_dir=sdir, nodes=nodes, cpus=cpus, accounting=accounting,
                              gpus=int(old.get("gpus", 0)) if gpus is None else gpus,
                              shapes=cc.shapes_from_settings(old.get("shapes")) if shapes is None else shapes,
                              constrain_devices=(bool(old.get("constrain_devices")) if constrain_devices is None
                                                 else constrain_devices),
                              controller_host=socket.gethostname(),
                              first_job_id=first_job_id(sdir))
        wanted = spec.settings()
        if rec and healthy(sdir, rec):
            if rec["settings"] == wanted:
                log.info("cluster in %s already up with %s", sdir, wanted)
                restore_conf(sdir, rec)
                return info_of(sdir, rec)
            log.warning("cluster in %s runs with %s; restarting with %s",
                        sdir, rec["settings"], wanted)
        if os.geteuid() != 0:  # only now: a running cluster is usable without root
            raise UserError("`dslurm cluster up` needs root: it runs the Slurm daemons as "
                            f"root and edits {HOSTS} and {ETC_CONF}; run it with sudo")
        if rec and rec.get("settings") == wanted:
            try:  # nodes lost, controller alive: bring them back without cancelling anyone's jobs
                if repair(spec, rec):
                    restore_conf(sdir, rec)
                    return info_of(sdir, rec)
            except SlurmError as exc:
                log.warning("cluster in %s: repair failed (%s); restarting it", sdir, exc)
        if rec:
            teardown(sdir, rec)  # leftovers of a crashed or differently-configured run
        ensure_packages(accounting)
        check_ports_free(spec)
        rec = {"settings": spec.settings(), "procs": [], "changes": {}}
        try:
            start(spec, rec)
        except BaseException:
            teardown(sdir, rec)
            raise
        return info_of(sdir, rec)


def _same(rec: dict[str, Any], nodes: int, accounting: bool, cpus: int, gpus: int | None,
          shapes: tuple[cc.NodeShape, ...] | None, constrain_devices: bool | None = None) -> bool:
    """The recorded cluster has these settings (None: any GPUs / shapes / device constraint)."""
    s = rec.get("settings", {})
    return (s.get("nodes") == nodes and s.get("accounting") == accounting and s.get("cpus") == cpus
            and (gpus is None or s.get("gpus", 0) == gpus)
            and (constrain_devices is None or bool(s.get("constrain_devices")) == constrain_devices)
            and (shapes is None or cc.shapes_from_settings(s.get("shapes")) == tuple(shapes)))


def down(state_dir: str | os.PathLike[str] | None = None) -> bool:
    """Stop what `up` started and undo its system changes. False if nothing was running."""
    sdir = state_dir_of(state_dir)
    with machine_lock():
        rec = load(sdir)
        if not rec:
            return False
        teardown(sdir, rec)
        return True


def restart_slurmctld(down_s: float, state_dir: str | os.PathLike[str] | None = None) -> float:
    """slurmctld stopped, down for `down_s` seconds, started again on its saved state (an
    operator's restart, a controller failover): running jobs go on. -> seconds it was gone."""
    sdir = state_dir_of(state_dir)
    with machine_lock():
        rec = load(sdir)
        if not rec or not any(p["name"] == "slurmctld" and alive(p) for p in rec.get("procs", [])):
            raise SlurmError(f"no running slurmctld recorded in {sdir / RECORD}; start the cluster: "
                             "dslurm cluster up")
        return restart_controller(sdir, rec, down_s)


def status(state_dir: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """Settings, nodes and jobs of the cluster in `state_dir` (up=False if not running)."""
    sdir = state_dir_of(state_dir)
    rec = load(sdir)
    if not rec or not all(alive(p) for p in rec["procs"]):
        return {"up": False, "state_dir": str(sdir), "nodes": [], "jobs": []}
    env = info_of(sdir, rec).env()
    # host_cpus: the real cores all nodes share (their CPUs and memory are declared, not real).
    nodes = cc.running_nodes(slurm.nodes(env=env), rec["settings"]["nodes"])
    return {"up": True, "state_dir": str(sdir), "settings": rec["settings"], "host_cpus": os.cpu_count(),
            "nodes": nodes, "jobs": slurm.squeue(env=env)}



def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cluster", help="start/stop/show the built-in local real Slurm cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    for name, hlp in (("up", "start munge, slurmctld, N slurmd (+ slurmdbd, MariaDB)"),
                      ("down", "stop what `up` started, undo its system changes"),
                      ("status", "show nodes and jobs")):
        a = csub.add_parser(name, help=hlp)
        a.add_argument("--state-dir", default=None,
                       help=f"state dir (default ${ENV_DIR} or {DEFAULT_DIR})")
        if name == "status":
            a.add_argument("--json", action="store_true", help="print the status as JSON")
        if name == "up":
            a.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
            a.add_argument("--cpus", type=int, default=4, help="virtual CPUs per node (4)")
            a.add_argument("--accounting", action="store_true",
                           help="also run slurmdbd + MariaDB so sacct works")
            a.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                           help="declare N placeholder GPUs (gres gpu) per node; processes still run "
                                "on the CPU (default: as the running cluster, else 0)")
            a.add_argument("--constrain-devices", action=argparse.BooleanOptionalAction, default=None,
                           help="TaskPlugin=task/cgroup + ConstrainDevices=yes: a step's processes open only "
                                "the GPUs it was given, as on GPU sites (default: as the running cluster, "
                                "else off)")
            a.add_argument("--site-shape", action="append", default=None, metavar="FILE[:NODES]",
                           help="add a never-started partition shaped like this site config (its "
                                f"partition, GPUs, CPUs, memory; NODES nodes, default {DEFAULT_SHAPE_NODES}) "
                                "for `sbatch --test-only`; repeatable")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.cluster_command == "up":
        try:
            shapes = None if args.site_shape is None else tuple(parse_site_shape(a) for a in args.site_shape)
            info = up(nodes=args.nodes, accounting=args.accounting, state_dir=args.state_dir,
                      cpus=args.cpus, gpus=args.gpus_per_node, shapes=shapes,
                      constrain_devices=args.constrain_devices)
        except ValueError as exc:
            raise UserError(f"{exc} (flags --nodes, --cpus, --gpus-per-node, --site-shape)") from exc
        print(f"cluster up: {info.nodes} nodes ({','.join(info.node_names)}), partition "
              f"{info.partition}, accounting {'on' if info.accounting else 'off'}, "
              f"{info.gpus} placeholder GPU(s) per node{' (devices constrained)' if info.constrain_devices else ''}; "
              f"SLURM_CONF={info.slurm_conf}")
        from dslurm.cluster.show import shape_line

        for shape in info.shapes:  # status words the same line its own way (show.py)
            print(f"  --test-only {shape_line(shape)}")
        return 0
    if args.cluster_command == "down":
        stopped = down(args.state_dir)
        print("cluster stopped" if stopped else "no cluster running; nothing to do")
        return 0
    st = status(args.state_dir)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        from dslurm.cluster.show import format_status

        print("\n".join(format_status(st)))
    return 0
