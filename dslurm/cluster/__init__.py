"""`dslurm cluster up|down|status`: a real Slurm (22.05) on this one machine.

munged, slurmctld and N slurmd daemons (node1..nodeN, each in its own UTS namespace so
`hostname` differs per node, each under a `tini -s` subreaper), plus slurmdbd + MariaDB with
`--accounting` (so sacct works; submitit needs it). No systemd.

`--gpus-per-node N` declares N placeholder GPUs (gres gpu) per node, so GPU-style jobs
(`--gpus-per-node`, `--gres=gpu:N`) are scheduled by the real slurmctld and get Slurm's GPU
environment (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES); their processes run on
the CPU. `--site-shape FILE[:NODES]` adds a never-started partition shaped like that site for
`sbatch --test-only` (dslurm/cluster/conf.py says how both work; shapes.py reads the site
file, devices.py makes the placeholder GPU devices).

State dir (default `$DSLURM_CLUSTER_DIR` or /tmp/dslurm-cluster) holds config, logs, spool,
controller state, MariaDB data and `cluster.json`: the settings, every PID started (with its
start time, so a recycled PID is never killed) and every system change made. `down` stops
exactly those processes and undoes exactly those changes:
  - a line in /etc/hosts marked `# dslurm-cluster <state dir>` (node names -> 127.0.0.1);
  - /etc/slurm/slurm.conf as a symlink to the state dir's slurm.conf, so client commands work
    without SLURM_CONF (an existing file is kept as /etc/slurm/slurm.conf.dslurm-orig and
    restored).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.cluster import conf as cc
from dslurm.cluster.devices import make_gpu_devices, remove_gpu_devices
from dslurm.cluster.proc import (  # process and file helpers, kept apart for size
    alive as _alive,
)
from dslurm.cluster.proc import (
    atomic_write as _atomic_write,
)
from dslurm.cluster.proc import (
    port_open as _port_open,
)
from dslurm.cluster.proc import (
    spawn_proc as _spawn_proc,
)
from dslurm.cluster.proc import (
    stop as _stop,
)
from dslurm.cluster.proc import (
    tail as _tail,
)
from dslurm.cluster.proc import (
    wait_for as _wait_for,
)
from dslurm.cluster.proc import (
    write_in_place_or_atomic as _write_in_place_or_atomic,
)
from dslurm.cluster.shapes import DEFAULT_SHAPE_NODES as DEFAULT_SHAPE_NODES  # `X as X`: re-exported,
from dslurm.cluster.shapes import parse_site_shape as parse_site_shape  # tests import both from here
from dslurm.errors import SlurmError, UserError

log = logging.getLogger(__name__)

ENV_DIR = "DSLURM_CLUSTER_DIR"
DEFAULT_DIR = Path("/tmp/dslurm-cluster")
ETC_CONF = Path("/etc/slurm/slurm.conf")
ETC_BACKUP = Path("/etc/slurm/slurm.conf.dslurm-orig")
HOSTS = Path("/etc/hosts")
# One lock for the whole machine: clusters share ports, /etc/hosts and /etc/slurm.
LOCK_PATH = Path(tempfile.gettempdir()) / "dslurm-cluster.lock"
RECORD = "cluster.json"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "tini"]
ACCT_PACKAGES = ["slurmdbd", "mariadb-server"]
_BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
             "munged": "munge", "tini": "tini", "unshare": "util-linux"}
_ACCT_BINARIES = {"slurmdbd": "slurmdbd", "mariadbd": "mariadb-server",
                  "mariadb-install-db": "mariadb-server"}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ClusterInfo:
    """A running local cluster, as `up` returns it."""

    state_dir: Path
    nodes: int
    accounting: bool
    node_names: tuple[str, ...]
    partition: str = cc.PARTITION
    gpus: int = 0
    """placeholder GPUs per node"""
    shapes: tuple[cc.NodeShape, ...] = ()

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """Environment for client commands (also found via /etc/slurm/slurm.conf)."""
        return {"SLURM_CONF": str(self.slurm_conf)}


def state_dir_of(state_dir: str | os.PathLike[str] | None) -> Path:
    return Path(state_dir or os.environ.get(ENV_DIR) or DEFAULT_DIR).absolute()


# ------------------------------------------------------------------ public API

def up(nodes: int = 2, accounting: bool = False, state_dir: str | os.PathLike[str] | None = None,
       cpus: int = 4, gpus: int | None = None, shapes: tuple[cc.NodeShape, ...] | None = None) -> ClusterInfo:
    """Start the cluster (or leave a healthy one with the same settings alone).

    `gpus` / `shapes` None: as the recorded cluster has them (none for a fresh one), so a test
    that brings a killed node back with `up(nodes=3, accounting=True)` keeps the session's GPUs."""
    sdir = state_dir_of(state_dir)
    # A healthy cluster with these settings is left alone without taking the machine lock: a test
    # session run under `flock /tmp/dslurm-cluster.lock` (how sessions sharing the cluster take
    # turns) holds that very lock, and would deadlock here. Reading health outside the lock
    # promises no less than inside it: a `down` may follow either way.
    rec = _load(sdir)
    if rec and _same(rec, nodes, accounting, cpus, gpus, shapes) and _healthy(sdir, rec):
        return _info(sdir, rec)
    with _machine_lock():
        rec = _load(sdir)
        old = rec.get("settings", {}) if rec else {}
        # Validate first: a bad --nodes must not tear down a running cluster.
        spec = cc.ClusterSpec(state_dir=sdir, nodes=nodes, cpus=cpus, accounting=accounting,
                              gpus=int(old.get("gpus", 0)) if gpus is None else gpus,
                              shapes=cc.shapes_from_settings(old.get("shapes")) if shapes is None else shapes,
                              controller_host=socket.gethostname(),
                              first_job_id=_first_job_id(sdir))
        wanted = spec.settings()
        if rec and _healthy(sdir, rec):
            if rec["settings"] == wanted:
                log.info("cluster in %s already up with %s", sdir, wanted)
                return _info(sdir, rec)
            log.warning("cluster in %s runs with %s; restarting with %s",
                        sdir, rec["settings"], wanted)
        if os.geteuid() != 0:  # only now: a running cluster is usable without root
            raise UserError("`dslurm cluster up` needs root: it runs the Slurm daemons as "
                            f"root and edits {HOSTS} and {ETC_CONF}; run it with sudo")
        if rec:
            _teardown(sdir, rec)  # leftovers of a crashed or differently-configured run
        ensure_packages(accounting)
        _check_ports_free(spec)
        rec = {"settings": spec.settings(), "procs": [], "changes": {}}
        try:
            _start(spec, rec)
        except BaseException:
            _teardown(sdir, rec)
            raise
        return _info(sdir, rec)


def _same(rec: dict[str, Any], nodes: int, accounting: bool, cpus: int, gpus: int | None,
          shapes: tuple[cc.NodeShape, ...] | None) -> bool:
    """The recorded cluster has these settings (None: any GPUs / shapes)."""
    s = rec.get("settings", {})
    return (s.get("nodes") == nodes and s.get("accounting") == accounting and s.get("cpus") == cpus
            and (gpus is None or s.get("gpus", 0) == gpus)
            and (shapes is None or cc.shapes_from_settings(s.get("shapes")) == tuple(shapes)))


def down(state_dir: str | os.PathLike[str] | None = None) -> bool:
    """Stop what `up` started and undo its system changes. False if nothing was running."""
    sdir = state_dir_of(state_dir)
    with _machine_lock():
        rec = _load(sdir)
        if not rec:
            return False
        _teardown(sdir, rec)
        return True


def is_up(state_dir: str | os.PathLike[str] | None = None) -> bool:
    sdir = state_dir_of(state_dir)
    rec = _load(sdir)
    return rec is not None and bool(rec) and _healthy(sdir, rec)


def status(state_dir: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """Settings, nodes and jobs of the cluster in `state_dir` (up=False if not running)."""
    sdir = state_dir_of(state_dir)
    rec = _load(sdir)
    if not rec or not all(_alive(p) for p in rec["procs"]):
        return {"up": False, "state_dir": str(sdir), "nodes": [], "jobs": []}
    env = _info(sdir, rec).env()
    # host_cpus: the real cores all nodes share (their CPUs and memory are declared, not real).
    running = set(_info(sdir, rec).node_names)  # shaped (never-started) nodes are in settings
    return {"up": True, "state_dir": str(sdir), "settings": rec["settings"], "host_cpus": os.cpu_count(),
            "nodes": [n for n in slurm.nodes(env=env) if n["name"] in running], "jobs": slurm.squeue(env=env)}


def ensure_packages(accounting: bool) -> None:
    """Install missing Debian packages when root; otherwise say exactly what to install."""
    binaries = {**_BINARIES, **(_ACCT_BINARIES if accounting else {})}
    missing = sorted({pkg for exe, pkg in binaries.items() if not _which(exe)})
    if not missing:
        return
    wanted = PACKAGES + (ACCT_PACKAGES if accounting else [])
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *wanted]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise UserError(f"missing packages {missing}; install them as root: `{' '.join(cmd)}` "
                        "(or run scripts/install-system-deps.sh)")
    log.info("installing %s", " ".join(wanted))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-2000:]}")


def _which(exe: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(exe) or shutil.which(exe, path="/usr/sbin:/sbin")


# ------------------------------------------------------------------ start / stop

def _start(spec: cc.ClusterSpec, rec: dict[str, Any]) -> None:
    sdir = spec.state_dir
    t0 = time.monotonic()
    _prepare_dirs(spec)
    _save(sdir, rec)
    _install_system_changes(spec, rec)
    env = {**os.environ, "SLURM_CONF": str(sdir / "etc" / "slurm.conf"),
           "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    sock = sdir / "munge" / "munge.socket.2"
    _spawn(rec, sdir, "munged", ["munged", "-F", f"--key-file={sdir}/secret/munge.key",
                                 f"--socket={sock}", f"--pid-file={sdir}/run/munged.pid",
                                 f"--seed-file={sdir}/secret/munged.seed",
                                 f"--log-file={sdir}/log/munged.log"], env)
    _wait_for(lambda: sock.exists(), 10, "munged socket", sdir / "log" / "munged.out")
    if spec.accounting:
        _start_accounting(spec, rec, env)
    _spawn(rec, sdir, "slurmctld", ["slurmctld", "-D", "-f", str(sdir / "etc" / "slurm.conf")],
           env)
    for name in cc.node_names(spec.nodes):
        # Own UTS namespace so `hostname` inside a job is the node name; tini -s reaps the
        # job processes slurmstepd leaves behind, which keeps step teardown fast.
        _spawn(rec, sdir, name, ["unshare", "--uts", "sh", "-c",
                                 f'hostname {name} && exec tini -s -- slurmd -D -N {name} '
                                 f'-f "$SLURM_CONF"'], env)
    _wait_idle(spec, rec, env)
    log.info("cluster up in %.1f s: %d nodes%s, state dir %s", time.monotonic() - t0,
             spec.nodes, " + accounting" if spec.accounting else "", sdir)


def _start_accounting(spec: cc.ClusterSpec, rec: dict[str, Any], env: dict[str, str]) -> None:
    sdir = spec.state_dir
    datadir = sdir / "mysql"
    if not (datadir / "mysql").is_dir():
        # Kept across down/up: initialising and creating Slurm's tables takes seconds.
        shutil.rmtree(datadir, ignore_errors=True)
        proc = subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SlurmError(f"mariadb-install-db failed: {proc.stderr.strip()[-2000:]}")
    _spawn(rec, sdir, "mariadbd", ["mariadbd", *cc.mariadb_args(spec)], env)
    _wait_for(lambda: _port_open(cc.MYSQL_PORT), 30, "MariaDB port",
                sdir / "log" / "mariadb.log")
    _spawn(rec, sdir, "slurmdbd", ["slurmdbd", "-D"], env)
    _wait_for(lambda: _port_open(cc.DBD_PORT), 60, "slurmdbd port",
                sdir / "log" / "slurmdbd.log")


def _check_ports_free(spec: cc.ClusterSpec) -> None:
    ports = [cc.CTLD_PORT, *(cc.node_port(k) for k in range(1, spec.nodes + 1))]
    if spec.accounting:
        ports += [cc.DBD_PORT, cc.MYSQL_PORT]
    busy = [p for p in ports if _port_open(p)]
    if busy:
        raise UserError(
            f"ports {busy} are in use by processes that {spec.state_dir / RECORD} does not "
            "record (a dslurm cluster from another --state-dir, or daemons left from a run "
            f"whose record was deleted); find them with `ss -ltnp | grep -E "
            f"'{'|'.join(map(str, busy))}'` and stop them")


def _spawn(rec: dict[str, Any], sdir: Path, name: str, argv: list[str], env: dict[str, str]) -> None:
    rec["procs"].append(_spawn_proc(name, argv, sdir / "log" / f"{name}.out", env))
    _save(sdir, rec)  # recorded at once: a crash right after still lets `down` find it


def _wait_idle(spec: cc.ClusterSpec, rec: dict[str, Any], env: dict[str, str],
               timeout: float = 30) -> None:
    sdir = spec.state_dir
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        dead = [p["name"] for p in rec["procs"] if not _alive(p)]
        if dead:  # fail fast with the reason instead of waiting out the timeout
            raise SlurmError(f"{dead} exited during start; {sdir}/log/{dead[0]}.out:\n"
                             + _tail(sdir / "log" / f"{dead[0]}.out"))
        try:
            proc = slurm.run_cmd(["sinfo", "-N", "-h", "-o", "%N|%T|%c|%m|%P"], check=False,
                                 timeout=5, env={"SLURM_CONF": env["SLURM_CONF"]})
        except SlurmError as exc:  # slow answer while daemons start: ask again
            last = str(exc)
            continue
        if proc.returncode == 0:
            running = set(cc.node_names(spec.nodes))  # not the never-started shaped nodes
            states = {n["name"]: n["state"] for n in slurm.parse_sinfo_nodes(proc.stdout) if n["name"] in running}
            last = str(states)
            if len(states) == spec.nodes and all(s == "idle" for s in states.values()):
                return
        else:
            last = proc.stderr.strip()
        time.sleep(0.2)
    raise SlurmError(f"nodes not idle after {timeout:g} s ({last}); see logs in {sdir}/log:\n"
                     + _tail(sdir / "log" / "slurmctld.log"))


def _teardown(sdir: Path, rec: dict[str, Any]) -> None:
    procs = [p for p in rec.get("procs", []) if _alive(p)]
    if any(p["name"] == "slurmctld" for p in procs):
        _cancel_all_jobs(sdir)
    # Reverse start order: all slurmds at once, then slurmctld, slurmdbd, mariadbd, munged.
    _stop([p for p in procs if p["name"].startswith("node")])
    for p in reversed(procs):
        if not p["name"].startswith("node"):
            _stop([p], grace=10 if p["name"] == "mariadbd" else 5)
    _undo_system_changes(rec.get("changes", {}), sdir)
    remove_gpu_devices(sdir)
    (sdir / RECORD).unlink(missing_ok=True)


def _cancel_all_jobs(sdir: Path) -> None:
    """Cancel jobs first so accounting records them as CANCELLED, not lost mid-run."""
    env = {"SLURM_CONF": str(sdir / "etc" / "slurm.conf")}
    proc = slurm.run_cmd(["squeue", "-h", "-o", "%A"], check=False, timeout=5, env=env)
    ids = proc.stdout.split() if proc.returncode == 0 else []
    if ids:
        slurm.run_cmd(["scancel", *ids], check=False, timeout=5, env=env)


def _healthy(sdir: Path, rec: dict[str, Any]) -> bool:
    if not rec.get("procs") or not all(_alive(p) for p in rec["procs"]):
        return False
    env = {"SLURM_CONF": str(sdir / "etc" / "slurm.conf")}
    try:  # generous timeout: a loaded 2-core machine must not get its cluster restarted
        proc = slurm.run_cmd(["sinfo", "-N", "-h", "-o", "%N|%T|%c|%m|%P"], check=False,
                             timeout=20, env=env)
    except SlurmError:
        return False
    if proc.returncode != 0:
        return False
    running = set(cc.node_names(rec["settings"]["nodes"]))
    nodes = [n for n in slurm.parse_sinfo_nodes(proc.stdout) if n["name"] in running]
    ok = {"idle", "allocated", "mixed", "completing"}
    return len(nodes) == rec["settings"]["nodes"] and all(
        n["responding"] and n["state"] in ok for n in nodes)


def _info(sdir: Path, rec: dict[str, Any]) -> ClusterInfo:
    s = rec["settings"]
    return ClusterInfo(state_dir=sdir, nodes=s["nodes"], accounting=s["accounting"],
                       node_names=tuple(cc.node_names(s["nodes"])), gpus=int(s.get("gpus", 0)),
                       shapes=cc.shapes_from_settings(s.get("shapes")))


# ------------------------------------------------------------------ files and system changes

def _prepare_dirs(spec: cc.ClusterSpec) -> None:
    sdir = spec.state_dir
    # Controller state and spool are wiped on every fresh start: jobs of a crashed run must
    # not come back. Job ids stay unique through FirstJobId (see _first_job_id).
    for sub in ("ctld", "spool", "run", "munge"):
        shutil.rmtree(sdir / sub, ignore_errors=True)
    remove_gpu_devices(sdir)
    for sub in ("etc", "log", "ctld", "run", "secret", "munge",
                *(f"spool/{n}" for n in cc.node_names(spec.nodes))):
        (sdir / sub).mkdir(parents=True, exist_ok=True)
    # munged insists: socket dir traversable by all, key readable only by its owner.
    for d in (sdir, sdir / "munge"):
        d.chmod(0o755)
    (sdir / "secret").chmod(0o700)
    key = sdir / "secret" / "munge.key"
    if not key.exists():
        _atomic_write(key, os.urandom(1024), mode=0o400)
    _atomic_write(sdir / "etc" / "slurm.conf", cc.render_slurm_conf(spec).encode())
    _atomic_write(sdir / "etc" / "gres.conf", cc.render_gres_conf(spec).encode())
    make_gpu_devices(sdir, spec.nodes, spec.gpus)
    if spec.accounting:
        _atomic_write(sdir / "etc" / "slurmdbd.conf", cc.render_slurmdbd_conf(spec).encode(),
                        mode=0o600)


def _first_job_id(sdir: Path) -> int:
    """After every job id the previous runs of this state dir logged, and time-based."""
    logf = sdir / "log" / "slurmctld.log"
    text = ""
    if logf.exists():
        with logf.open("rb") as f:
            f.seek(max(0, logf.stat().st_size - 8 * 2**20))
            text = f.read().decode(errors="replace")
    return cc.next_first_job_id(time.time(), cc.max_job_id_in_log(text))


def _install_system_changes(spec: cc.ClusterSpec, rec: dict[str, Any]) -> None:
    sdir, changes = spec.state_dir, rec["changes"]
    line = cc.hosts_line(spec.nodes, sdir)
    hosts = HOSTS.read_text() if HOSTS.exists() else ""
    marker = f"# dslurm-cluster {sdir}"
    kept = [ln for ln in hosts.splitlines() if not ln.endswith(marker)]  # stale lines of ours
    _write_in_place_or_atomic(HOSTS, "\n".join([*kept, line]) + "\n")
    changes["hosts_line"] = line
    _save(sdir, rec)
    target = sdir / "etc" / "slurm.conf"
    if ETC_CONF.is_symlink():
        current = Path(os.readlink(ETC_CONF))
        other = current.parent.parent
        if current != target and other != sdir and is_up(other):
            raise UserError(f"another dslurm cluster is running from {other}; stop it with "
                            f"`dslurm cluster down --state-dir {other}`")
        ETC_CONF.unlink()  # ours, or a stale link of a crashed run
    elif ETC_CONF.exists():
        if ETC_BACKUP.exists():
            raise UserError(f"both {ETC_CONF} and {ETC_BACKUP} exist; move one away")
        ETC_CONF.rename(ETC_BACKUP)
        log.info("kept the existing %s as %s (restored by `cluster down`)", ETC_CONF, ETC_BACKUP)
    ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
    ETC_CONF.symlink_to(target)
    changes["etc_conf_link"] = str(target)
    _save(sdir, rec)


def _undo_system_changes(changes: dict[str, Any], sdir: Path) -> None:
    line = changes.get("hosts_line")
    if line and HOSTS.exists():
        lines = HOSTS.read_text().splitlines()
        if line in lines:
            _write_in_place_or_atomic(
                HOSTS, "".join(ln + "\n" for ln in lines if ln != line))
    link = changes.get("etc_conf_link")
    if link and ETC_CONF.is_symlink() and os.readlink(ETC_CONF) == link:
        ETC_CONF.unlink()
        if ETC_BACKUP.exists():
            ETC_BACKUP.rename(ETC_CONF)


def _load(sdir: Path) -> dict[str, Any] | None:
    try:
        rec: dict[str, Any] = json.loads((sdir / RECORD).read_text())
        return rec
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, OSError) as exc:
        raise UserError(f"{sdir / RECORD} is unreadable ({exc}); stop any dslurm daemons "
                        f"by hand and delete the file") from exc


def _save(sdir: Path, rec: dict[str, Any]) -> None:
    _atomic_write(sdir / RECORD, (json.dumps(rec, indent=1) + "\n").encode())


class _machine_lock:
    def __enter__(self) -> None:
        self._fd = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # releases the flock


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
                      cpus=args.cpus, gpus=args.gpus_per_node, shapes=shapes)
        except ValueError as exc:
            raise UserError(f"{exc} (flags --nodes, --cpus, --gpus-per-node, --site-shape)") from exc
        print(f"cluster up: {info.nodes} nodes ({','.join(info.node_names)}), partition "
              f"{info.partition}, accounting {'on' if info.accounting else 'off'}, "
              f"{info.gpus} placeholder GPU(s) per node; SLURM_CONF={info.slurm_conf}")
        for shape in info.shapes:
            print(f"  --test-only partition {shape.partition}: {shape.nodes} never-started node(s) of "
                  f"{shape.gpus} GPU(s), {shape.cpus} CPUs, {shape.memory_mb} MB")
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
