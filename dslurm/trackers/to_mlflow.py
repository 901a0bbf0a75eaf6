"""MLflow: one MLflow run per dslurm run, in the user's tracking server or, by default, a file
store in `<run_dir>/mlruns` (`mlflow ui --backend-store-uri <run_dir>/mlruns` shows it).

The URI: `metrics.mlflow_uri`, else MLFLOW_TRACKING_URI from the user's environment, else the
run directory's file store. The run id is created once (experiment = the job's name) and kept
in trackers.json; a later start sets the run RUNNING again and logs into it. MLflow has no
call that deletes metric points, so in the default file store a resumed start rewrites each
metric file without the points from `purge_from` on (what TensorBoard's purge does); on a
tracking server a resumed start logs only the steps after the ones the run holds (`held`:
the chart keeps the first values of the replayed steps; docs/trackers.md). Each point's
timestamp is its ledger event's time, so a point sent twice (a catch-up after a call that
answered late) is the same row. Annotations are tags `dslurm.event.<step>.<crc>` ("step S:
text", one key per annotation whoever sends it); the run ends FINISHED (completed), KILLED
(stopped to be resumed) or FAILED.

MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true: for the default store
this process sets it (unless the user set it), because a run directory on a shared
filesystem is no place for SQLite's locks. Tokens stay in the environment (MLFLOW_TRACKING_TOKEN).
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from dslurm.durable import atomic_write_text
from dslurm.trackers import Start
from dslurm.trackers.backlog import Held
from dslurm.trackers.lane import Item

if TYPE_CHECKING:
    from dslurm.config import MetricsSpec

PACKAGE = "mlflow.tracking"
SUBDIR = "mlruns"
BATCH = 1000
"""metrics per log_batch (MLflow's limit)"""
_STATUS = {"completed": "FINISHED", "requeue": "KILLED", "terminated": "KILLED", None: "KILLED"}


def tracking_uri(ctx: Start) -> str:
    """The job's, else the environment's, else the one the run's MLflow run lives on (trackers.json:
    a sync of a run whose job is not frozen here), else the run directory's file store."""
    if ctx.spec.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or not isinstance(ctx.state.get("uri"), str):
        return _uri(ctx.spec, ctx.run_dir)
    return str(ctx.state["uri"])


def _uri(spec: MetricsSpec, run_dir: Path) -> str:
    uri = spec.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or (run_dir / SUBDIR).resolve().as_uri()


def _no_userinfo(uri: str) -> str:
    """`uri` without user:password@ (credentials stay in the environment, never in the run directory)."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")))


def remote(spec: MetricsSpec, run_dir: Path) -> bool:
    """A tracking server (not the file store)."""
    return not _uri(spec, run_dir).startswith("file:")


def purge_metric_file(path: Path, purge_from: int) -> int:
    """Drop the points at steps >= purge_from from one file-store metric file ("ts value step"
    per line); returns how many went. Pure but for the one atomic rewrite."""
    lines = path.read_text().splitlines()
    keep = [ln for ln in lines if len(parts := ln.split()) < 3 or int(parts[2]) < purge_from]
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))
    return len(lines) - len(keep)


class MlflowTracker:
    def __init__(self, ctx: Start) -> None:
        uri = tracking_uri(ctx)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client: Any = MlflowClient(tracking_uri=uri)
        self.start, self.sync = ctx.start, ctx.sync
        run_id = ctx.state.get("run_id")
        if isinstance(run_id, str):
            self.run_id = run_id
            ctx.note(f"get_run {run_id}")
            run = self.client.get_run(run_id)  # raises when the store lost it: reported, not guessed
            if not ctx.sync:
                ctx.note("update_run RUNNING")
                self.client.update_run(run_id, status="RUNNING")
                self._purge(run.info.experiment_id, ctx.purge_from)
        else:
            ctx.note(f"get_experiment_by_name {ctx.job!r}")
            exp = self.client.get_experiment_by_name(ctx.job)
            ctx.note("create_experiment")
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(ctx.job)
            ctx.note("create_run")
            self.run_id = self.client.create_run(exp_id, run_name=ctx.job).info.run_id
            ctx.state["run_id"] = self.run_id
            ctx.state["uri"] = _no_userinfo(uri)
            ctx.save()

    def _purge(self, experiment_id: str, purge_from: int) -> None:
        store = self.client._tracking_client.store
        if not hasattr(store, "_get_run_dir"):  # a tracking server: no way to delete points
            return
        metrics = Path(store._get_run_dir(experiment_id, self.run_id)) / "metrics"
        for path in sorted(p for p in metrics.rglob("*") if p.is_file()):
            purge_metric_file(path, purge_from)

    def held(self) -> Held:
        """The run's last step of each metric and its annotations, as the store says."""
        data = self.client.get_run(self.run_id).data
        held = Held(last={m.key: int(m.step) for m in getattr(data, "_metric_objs", [])})
        for key, value in data.tags.items():
            step, sep, text = str(value).partition(": ")
            if key.startswith("dslurm.event.") and sep and step.startswith("step ") and step[5:].isdigit():
                held.notes.add((int(step[5:]), text))
        return held

    def log(self, step: int, values: dict[str, float], t: float = 0.0) -> None:
        from mlflow.entities import Metric

        ts = int((t or time.time()) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in values.items()])

    def log_many(self, items: list[Item]) -> None:
        """Many points in few calls (a sync): MLflow takes at most 1000 metrics a batch."""
        from mlflow.entities import Metric

        metrics = [Metric(k, v, int((i.t or time.time()) * 1000), i.step) for i in items
                   for k, v in (i.values or {}).items()]
        for at in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[at:at + BATCH])

    def event(self, text: str, step: int) -> None:
        key = f"dslurm.event.{step:09d}.{zlib.crc32(text.encode()):08x}"
        self.client.set_tag(self.run_id, key, f"step {step}: {text}")

    def close(self, ending: str | None) -> None:
        if self.sync and ending is None:
            return  # a sync while a start may be training: the status is the start's to give
        self.client.set_terminated(self.run_id, status=_STATUS.get(ending, "FAILED"))


def describe(ctx: Start) -> str:
    uri = tracking_uri(ctx)
    return f"the MLflow file store {uri}" if uri.startswith("file:") else f"the MLflow tracking server {uri}"


def open_run(ctx: Start) -> MlflowTracker:
    return MlflowTracker(ctx)
