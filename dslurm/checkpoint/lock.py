"""One writer per run directory: the flock on `<run_dir>/.lock` and the record of who holds it.
Torch-free; re-exported by dslurm.checkpoint."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from dslurm.checkpoint.pointer import HOLDER, LOCK, RunLocked, atomic_write_json, holder_identity
from dslurm.endings.facts import ENOSPC_RETRY_S

log = logging.getLogger(__name__)


def describe_holder(h: dict[str, Any] | None) -> str:
    if not h:
        return "an unknown process (no holder record)"
    who = f"Slurm job {h['job_id']}" if h.get("job_id") else "a process outside Slurm"
    return f"{who} (pid {h.get('pid')} on {h.get('host')}, since {h.get('since')})"


class RunDirLock:
    """One writer per run directory. flock is dropped by the kernel when the holder dies (kill -9
    included), so a lock is never stale; the holder record may be, and is overwritten. A requeue of
    the SAME Slurm job finding the lock still held (old incarnation still being torn down, or an NFS
    lock lease not yet expired) is let through with a warning. On Lustre mount with -o flock."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = holder_identity()
        fd = os.open(self.run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = self.holder()
            if holder and me["job_id"] and holder.get("job_id") == me["job_id"]:
                log.warning("%s: lock still held by an earlier incarnation of this job (%s); "
                            "continuing as its requeue", self.run_dir, describe_holder(holder))
                self._record(me)
                return
            raise RunLocked(f"{self.run_dir}: run is being written by {describe_holder(holder)}. "
                            "Wait for it, cancel it, or use another run directory.") from None
        old = self.holder()
        if old and old.get("pid") != me["pid"]:
            log.info("%s: previous holder %s is gone; taking the lock", self.run_dir,
                     describe_holder(old))
        self._fd = fd
        self._record(me)

    def _record(self, me: dict[str, Any]) -> None:
        """Write who holds the lock (the flock is the lock; this says whose it is). A full disk is
        waited out ENOSPC_RETRY_S, then the record is left unwritten with a warning: a start that
        fails on a disk full for seconds spends a restart of the run's budget on a fault not its
        own (`dslurm selftest chaos` seed 4343). Without it, only a requeue of this job that finds
        the lock still held cannot tell it is its own earlier incarnation."""
        deadline = time.monotonic() + ENOSPC_RETRY_S
        while True:
            try:
                atomic_write_json(self.run_dir / HOLDER, me)
                return
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if time.monotonic() >= deadline:
                    log.warning("%s: the disk is full; the lock is held, its holder record not written (%s)",
                                self.run_dir, exc)
                    return
                time.sleep(0.25)

    def holder(self) -> dict[str, Any] | None:
        try:
            holder: dict[str, Any] = json.loads((self.run_dir / HOLDER).read_text())
            return holder
        except (FileNotFoundError, ValueError):
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            (self.run_dir / HOLDER).unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
