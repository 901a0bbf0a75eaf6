"""Tracker servers on 127.0.0.1 that a test starts itself, for the real MLflow and W&B clients:

- `silent_server()`: accepts every connection and never answers (a firewall that drops after the
  handshake, a server wedged under load);
- `slow_mlflow_server(delay_s)`: answers MLflow's REST calls (the few dslurm's client makes) after
  `delay_s` each, and every other path (W&B's) with a 503 after the same delay: a server under load.
  It records what it was asked (path, JSON body), so a test can read back what arrived.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """http://127.0.0.1:PORT of a listener that accepts and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)  # kept open, never answered

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        for c in held:
            c.close()
        srv.close()


class _Slow(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, *a: Any) -> None:  # quiet
        pass

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        path = self.path.split("?")[0]
        self.server.calls.append((path, body))
        time.sleep(self.server.delay_s)
        if not path.startswith("/api/2.0/mlflow/"):
            return self._reply(503, {"error": "server under load"})
        what = path.rsplit("/mlflow/", 1)[1]
        if what == "experiments/get-by-name":
            return self._reply(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"})
        if what == "experiments/create":
            return self._reply(200, {"experiment_id": "1"})
        if what == "runs/create":
            run_id = uuid.uuid4().hex
            self.server.run_ids.append(run_id)
            info = {"run_id": run_id, "run_uuid": run_id, "experiment_id": "1", "status": "RUNNING",
                    "start_time": int(time.time() * 1000), "lifecycle_stage": "active", "run_name": "tiny",
                    "artifact_uri": "file:///nonexistent"}
            return self._reply(200, {"run": {"info": info, "data": {}}})
        if what == "runs/update":
            return self._reply(200, {"run_info": {"run_id": body.get("run_id", ""), "status": body.get("status")}})
        return self._reply(200, {})  # log-batch, set-tag, ...

    do_GET = do_POST = _handle


@contextlib.contextmanager
def slow_mlflow_server(delay_s: float) -> Iterator[ThreadingHTTPServer]:
    """A server (its `.url`, `.calls`, `.run_ids`) answering each request after `delay_s`."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    srv.daemon_threads = True
    srv.delay_s, srv.calls, srv.run_ids = delay_s, [], []  # type: ignore[attr-defined]
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"  # type: ignore[attr-defined]
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def logged_steps(calls: list[tuple[str, dict[str, Any]]], key: str = "train/loss") -> list[int]:
    """The steps of `key` that reached the server through MLflow's log-batch."""
    return sorted(int(m["step"]) for path, body in calls if path.endswith("/runs/log-batch")
                  for m in body.get("metrics", []) if m.get("key") == key)
