"""The one wrapper for every Slurm command, plus thin helpers on top of it.

`run_cmd` is the only place that runs sbatch/scontrol/squeue/sacct/scancel: it turns every
failure into `SlurmError` carrying Slurm's own stderr. Parsing lives in pure functions
(`parse_*`) that the unit tests drive with captured Slurm 22.05 output.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence

from dslurm.errors import SlurmError

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
    "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
})
_KEY = re.compile(r"^[A-Za-z][\w/:.]*=")
_HINT_UP = "is the cluster up? try `dslurm cluster up`"
# Phrases Slurm prints when it cannot reach slurmctld/slurmdbd or authenticate (munge).
_UNREACHABLE = (
    "Unable to contact slurm controller", "Socket timed out", "Connection refused",
    "Unable to establish connection", "Zero Bytes were transmitted",
    "Munge encode failed", "Could not establish a configuration source",
    "Unable to process configuration file",
)


def run_cmd(args: Sequence[str], *, timeout: float = 60, check: bool = True,
            input: str | None = None, env: Mapping[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    """Run one Slurm command; on failure raise SlurmError with Slurm's reason.

    `env` is added on top of os.environ (e.g. SLURM_CONF from ClusterInfo.env()).
    """
    cmd = [str(a) for a in args]
    full_env = {**os.environ, **env} if env else None
    log.debug("run: %s", shlex.join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              input=input, env=full_env, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(
            f"`{cmd[0]}` is not installed (PATH={os.environ.get('PATH', '')}); install the "
            "Slurm client (`apt-get install slurm-client`, or scripts/install-system-deps.sh) "
            f"and start a cluster: {_HINT_UP}") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"`{shlex.join(cmd)}` did not answer within {timeout:g} s; "
                         f"{_HINT_UP}") from exc
    if check and proc.returncode != 0:
        raise SlurmError(failure_message(cmd, proc.returncode, proc.stderr, proc.stdout))
    return proc


def failure_message(cmd: Sequence[str], returncode: int, stderr: str, stdout: str = "") -> str:
    """Message for a failed Slurm command: the command, Slurm's reason, and a hint if down."""
    reason = (stderr or stdout).strip() or "(no output)"
    msg = f"`{shlex.join(cmd)}` failed (exit {returncode}): {reason}"
    if any(p.lower() in reason.lower() for p in _UNREACHABLE):
        msg += f"\n  {_HINT_UP}"
    return msg


# ---------------------------------------------------------------- pure parsers

def parse_parsable_job_id(stdout: str) -> int:
    """`sbatch --parsable` prints `jobid` or `jobid;cluster`."""
    first = stdout.strip().splitlines()[0] if stdout.strip() else ""
    head = first.split(";", 1)[0].strip()
    if not head.isdigit():
        raise SlurmError(f"sbatch --parsable printed {stdout!r}; expected a job id")
    return int(head)


def parse_kv_line(line: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` record: space-separated Key=Value pairs.

    Values may contain spaces (e.g. Command=, Reason=) — a token without '=' belongs to the
    previous value.
    """
    out: dict[str, str] = {}
    key: str | None = None
    for token in line.strip().split(" "):
        if _KEY.match(token):  # `--lr=3` inside Command= is not a key
            key, _, value = token.partition("=")
            out[key] = value
        elif key is not None and token:
            out[key] += " " + token
    return out


def parse_scontrol_records(stdout: str) -> list[dict[str, str]]:
    """Every non-empty line of `scontrol -o show job|node` as one dict."""
    return [parse_kv_line(ln) for ln in stdout.splitlines() if ln.strip()]


def job_info_from_scontrol(rec: Mapping[str, str]) -> dict[str, object]:
    """Normalise one `scontrol -o show job` record."""
    state = rec.get("JobState", "UNKNOWN")
    reason = rec.get("Reason", "None")
    return {
        "job_id": int(rec.get("JobId", "0")),
        "name": rec.get("JobName", ""),
        "state": state,
        "nodes": rec.get("NodeList", "(null)") if rec.get("NodeList") != "(null)" else "",
        "num_nodes": _int(rec.get("NumNodes", "0").split("-")[0]),
        "restarts": _int(rec.get("Restarts", "0")),
        "exit_code": rec.get("ExitCode", ""),
        "reason": "" if reason == "None" else reason,
        "source": "scontrol",
    }


SACCT_FIELDS = "JobID,JobName,State,NodeList,ExitCode,Reason,NNodes"
# Accounting's record of a job that lost a node under --no-kill (dslurm supervise): Slurm closes
# the record and opens a new one for the smaller job. Not a requeue: no new start, no restart.
RESIZING = "RESIZING"


def parse_sacct(stdout: str) -> dict[str, object] | None:
    """Parse `sacct -D -X -n -P -o SACCT_FIELDS`: one line per incarnation of the job (`-D`:
    a requeued job has one per start, oldest first). The last line is the job now; the number
    of lines is its restarts + 1.

    The text form, not `--json`: Slurm 22.05's `sacct --json` reports every exit code as
    0/SUCCESS (a FAILED job that exited 76 reads `{"status": "SUCCESS", "return_code": 0}`).
    Accounting keeps the reason the job last waited for (`BeginTime` after a requeue) even
    once it ran and ended, so a reason is kept only while the job is still pending.
    """
    rows = []
    for line in stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 7 or not parts[0].split("_")[0].isdigit():
            continue  # a step line (123.batch) or noise
        if parts[2].startswith(RESIZING):
            continue  # a --no-kill job shrunk after a node loss: the same start, not a restart
        rows.append(parts)
    if not rows:
        return None
    parts = rows[-1]
    state = parts[2].split(" ")[0]  # "CANCELLED by 0" -> "CANCELLED"
    reason = "" if parts[5] == "None" or state != "PENDING" else parts[5]
    return {
        "job_id": int(parts[0].split("_")[0]), "name": parts[1], "state": state,
        "nodes": "" if parts[3] in ("None assigned", "") else parts[3],
        "num_nodes": _int(parts[6]), "restarts": len(rows) - 1, "exit_code": parts[4],
        "reason": reason, "source": "sacct",
    }


def parse_sinfo_nodes(stdout: str) -> list[dict[str, object]]:
    """Parse `sinfo -N -h -o '%N|%T|%c|%m|%P'` (one line per node and partition)."""
    seen: dict[str, dict[str, object]] = {}
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5:
            continue
        name, state, cpus, mem, part = parts[:5]
        node = seen.setdefault(name, {"name": name, "state": state.rstrip("*"),
                                      "responding": not state.endswith("*"),
                                      "cpus": _int(cpus), "memory_mb": _int(mem),
                                      "partitions": []})
        node["partitions"].append(part.rstrip("*"))  # type: ignore[attr-defined]
    return list(seen.values())


def parse_squeue(stdout: str) -> list[dict[str, object]]:
    """Parse `squeue -h -o '%i|%j|%T|%D|%R|%u|%M'`."""
    jobs = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 7:
            continue
        jobs.append({"job_id": parts[0], "name": parts[1], "state": parts[2],
                     "num_nodes": _int(parts[3]), "nodes_or_reason": parts[4],
                     "user": parts[5], "time": parts[6]})
    return jobs


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


# ---------------------------------------------------------------- thin helpers

def sbatch(script_path: str | os.PathLike[str] | None, extra_args: Iterable[str] = (),
           cwd: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
           ) -> int:
    """Submit a batch script (None with `--wrap CMD` in extra_args); return its job id."""
    args = ["sbatch", "--parsable", *extra_args]
    if cwd is not None:
        args.append(f"--chdir={os.fspath(cwd)}")
    if script_path is not None:
        args.append(os.fspath(script_path))
    return parse_parsable_job_id(run_cmd(args, env=env).stdout)


def own_record(stdout: str, job_id: int | str) -> dict[str, str] | None:
    """Job `job_id`'s own record in `scontrol -o show job ID`, None when it has none. For the
    array task that kept the array's id, scontrol lists every task of the array: the others'
    records are not this job's. Pure."""
    return next((rec for rec in parse_scontrol_records(stdout) if rec.get("JobId") == str(job_id)), None)


def parse_job_state(stdout: str, job_id: int | str) -> str | None:
    """JobState of job `job_id`'s own record (`own_record`). Pure."""
    rec = own_record(stdout, job_id)
    return rec.get("JobState") if rec else None


def ctld_job_state(job_id: int | str, env: Mapping[str, str] | None = None) -> str | None:
    """slurmctld's state of one job (~10 ms: no accounting); None when it cannot say."""
    if not str(job_id):
        return None  # `scontrol show job ""` would list every job
    proc = run_cmd(["scontrol", "-o", "show", "job", str(job_id)], check=False, env=env)
    return parse_job_state(proc.stdout, job_id) if proc.returncode == 0 else None


def job_info(job_id: int | str, env: Mapping[str, str] | None = None,
             settle_s: float = 0.0) -> dict[str, object]:
    """State, nodes, restarts, exit code, reason of a job (scontrol, else sacct).

    `settle_s`: for a job known to exist (one we submitted), how long "gone from slurmctld,
    not in accounting" is a window to wait through rather than an answer: slurmctld hands its
    records to slurmdbd through a queue, which a loaded machine drains late. 0: answer now (a
    job id nobody submitted is unknown at once)."""
    proc = run_cmd(["scontrol", "-o", "show", "job", str(job_id)], check=False, env=env)
    if proc.returncode == 0:
        recs = parse_scontrol_records(proc.stdout)
        rec = own_record(proc.stdout, job_id) or (recs[0] if recs else None)  # an ID_TASK form names no JobId
        if rec is not None:
            return job_info_from_scontrol(rec)
    elif "Invalid job id" not in proc.stderr:
        raise SlurmError(failure_message(["scontrol", "show", "job", str(job_id)],
                                         proc.returncode, proc.stderr))
    # Gone from the controller (older than MinJobAge, or a restarted slurmctld): ask accounting.
    deadline = time.monotonic() + settle_s
    while True:
        acct = run_cmd(["sacct", "-D", "-X", "-n", "-P", "-j", str(job_id), "-o", SACCT_FIELDS],
                       check=False, env=env)
        info = parse_sacct(acct.stdout) if acct.returncode == 0 else None
        if info is not None:
            return info
        if time.monotonic() >= deadline:
            waited = f" after waiting {settle_s:.0f} s for accounting" if settle_s else ""
            raise SlurmError(f"job {job_id} is unknown to slurmctld and to accounting (sacct: "
                             f"{(acct.stderr or acct.stdout).strip() or 'no record'}){waited}")
        log.info("job %s: gone from slurmctld, not in accounting yet; waiting", job_id)
        time.sleep(1.0)


# How long accounting may lag behind slurmctld on an idle machine; `accounting_settle_s` stretches
# it with the load. Records usually arrive within a second; a minute is far beyond a healthy lag.
ACCOUNTING_SETTLE_S = 60.0


def load_factor(procs: int = 1, running: int = 0) -> float:
    """How many times slower than on an idle machine `procs` CPU-bound processes run now: the
    other runnable processes (the 1-minute load average, less the `running` of ours already in
    it) share the cores with them. 1.0 on an idle machine; 8 processes on 2 cores beside 2 busy
    loops: (8+2)/8 = 1.25; beside a load of 8: 2.0. The load average lags a minute behind a
    change and counts processes that just ended: both stretch a bound, never shrink it. Used by
    `accounting_settle_s` and by the tests' deadlines (tests/testkit.py)."""
    cores = os.cpu_count() or 1
    others = max(0.0, os.getloadavg()[0] - running)
    return max(1.0, (procs + others) / cores) / max(1.0, procs / cores)


def accounting_settle_s(idle_s: float = ACCOUNTING_SETTLE_S) -> float:
    """`job_info`'s settle window for a job we submitted, following this machine's load (the
    local cluster's slurmctld and slurmdbd share it; on a real cluster it is only a floor)."""
    return idle_s * load_factor()


def wait_job(job_id: int | str, states: Iterable[str] = TERMINAL_STATES, timeout: float = 300,
             poll: float = 0.25, env: Mapping[str, str] | None = None) -> str:
    """Poll until the job reaches one of `states`; return that state. The job exists (the
    caller has its id from sbatch), so a moment when neither slurmctld nor accounting has it
    is waited through (`job_info`'s settle window) before it is an error."""
    wanted = set(states)
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while True:
        state = str(job_info(job_id, env=env, settle_s=accounting_settle_s())["state"])
        if state in wanted:
            return state
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} still {state} after {timeout:g} s "
                             f"(waiting for {sorted(wanted)})")
        time.sleep(poll)


def cancel(job_id: int | str, env: Mapping[str, str] | None = None) -> None:
    run_cmd(["scancel", str(job_id)], env=env)


def requeue(job_id: int | str, env: Mapping[str, str] | None = None) -> None:
    run_cmd(["scontrol", "requeue", str(job_id)], env=env)


def nodes(env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """Every node: name, state (idle/allocated/down...), responding, cpus, memory, partitions."""
    out = run_cmd(["sinfo", "-N", "-h", "-o", "%N|%T|%c|%m|%P"], env=env).stdout
    return parse_sinfo_nodes(out)


def squeue(user: str | None = None, job_ids: Iterable[int | str] = (),
           env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    """Jobs the controller knows that are pending/running (squeue's default states)."""
    args = ["squeue", "-h", "-o", "%i|%j|%T|%D|%R|%u|%M"]
    if user:
        args += ["-u", user]
    ids = [str(j) for j in job_ids]
    if ids:
        args += ["-j", ",".join(ids)]
    return parse_squeue(run_cmd(args, env=env).stdout)


# ------------------------------------------------------------- job endings (sacct/sinfo --json)
# 22.05's scontrol has no --json here; sacct and sinfo do, so no Key=Value guessing is needed.


def _state_text(state: object) -> str:
    """sacct's `state` is a string in some versions, {"current": str | [str]} in others."""
    if isinstance(state, dict):
        state = state.get("current")
    if isinstance(state, list):
        state = state[0] if state else ""
    return str(state or "").upper()


def parse_sacct_incarnations(stdout: str, job_id: int | str | None = None) -> list[dict[str, object]]:
    """`sacct --json -D -j JOB` -> one record per incarnation (restart), oldest first. With
    `job_id`, only that job's records: for the array task that kept the array's own id, sacct
    -j ID also returns every other task of the array. Pure."""
    try:
        jobs = json.loads(stdout).get("jobs", [])
    except (ValueError, AttributeError):
        return []
    out = []
    for j in jobs:
        if job_id is not None and str(j.get("job_id")) != str(job_id):
            continue
        t = j.get("time") if isinstance(j.get("time"), dict) else {}
        state = _state_text(j.get("state"))
        if state.startswith(RESIZING):
            continue  # a --no-kill job that lost a node: the same start, not an incarnation
        out.append({"state": state, "nodes": str(j.get("nodes") or ""),
                    "start": int(t.get("start") or 0), "end": int(t.get("end") or 0)})
    return sorted(out, key=lambda r: (r["start"], r["end"]))


def parse_sinfo_down(stdout: str, hosts: Iterable[str]) -> dict[str, str]:
    """Which of `hosts` `sinfo --json` reports down, failing or not responding, with the state
    words that said so. Pure."""
    try:
        nodes = json.loads(stdout).get("nodes", [])
    except (ValueError, AttributeError):
        return {}
    wanted, out = set(hosts), {}
    for n in nodes:
        words = [_state_text(n.get("state"))] + [str(f).upper() for f in n.get("state_flags") or []]
        bad = any(w.startswith(("DOWN", "FAIL")) or w in ("NOT_RESPONDING", "NO_RESPOND") for w in words)
        if n.get("name") in wanted and bad:
            out[str(n["name"])] = "+".join(words)
    return dict(sorted(out.items()))


def incarnations(job_id: int | str, env: Mapping[str, str] | None = None) -> list[dict[str, object]]:
    proc = run_cmd(["sacct", "--json", "-D", "-j", str(job_id)], check=False, env=env)
    return parse_sacct_incarnations(proc.stdout, job_id) if proc.returncode == 0 else []


def down_nodes(hosts: Iterable[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    proc = run_cmd(["sinfo", "--json"], check=False, env=env)
    return parse_sinfo_down(proc.stdout, hosts) if proc.returncode == 0 else {}


SLURMD_PORT = 6818  # Slurm's default SlurmdPort, when `scontrol show node` names none


def parse_node_addresses(stdout: str, default_port: int = SLURMD_PORT) -> dict[str, tuple[str, int]]:
    """NodeName -> (NodeAddr, slurmd port) from `scontrol -o show node`. scontrol names a node's
    Port only where it differs from the cluster's SlurmdPort: `default_port`. Pure."""
    out = {}
    for rec in parse_scontrol_records(stdout):
        name = rec.get("NodeName")
        port = rec.get("Port", "")
        if name:
            out[name] = (rec.get("NodeAddr") or name, int(port) if port.isdigit() else default_port)
    return out


def parse_slurmd_port(config: str) -> int:
    """SlurmdPort from `scontrol show config` (`SlurmdPort = 6818`); Slurm's default without one. Pure."""
    m = re.search(r"^SlurmdPort\s*=\s*(\d+)", config, re.M)
    return int(m.group(1)) if m else SLURMD_PORT


def node_addresses(hosts: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, tuple[str, int]]:
    """Where each host's slurmd listens. The port scontrol leaves out is the cluster's SlurmdPort,
    not Slurm's default: guessing 6818 on a site (or the local cluster) that moved it found every
    such node's port closed, and a probe read a live node as lost."""
    if not hosts:
        return {}
    proc = run_cmd(["scontrol", "-o", "show", "node", ",".join(hosts)], check=False, env=env)
    if proc.returncode:
        return {}
    conf = run_cmd(["scontrol", "show", "config"], check=False, env=env)
    if conf.returncode:
        return {}  # no port known: the probe step alone decides
    return parse_node_addresses(proc.stdout, parse_slurmd_port(conf.stdout))
