"""MLflow: one MLflow run per dslurm run, in the user's tracking server or, by default, a file
store in `<run_dir>/mlruns` (`mlflow ui --backend-store-uri <run_dir>/mlruns` shows it).

The URI: `metrics.mlflow_uri`, else MLFLOW_TRACKING_URI from the user's environment, else the
run directory's file store. The run id is created once (experiment = the job's name) and kept
in trackers.json; a later start sets the run RUNNING again and logs into it. MLflow has no
call that deletes metric points, so in the default file store a resumed start rewrites each
metric file without the points from `purge_from` on (what TensorBoard's purge does); on a
tracking server the replayed steps are logged again (the chart shows both; docs/trackers.md).
Annotations are tags `dslurm.event.s<start>.<n>` ("step S: text"); the run ends FINISHED
(completed), KILLED (stopped to be resumed) or FAILED.

MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is true: for the default store
this process sets it (unless the user set it), because a run directory on a shared
filesystem is no place for SQLite's locks. Tokens stay in the environment (MLFLOW_TRACKING_TOKEN).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.trackers import Start

SUBDIR = "mlruns"
_STATUS = {"completed": "FINISHED", "requeue": "KILLED", "terminated": "KILLED", None: "KILLED"}


def tracking_uri(ctx: Start) -> str:
    uri = ctx.spec.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or (ctx.run_dir / SUBDIR).resolve().as_uri()


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
        self.start, self.notes = ctx.start, 0
        run_id = ctx.state.get("run_id")
        if isinstance(run_id, str):
            self.run_id = run_id
            ctx.note(f"get_run {run_id}")
            run = self.client.get_run(run_id)  # raises when the store lost it: reported, not guessed
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
            ctx.save()

    def _purge(self, experiment_id: str, purge_from: int) -> None:
        store = self.client._tracking_client.store
        if not hasattr(store, "_get_run_dir"):  # a tracking server: no way to delete points
            return
        metrics = Path(store._get_run_dir(experiment_id, self.run_id)) / "metrics"
        for path in sorted(p for p in metrics.rglob("*") if p.is_file()):
            purge_metric_file(path, purge_from)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in values.items()])

    def event(self, text: str, step: int) -> None:
        self.notes += 1
        self.client.set_tag(self.run_id, f"dslurm.event.s{self.start:03d}.{self.notes:04d}", f"step {step}: {text}")

    def close(self, ending: str | None) -> None:
        self.client.set_terminated(self.run_id, status=_STATUS.get(ending, "FAILED"))


def describe(ctx: Start) -> str:
    uri = tracking_uri(ctx)
    return f"the MLflow file store {uri}" if uri.startswith("file:") else f"the MLflow tracking server {uri}"


def open_run(ctx: Start) -> MlflowTracker:
    return MlflowTracker(ctx)
