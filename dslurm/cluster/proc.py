"""Process and file helpers of the local cluster (daemons.py, state.py): start daemons in
the foreground and record them with their /proc start time, stop exactly those (and the
job processes they leave behind), wait for ports and conditions, write files atomically.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dslurm.errors import SlurmError

# Daemons run in the foreground (-D/-F) so the PID we record is the daemon itself. Each is
# recorded with its /proc start time: a recycled PID never matches, so we never kill a stranger.
CHILDREN: dict[int, subprocess.Popen[bytes]] = {}  # reaped in stop(): avoids zombies in-process


def spawn_proc(name: str, argv: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start a daemon logging to `out`. Its working directory is `out`'s folder (in the cluster's
    state dir), never the caller's: a daemon outlives the shell that ran `dslurm cluster up`, and
    slurmstepd inherits slurmd's cwd, so a deleted checkout would put "Unable to get current
    working directory" into every job's output."""
    with out.open("ab") as f:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True, cwd=out.parent)
    CHILDREN[p.pid] = p
    return {"name": name, "pid": p.pid, "start": start_time(p.pid)}


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (after the parenthesised comm, which may hold spaces)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] == "Z" else fields[19]


def alive(p: dict[str, Any]) -> bool:
    return p.get("start") is not None and start_time(p["pid"]) == p["start"]


def descendants(pid: int) -> list[dict[str, Any]]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(d.joinpath("stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        c = todo.pop()
        out.append({"pid": c, "start": start_time(c)})
        todo += children.get(c, [])
    return out


def stop(procs: list[dict[str, Any]], grace: float = 5) -> None:
    """SIGTERM all, SIGKILL after `grace`; then SIGKILL what they left behind (job steps)."""
    procs = [p for p in procs if alive(p)]
    # Collected before TERM: once a tini exits, its job processes become orphans.
    leftovers = [d for p in procs for d in descendants(p["pid"])]
    for p in procs:
        send_signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        for p in procs:
            reap(p["pid"])
        time.sleep(0.05)
    for p in [*procs, *leftovers]:
        if alive(p):
            send_signal(p, signal.SIGKILL)
    for p in procs:
        reap(p["pid"], block=True)


def send_signal(p: dict[str, Any], sig: int) -> None:
    try:
        os.kill(p["pid"], sig)
    except ProcessLookupError:
        pass


def reap(pid: int, block: bool = False) -> None:
    child = CHILDREN.get(pid)
    if child is not None:
        try:
            child.wait(timeout=2 if block else 0.001)
            CHILDREN.pop(pid, None)
        except subprocess.TimeoutExpired:
            pass


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(cond: Callable[[], object], timeout: float, what: str, logfile: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SlurmError(f"{what} not ready after {timeout:g} s; {logfile}:\n{tail(logfile)}")
        time.sleep(0.05)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    from dslurm.durable import atomic_write_bytes

    atomic_write_bytes(path, data, mode)


def write_in_place_or_atomic(path: Path, text: str) -> None:
    """/etc/hosts is often a bind mount in containers: rename over it fails (EBUSY)."""
    try:
        atomic_write(path, text.encode(), mode=path.stat().st_mode & 0o777)
    except OSError:
        with path.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


# ------------------------------------------------------------------ CLI
