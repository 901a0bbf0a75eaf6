"""The daemons of the local cluster: install their packages, prepare the state dir's files,
start munged, (MariaDB, slurmdbd,) slurmctld and one slurmd per node, wait until the nodes are
idle, and tear all of it down again (cancel jobs, stop exactly the recorded processes, undo the
host changes). Called by `up`/`down` in dslurm/cluster/__init__.py under the machine lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.cluster import conf as cc
from dslurm.cluster.devices import make_gpu_devices, remove_gpu_devices
from dslurm.cluster.host import install_system_changes, undo_system_changes
from dslurm.cluster.proc import alive, atomic_write, port_open, spawn_proc, stop, tail, wait_for
from dslurm.cluster.state import RECORD, save
from dslurm.errors import SlurmError, UserError

log = logging.getLogger(__name__)

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "tini"]
ACCT_PACKAGES = ["slurmdbd", "mariadb-server"]
_BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
             "munged": "munge", "tini": "tini", "unshare": "util-linux"}
_ACCT_BINARIES = {"slurmdbd": "slurmdbd", "mariadbd": "mariadb-server",
                  "mariadb-install-db": "mariadb-server"}


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


def start(spec: cc.ClusterSpec, rec: dict[str, Any]) -> None:
    sdir = spec.state_dir
    t0 = time.monotonic()
    _prepare_dirs(spec)
    save(sdir, rec)
    install_system_changes(spec, rec)
    env = {**os.environ, "SLURM_CONF": str(sdir / "etc" / "slurm.conf"),
           "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    sock = sdir / "munge" / "munge.socket.2"
    _spawn(rec, sdir, "munged", ["munged", "-F", f"--key-file={sdir}/secret/munge.key",
                                 f"--socket={sock}", f"--pid-file={sdir}/run/munged.pid",
                                 f"--seed-file={sdir}/secret/munged.seed",
                                 f"--log-file={sdir}/log/munged.log"], env)
    wait_for(lambda: sock.exists(), 10, "munged socket", sdir / "log" / "munged.out")
    if spec.accounting:
        _start_accounting(spec, rec, env)
    _spawn(rec, sdir, "slurmctld", ["slurmctld", "-D", "-f", str(sdir / "etc" / "slurm.conf")],
           env)
    for name in cc.node_names(spec.nodes):
        _spawn(rec, sdir, name, _slurmd_argv(name), env)
    _wait_idle(spec, rec, env)
    log.info("cluster up in %.1f s: %d nodes%s, state dir %s", time.monotonic() - t0,
             spec.nodes, " + accounting" if spec.accounting else "", sdir)


def _slurmd_argv(name: str) -> list[str]:
    # Own UTS namespace so `hostname` inside a job is the node name; tini -s reaps the
    # job processes slurmstepd leaves behind, which keeps step teardown fast.
    return ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec tini -s -- slurmd -D -N {name} -f "$SLURM_CONF"']


# Node states `repair` brings back with an explicit resume (a down node also returns by itself
# on registration: ReturnToService=2).
_RESUME = ("down", "drained", "draining", "drain", "fail", "failing")


def repair(spec: cc.ClusterSpec, rec: dict[str, Any]) -> bool:
    """Bring back what a node-loss test (or a crashed slurmd) took, leaving the controller and
    every job alone: restart the dead slurmds, resume down or drained nodes, wait until every
    node serves jobs again. A full restart cancels all jobs -- including those of another test
    session sharing this cluster (seen as 'CANCELLED by 0', and as jobs that vanished before
    accounting had them). -> False when the controller side itself is not alive (then only a
    restart helps); raises SlurmError when the nodes do not come back."""
    sdir = spec.state_dir
    core = [p for p in rec.get("procs", []) if not p["name"].startswith("node")]
    if not core or not all(alive(p) for p in core):
        return False
    env = {**os.environ, "SLURM_CONF": str(sdir / "etc" / "slurm.conf"),
           "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    for p in [p for p in rec["procs"] if p["name"].startswith("node") and not alive(p)]:
        log.warning("cluster: %s's slurmd is gone; starting it again", p["name"])
        rec["procs"].remove(p)
        _spawn(rec, sdir, p["name"], _slurmd_argv(p["name"]), env)
        # Listening means registered with slurmctld next: until then sinfo may still show the old one.
        port = cc.node_port(int(p["name"].removeprefix("node")))
        wait_for(lambda: port_open(port), 30 * slurm.load_factor(), f"{p['name']}'s slurmd port",
                 sdir / "log" / f"{p['name']}.out")
    _wait_idle(spec, rec, env, timeout=60 * slurm.load_factor(), serving=True, resume=True)
    return True


def restart_controller(sdir: Path, rec: dict[str, Any], down_s: float) -> float:
    """Stop slurmctld (SIGTERM: it saves its state), leave it down for `down_s`, start it again
    from the same StateSaveLocation, and wait until it answers: jobs, allocations and job steps
    live on (slurmd keeps the steps running). The caller holds the machine lock, so no `up`
    restarts the whole cluster meanwhile. -> seconds it did not answer."""
    env = {**os.environ, "SLURM_CONF": str(sdir / "etc" / "slurm.conf"),
           "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    old = next(p for p in rec["procs"] if p["name"] == "slurmctld")
    t0 = time.monotonic()
    stop([old], grace=10)
    rec["procs"].remove(old)
    save(sdir, rec)
    time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
    _spawn(rec, sdir, "slurmctld", ["slurmctld", "-D", "-f", str(sdir / "etc" / "slurm.conf")], env)
    wait_for(lambda: port_open(cc.CTLD_PORT), 30 * slurm.load_factor(), "slurmctld port",
             sdir / "log" / "slurmctld.out")
    conf = {"SLURM_CONF": env["SLURM_CONF"]}
    deadline = time.monotonic() + 30 * slurm.load_factor()
    while time.monotonic() < deadline:  # answering, not only listening
        if slurm.run_cmd(["squeue", "-h"], check=False, timeout=10, env=conf).returncode == 0:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def running_spec(sdir: Path, rec: dict[str, Any]) -> cc.ClusterSpec:
    """The spec the running cluster's slurm.conf was rendered from: its recorded settings, this host,
    and the FirstJobId its start chose (read back from the file)."""
    s = rec["settings"]
    text = (sdir / "etc" / "slurm.conf").read_text()
    return cc.ClusterSpec(state_dir=sdir, nodes=s["nodes"], cpus=s["cpus"], memory_mb=s["memory_mb"],
                          accounting=s["accounting"], gpus=int(s.get("gpus", 0)),
                          shapes=cc.shapes_from_settings(s.get("shapes")), controller_host=socket.gethostname(),
                          constrain_devices=bool(s.get("constrain_devices")),
                          first_job_id=cc.first_job_id_of(text) or 1)


def write_conf(spec: cc.ClusterSpec) -> None:
    """Render slurm.conf from `spec` and have the running daemons reread it (RUNTIME_KEYS only: other
    keys need a restart)."""
    conf = spec.state_dir / "etc" / "slurm.conf"
    atomic_write(conf, cc.render_slurm_conf(spec).encode())
    slurm.run_cmd(["scontrol", "reconfigure"], timeout=30, env={"SLURM_CONF": str(conf)})


def restore_conf(sdir: Path, rec: dict[str, Any]) -> bool:
    """Render slurm.conf again when only RUNTIME_KEYS differ from what its spec renders (a test that changed
    one was killed before it put it back), and reconfigure. -> whether it was rewritten. Any other
    difference (this dslurm renders a different conf than the one started) is left for a restart."""
    try:
        spec = running_spec(sdir, rec)
        text = (sdir / "etc" / "slurm.conf").read_text()
    except (OSError, KeyError, ValueError) as exc:
        log.warning("cluster in %s: slurm.conf not checked (%s)", sdir, exc)
        return False
    keys = cc.changed_keys(text, cc.render_slurm_conf(spec))
    if not keys:
        return False
    if not keys <= cc.RUNTIME_KEYS:
        log.info("cluster in %s: slurm.conf differs from what this dslurm renders in %s; `dslurm cluster down` "
                 "then `up` applies it", sdir, ", ".join(sorted(keys)))
        return False
    log.warning("cluster in %s: slurm.conf has %s changed; rendering it back", sdir, ", ".join(sorted(keys)))
    write_conf(spec)
    return True


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
    wait_for(lambda: port_open(cc.MYSQL_PORT), 30, "MariaDB port", sdir / "log" / "mariadb.log")
    _spawn(rec, sdir, "slurmdbd", ["slurmdbd", "-D"], env)
    wait_for(lambda: port_open(cc.DBD_PORT), 60, "slurmdbd port", sdir / "log" / "slurmdbd.log")


def check_ports_free(spec: cc.ClusterSpec) -> None:
    ports = [cc.CTLD_PORT, *(cc.node_port(k) for k in range(1, spec.nodes + 1))]
    if spec.accounting:
        ports += [cc.DBD_PORT, cc.MYSQL_PORT]
    busy = [p for p in ports if port_open(p)]
    if busy:
        raise UserError(
            f"ports {busy} are in use by processes that {spec.state_dir / RECORD} does not "
            "record (a dslurm cluster from another --state-dir, or daemons left from a run "
            f"whose record was deleted); find them with `ss -ltnp | grep -E "
            f"'{'|'.join(map(str, busy))}'` and stop them")


def _spawn(rec: dict[str, Any], sdir: Path, name: str, argv: list[str], env: dict[str, str]) -> None:
    rec["procs"].append(spawn_proc(name, argv, sdir / "log" / f"{name}.out", env))
    save(sdir, rec)  # recorded at once: a crash right after still lets `down` find it


def _wait_idle(spec: cc.ClusterSpec, rec: dict[str, Any], env: dict[str, str],
               timeout: float = 30, *, serving: bool = False, resume: bool = False) -> None:
    """Until every node is idle (`serving`: idle or running jobs); `resume`: ask Slurm to resume
    nodes that are down or drained, once their slurmd answers."""
    sdir = spec.state_dir
    want = ("idle", "allocated", "mixed", "completing") if serving else ("idle",)
    resumed: set[str] = set()
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        dead = [p["name"] for p in rec["procs"] if not alive(p)]
        if dead:  # fail fast with the reason instead of waiting out the timeout
            raise SlurmError(f"{dead} exited during start; {sdir}/log/{dead[0]}.out:\n"
                             + tail(sdir / "log" / f"{dead[0]}.out"))
        try:
            proc = slurm.run_cmd(["sinfo", "-N", "-h", "-o", "%N|%T|%c|%m|%P"], check=False,
                                 timeout=5, env={"SLURM_CONF": env["SLURM_CONF"]})
        except SlurmError as exc:  # slow answer while daemons start: ask again
            last = str(exc)
            continue
        if proc.returncode == 0:
            running = cc.running_nodes(slurm.parse_sinfo_nodes(proc.stdout), spec.nodes)
            states = {n["name"]: n["state"] for n in running}
            last = str(states)
            if len(states) == spec.nodes and all(s in want for s in states.values()):
                return
            for n in running:
                if resume and n["responding"] and n["state"] in _RESUME and n["name"] not in resumed:
                    slurm.run_cmd(["scontrol", "update", f"NodeName={n['name']}", "State=RESUME"], check=False,
                                  timeout=10, env={"SLURM_CONF": env["SLURM_CONF"]})
                    resumed.add(str(n["name"]))
        else:
            last = proc.stderr.strip()
        time.sleep(0.2)
    raise SlurmError(f"nodes not idle after {timeout:g} s ({last}); see logs in {sdir}/log:\n"
                     + tail(sdir / "log" / "slurmctld.log"))


def teardown(sdir: Path, rec: dict[str, Any]) -> None:
    procs = [p for p in rec.get("procs", []) if alive(p)]
    if any(p["name"] == "slurmctld" for p in procs):
        _cancel_all_jobs(sdir)
    # Reverse start order: all slurmds at once, then slurmctld, slurmdbd, mariadbd, munged.
    stop([p for p in procs if p["name"].startswith("node")])
    for p in reversed(procs):
        if not p["name"].startswith("node"):
            stop([p], grace=10 if p["name"] == "mariadbd" else 5)
    undo_system_changes(rec.get("changes", {}), sdir)
    remove_gpu_devices(sdir)
    (sdir / RECORD).unlink(missing_ok=True)


def _cancel_all_jobs(sdir: Path) -> None:
    """Cancel jobs first so accounting records them as CANCELLED, not lost mid-run."""
    env = {"SLURM_CONF": str(sdir / "etc" / "slurm.conf")}
    proc = slurm.run_cmd(["squeue", "-h", "-o", "%A"], check=False, timeout=5, env=env)
    ids = proc.stdout.split() if proc.returncode == 0 else []
    if ids:
        slurm.run_cmd(["scancel", *ids], check=False, timeout=5, env=env)


# ------------------------------------------------------------------ state dir files

def _prepare_dirs(spec: cc.ClusterSpec) -> None:
    sdir = spec.state_dir
    # Controller state and spool are wiped on every fresh start: jobs of a crashed run must
    # not come back. Job ids stay unique through FirstJobId (see first_job_id).
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
        atomic_write(key, os.urandom(1024), mode=0o400)
    atomic_write(sdir / "etc" / "slurm.conf", cc.render_slurm_conf(spec).encode())
    atomic_write(sdir / "etc" / "gres.conf", cc.render_gres_conf(spec).encode())
    atomic_write(sdir / "etc" / "cgroup.conf", cc.render_cgroup_conf(spec).encode())
    make_gpu_devices(sdir, spec.nodes, spec.gpus)
    if spec.accounting:
        atomic_write(sdir / "etc" / "slurmdbd.conf", cc.render_slurmdbd_conf(spec).encode(),
                     mode=0o600)


def first_job_id(sdir: Path) -> int:
    """After every job id the previous runs of this state dir logged, and time-based."""
    logf = sdir / "log" / "slurmctld.log"
    text = ""
    if logf.exists():
        with logf.open("rb") as f:
            f.seek(max(0, logf.stat().st_size - 8 * 2**20))
            text = f.read().decode(errors="replace")
    return cc.next_first_job_id(time.time(), cc.max_job_id_in_log(text))
