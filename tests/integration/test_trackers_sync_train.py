"""`dslurm trackers sync RUN --to tensorboard` on a run the trainer made with no tracker (issue 53):
every loss point of the ledger in TensorBoard, with the ledger's values, and a second sync adds
nothing. The start's ledger also records the torch it ran (`start_env`)."""

from __future__ import annotations

import pytest

from dslurm.cli import main
from dslurm.observe import events as ev
from train_helpers import run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_sync_to_tensorboard_writes_every_ledger_loss_point_of_a_trainer_run(tmp_path):
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    job = write_job(tmp_path, "plain", steps=12)
    proc = run_train(None, job, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "plain"
    evs = ev.read(run)
    want = {e.last + 1: e.loss for e in evs if isinstance(e, ev.Steps) and e.last is not None}
    assert sorted(want) == list(range(1, 13)) and not (run / "tensorboard").exists()
    (env,) = [e for e in evs if isinstance(e, ev.StartEnv)]
    assert env.torch == torch.__version__

    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 0
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    got = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert sorted(got) == sorted(want)
    assert all(abs(got[s] - want[s]) < 1e-5 * max(1.0, abs(want[s])) for s in want), (got, want)
    files = sorted((run / "tensorboard").iterdir())
    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 0
    assert sorted((run / "tensorboard").iterdir()) == files  # nothing more to write
