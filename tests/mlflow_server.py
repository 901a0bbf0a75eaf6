"""A real MLflow tracking server (`mlflow server`, sqlite store) on 127.0.0.1, started by a test,
and frozen / thawed with SIGSTOP / SIGCONT on its whole process group (the CLI, uvicorn and its
job runner): a server that holds its connections and answers nothing, then answers again --
what a tracking server restarting or paging for a minute looks like to a client."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testkit import LoadDeadline


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def mlflow_server(workdir: Path) -> Iterator[Server]:
    """`mlflow server` with a sqlite store under `workdir`; up (its /health answers) when yielded."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = workdir / "server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
           "--default-artifact-root", str(workdir / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
    srv = Server(url=f"http://127.0.0.1:{port}", proc=proc, log=log)
    try:
        deadline = LoadDeadline(120)  # importing mlflow's server and migrating the store: ~15 s idle
        while not _up(srv.url):
            if proc.poll() is not None or deadline.expired():
                raise AssertionError(f"mlflow server did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=srv.url).search_experiments()  # its first answer is slow: not the tests' bound
        yield srv
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
