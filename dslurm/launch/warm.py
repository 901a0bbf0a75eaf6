"""Warm restarts inside the allocation: a preloaded pool per node that forks the workers.

A cold start pays, in every worker, the interpreter, `import torch` with DTensor and DCP, and
the trainer's modules (docs/startup.md: ~5 s of a ~9-14 s start here), plus torchrun's own
start (another interpreter importing torch). None of that depends on the failure. So
`dslurm supervise` (jobs with spares and `recovery.warm: true`) starts one pool per allocated
node: a process that imports all of it once, starts no thread of its own, creates no CUDA context
and no process group, and then waits on a unix socket in node-local scratch. For an attempt after
a failure, `dslurm launch` asks its node's pool for the workers instead of running torchrun.

The pool forks one worker per local rank from that pristine state: the worker is a new process
(new pid, its own session, only the forking thread; nothing of an earlier attempt ever lived in
the pool, so no process group, thread, RNG or module state of the failed attempt can reach it),
gets the launcher's stdout/stderr and the rank's environment, and runs the entry's `__main__`
in-process (`runpy`, as `python -m ENTRY` would). The trainer restores model, optimizer and RNG
from the checkpoint as on any restart.

The pool serves one attempt at a time. When the launcher's connection closes (the launcher ended,
was killed -9, or the step was torn down), every worker of that attempt still alive is SIGKILLed
(its whole process group: a worker stopped or ignoring TERM included) and reaped before the pool
reads the next request: a new attempt's workers never start while an old one's exist. A worker
also dies with the pool (PR_SET_PDEATHSIG). So the pool outlives its workers' stop: it ignores
USR2, and on TERM (sent by Slurm to every step: time limit, preemption, scancel) it takes no new
attempt but watches the current one's workers -- saving on that same TERM -- to their end, then
exits. Workers start with USR2 ignored, as torchrun's do (the trainer installs its handler).
The pool reports each worker's exit status on the connection; the launcher turns them into torchrun-like codes.

Protocol (one connection = one attempt): the launcher sends an 8-byte length with two fds
(its stdout, stderr: SCM_RIGHTS), then that many bytes of JSON {argv, cwd, envs: [per local
rank]}. The pool answers JSON lines: {"pids": [...], "tasks": N} (or {"error": ...}), then one
{"local_rank", "pid", "code"} per worker as it is reaped.

Torch is imported only inside `serve` (the pool process): the module stays torch-free.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WARM_ENV = "DSLURM_WARM"  # "1": `dslurm supervise` offers this job step its nodes' pools
FORKED_ENV = "DSLURM_WARM_FORKED"  # "1" in a worker a pool forked (the probe records it)
# What every pool imports before serving: torch with what FSDP2/TP (DTensor) and the checkpoint
# (DCP) need, and torch._dynamo, which every torch.optim optimizer imports on first use.
BASE_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
                "torch._dynamo")
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 120.0  # the pool is reaping a previous attempt (SIGKILL + wait): seconds at most
_HEADER = struct.Struct("!Q")


def socket_path(job_id: str, host: str, scratch: str | None = None) -> Path:
    """The pool's socket on `host` for this job: node-local scratch (TMPDIR, else /tmp), a short
    name (unix socket paths are limited to 107 bytes). Pure."""
    digest = hashlib.sha1(f"{job_id}:{host}".encode()).hexdigest()[:16]
    return Path(scratch or os.environ.get("TMPDIR") or "/tmp") / f"dslurm-warm-{digest}.sock"


def ready_path(run_dir: Path, job_id: str, host: str) -> Path:
    """Written by a pool once it serves: how `dslurm supervise` (on another node) knows. Pure."""
    return Path(run_dir) / "warm" / f"{job_id}.{host}.ready"


def entry_module(cmd: Sequence[str]) -> str | None:
    """The module of a `PYTHON -m MODULE ...` training command, else None (no warm start). Pure."""
    return cmd[2] if len(cmd) >= 3 and cmd[1] == "-m" else None


def worker_envs(base: Mapping[str, str], nproc: int, node_rank: int, world: int) -> list[dict[str, str]]:
    """Each local rank's environment, as torchrun would set it (ranks by node, then local; and
    OMP_NUM_THREADS=1 when several workers share the node and it is unset). Pure."""
    omp = {"OMP_NUM_THREADS": "1"} if nproc > 1 and "OMP_NUM_THREADS" not in base else {}
    return [{**base, **omp, "RANK": str(node_rank * nproc + lr), "LOCAL_RANK": str(lr), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node_rank), "ROLE_RANK": str(node_rank * nproc + lr),
             "ROLE_WORLD_SIZE": str(world)} for lr in range(nproc)]


def tasks() -> int:
    """Kernel threads of this process (Linux /proc), Python's and native ones."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


# ------------------------------------------------------------------------------ the pool


def preload(module: str | None, base: Sequence[str] = BASE_PRELOAD) -> list[str]:
    """Import what the workers will need, once. The entry module may name more in its
    `__main__`'s WARM_PRELOAD (train/__main__.py does). Returns what was imported. A package's
    entry is its `__main__`; a plain module (`python -m dslurm.launch.probe`) is its own, imported
    here without running (its `if __name__ == "__main__"` guard), as `runpy` will run it."""
    names = list(base)
    for name in names:
        importlib.import_module(name)
    if module:
        spec = importlib.util.find_spec(module)
        package = spec is not None and spec.submodule_search_locations is not None
        main = importlib.import_module(f"{module}.__main__" if package else module)
        for name in getattr(main, "WARM_PRELOAD", ()):
            importlib.import_module(name)
            names.append(name)
    return names


def serve(path: Path, *, module: str | None, base: Sequence[str] = BASE_PRELOAD, ready: Path | None = None,
          once: bool = False) -> int:
    """The pool: preload, bind, serve attempts one by one until killed (or after one: `once`)."""
    import threading

    t0 = time.time()
    loaded = preload(module, base)
    if threading.active_count() != 1:  # a Python thread would be lost in every fork, with its locks
        raise RuntimeError(f"warm pool: {threading.active_count()} Python threads after the imports")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context does not survive fork
        raise RuntimeError("warm pool: CUDA was initialised by the imports")
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    log.warning("warm pool %s: %d modules preloaded in %.1f s, %d task(s)", path, len(loaded), time.time() - t0,
                tasks())
    if ready is not None:
        from dslurm.durable import atomic_write_text

        ready.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ready, json.dumps({"pid": os.getpid(), "socket": str(path), "t": time.time()}))
    # Slurm signals every process of every step (time limit, preemption, `scancel --signal`,
    # `dslurm cancel --save`): USR2 is the workers' business, never the pool's; TERM stops the pool
    # from taking new attempts, but the current attempt's workers (saving on that same TERM) are
    # watched and reaped to the end first: the pool's death would SIGKILL them (PDEATHSIG).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    state = {"busy": False, "stopping": False}

    def on_term(_signum: int, _frame: object) -> None:
        state["stopping"] = True
        path.unlink(missing_ok=True)  # no new connection finds the pool
        if not state["busy"]:
            raise SystemExit(0)
        log.warning("warm pool: SIGTERM; waiting for the current attempt's workers, then exiting")

    signal.signal(signal.SIGTERM, on_term)
    try:
        while not state["stopping"]:
            conn, _ = listener.accept()
            state["busy"] = True
            with conn:
                _attempt(conn, listener, stopping=lambda: state["stopping"])
            state["busy"] = False
            if once:
                return 0
        return 0
    finally:
        path.unlink(missing_ok=True)
        if ready is not None:
            ready.unlink(missing_ok=True)


def _recv_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 4)
    if len(head) != _HEADER.size:
        raise ValueError("short header")
    size = _HEADER.unpack(head)[0]
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("connection closed mid-request")
        body += chunk
    return json.loads(body), fds


def _send(conn: socket.socket, obj: Mapping[str, object]) -> None:
    try:
        conn.sendall((json.dumps(obj) + "\n").encode())
    except OSError:  # the launcher is gone: its workers are killed below
        pass


# Blocked around fork: a signal between the fork and the child's own dispositions must not run
# the pool's handlers in a worker (it stays pending until the worker has reset them).
_FORK_BLOCKED = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR2, signal.SIGCHLD}


def _attempt(conn: socket.socket, listener: socket.socket, stopping: Callable[[], bool] = lambda: False) -> None:
    """One attempt: fork the workers, report each exit; kill them all when the launcher leaves."""
    try:
        req, fds = _recv_request(conn)
    except (OSError, ValueError) as exc:
        log.error("warm pool: bad request: %s", exc)
        return
    pids: list[int] = []
    try:
        envs = req.get("envs") if isinstance(req, dict) else None
        argv = req.get("argv") if isinstance(req, dict) else None
        if len(fds) != 2 or not isinstance(envs, list) or not envs or not isinstance(argv, list):
            log.error("warm pool: bad request: %d fds, envs %s, argv %s", len(fds), type(envs).__name__,
                      type(argv).__name__)
            _send(conn, {"error": f"want 2 fds, argv and a list of envs, got {len(fds)} fds"})
            return
        if stopping():
            _send(conn, {"error": "the pool is stopping (SIGTERM)"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            for env in envs:
                old = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_BLOCKED)
                try:
                    pid = os.fork()
                    if pid == 0:
                        _worker(req, env, fds, (conn, listener), old)  # never returns
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)  # the pool's (the child never gets here)
                pids.append(pid)
        except OSError as exc:  # out of memory or pids: none of this attempt may run
            for pid in pids:
                _kill_group(pid)
                os.waitpid(pid, 0)
            _send(conn, {"error": f"fork failed: {exc}"})
            return
        _send(conn, {"pids": pids, "tasks": tasks()})
    finally:
        for fd in fds:
            os.close(fd)
    _watch(conn, pids)


def _watch(conn: socket.socket, pids: list[int]) -> None:
    """Reap the attempt's workers, reporting each; the launcher gone: SIGKILL the rest, reap them."""
    alive = set(pids)
    killed = False
    while alive:
        for pid in sorted(alive):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
                code = os.waitstatus_to_exitcode(status) if done else 0
            except ChildProcessError:  # reaped elsewhere: its status is lost, never a success
                done, code = pid, 1
            if done:
                alive.discard(pid)
                _send(conn, {"local_rank": pids.index(pid), "pid": pid, "code": code, "t": time.time()})
        if not alive:
            break
        if killed:
            time.sleep(0.05)
            continue
        readable, _, _ = select.select([conn], [], [], 0.1)
        if readable and not _peek(conn):  # EOF: the launcher is gone
            log.warning("warm pool: launcher gone; SIGKILL %s", sorted(alive))
            for pid in alive:
                _kill_group(pid)
            killed = True


def _peek(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    for kill in (os.killpg, os.kill):  # the worker leads its own group (setsid); anything it started too
        try:
            kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _pdeathsig() -> None:
    """This process gets SIGKILL when its parent (the pool) dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(req: Mapping[str, object], env: Mapping[str, str], fds: list[int], close: Sequence[socket.socket],
            mask: set[int | signal.Signals] | None = None) -> None:
    """In the forked child (signals blocked): become a fresh worker and run the entry; never returns."""
    code = 1
    try:
        # First the dispositions, then the pool's mask back: a signal that came meanwhile acts as it
        # would on a fresh worker. USR2 ignored as on the cold path (torchrun's workers inherit it
        # ignored from the launcher): the trainer installs its own handler explicitly.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask if mask is not None else set())
        os.setsid()
        _pdeathsig()
        for s in close:
            s.close()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        logging.root.handlers.clear()  # the entry configures its own (basicConfig is a no-op otherwise)
        logging.root.setLevel(logging.WARNING)
        os.environ.clear()
        os.environ.update(env)
        os.environ[FORKED_ENV] = "1"
        os.chdir(str(req.get("cwd") or "."))
        code = run_entry([str(a) for a in req["argv"]])  # type: ignore[attr-defined]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def run_entry(argv: Sequence[str]) -> int:
    """`PYTHON -m MODULE ARGS...` in this process (the module's __main__ as a fresh `__main__`)."""
    import runpy

    module = entry_module(argv)
    if module is None:
        raise ValueError(f"warm worker: not a `python -m MODULE` command: {list(argv)[:3]}")
    sys.argv = [str(argv[0]), *argv[3:]]
    # The pool preloaded `MODULE.__main__` (its WARM_PRELOAD): runpy would warn that it is already
    # imported, and run it afresh as `__main__` anyway.
    sys.modules.pop(f"{module}.__main__", None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


# ------------------------------------------------------------------------------ the launcher's side


class PoolUnavailable(Exception):
    """The pool cannot start this attempt (no socket, no answer, an error): nothing was forked."""


class Attempt:
    """The launcher's connection to its pool for one attempt: the workers' pids, then their codes."""

    def __init__(self, path: Path, argv: Sequence[str], envs: list[dict[str, str]], cwd: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.buf = b""
        try:
            self.sock.settimeout(CONNECT_TIMEOUT_S)
            self.sock.connect(str(path))
            body = json.dumps({"argv": list(argv), "envs": envs, "cwd": cwd}).encode()
            socket.send_fds(self.sock, [_HEADER.pack(len(body))], [sys.stdout.fileno(), sys.stderr.fileno()])
            self.sock.sendall(body)
            self.sock.settimeout(ANSWER_TIMEOUT_S)  # the pool may still be reaping the last attempt
            first = self._line()
        except (OSError, ValueError) as exc:
            self.sock.close()
            raise PoolUnavailable(f"{path}: {exc}") from None
        if first is None or "pids" not in first:
            self.sock.close()
            raise PoolUnavailable(f"{path}: {first}")
        self.pids: list[int] = [int(p) for p in first["pids"]]
        self.tasks = int(first.get("tasks") or 0)
        self.codes: dict[int, int] = {}

    def _line(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return dict(json.loads(line))

    def wait(self, on_failure: Callable[[int], None]) -> dict[int, int]:
        """Local rank -> exit code as the pool reaps them; `on_failure(local_rank)` at the first
        nonzero code (the launcher tears the others down, as torchrun does). A pool that goes
        away: the workers died with it (PDEATHSIG); those left without a code count as -9."""
        self.sock.settimeout(None)
        while len(self.codes) < len(self.pids):
            try:
                msg = self._line()
            except OSError:  # PEP 475 retries EINTR; anything else: the pool is gone
                msg = None
            if msg is None:
                for lr in range(len(self.pids)):
                    self.codes.setdefault(lr, -int(signal.SIGKILL))
                break
            lr, code = int(msg["local_rank"]), int(msg["code"])
            self.codes[lr] = code
            if code != 0 and len([c for c in self.codes.values() if c != 0]) == 1:
                on_failure(lr)
        self.sock.close()
        return self.codes

    def signal_all(self, signum: int) -> None:
        for lr, pid in enumerate(self.pids):
            if lr not in self.codes:
                _kill_group(pid, signum)


# ------------------------------------------------------------------------------ CLI (the pool step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m dslurm.launch.warm",
                                description="a warm worker pool (one per node)")
    p.add_argument("--job", required=True, help="the job id (the socket's name)")
    p.add_argument("--host", required=True, help="this node's name in the job's host list")
    p.add_argument("--socket", type=Path, default=None, help="default: socket_path(JOB, HOST) in node-local scratch")
    p.add_argument("--module", default=None, help="the entry module (`python -m MODULE`) to preload")
    p.add_argument("--ready", type=Path, default=None, help="file written once the pool serves")
    p.add_argument("--base", default=",".join(BASE_PRELOAD), help="comma-separated modules to preload")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return serve(args.socket or socket_path(args.job, args.host), module=args.module,
                 base=[b for b in args.base.split(",") if b], ready=args.ready)


if __name__ == "__main__":
    sys.exit(main())
