"""`dslurm ctl save` then `dslurm ctl stop` on the trainer under torchrun (2 processes), with
TensorBoard on: the extra save, the clean stop (exit 143: saved, not a requeue), the ledger's
operator requests, and the tracker's curve and annotations read back from the event files.
The run is started by hand (`torchrun -m train`, no `dslurm submit`: no job.yaml), as people
debug in an salloc; the commands are the CLI's, finding the run by the note rank 0 leaves."""

from __future__ import annotations

import threading
import time

import pytest

from dslurm.observe import ctl
from dslurm.observe.ledger import read_events
from testkit import run_cli
from train_helpers import run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_ctl_save_then_stop_with_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = write_job(tmp_path, "op", steps=40)
    job.write_text(job.read_text().replace("  log_every: 1\n", "  log_every: 1\n  step_sleep_s: 0.5\n")
                   + "metrics:\n  trackers: [tensorboard]\n")
    run = tmp_path / "op"
    said: list = []

    def wait_for(path) -> None:
        deadline = time.time() + 240
        while not path.exists() and time.time() < deadline:
            time.sleep(0.2)

    def save_then_stop() -> None:
        wait_for(run / "ctl_taker.json")  # rank 0 polls from here on
        said.append(run_cli("ctl", str(run), "save"))  # taken at the next step boundary
        wait_for(run / ctl.TAKEN)
        said.append(run_cli("ctl", str(run), "stop"))  # taken at a poll >= 5 s later

    refused = run_cli("ctl", str(run), "save")  # nothing has started there yet
    assert refused.returncode == 2 and "ctl_taker.json" in refused.stderr, refused.stderr
    asker = threading.Thread(target=save_then_stop, daemon=True)
    asker.start()
    proc = run_train(2, job, timeout=150)
    asker.join(timeout=30)
    assert [r.returncode for r in said] == [0, 0], [r.stderr for r in said]
    assert not (run / "job.yaml").exists()
    assert proc.returncode == 1 and "exitcode  : 143" in proc.stderr, proc.stderr[-3000:]
    events = list(read_events(run))
    ops = [(e["action"], e["step"]) for e in events if e["event"] == "operator_request"]
    assert [a for a, _ in ops] == ["save", "stop"], ops
    save_step, stop_step = ops[0][1], ops[1][1]
    assert 1 <= save_step < stop_step < 40, ops
    assert [e["step"] for e in events if e["event"] == "ckpt_save"] == [save_step, stop_step]
    ended = run_cli("ctl", str(run), "save")  # its ledger says the run ended: nobody would take it
    assert ended.returncode == 2 and "ended (terminated" in ended.stderr, ended.stderr
    last = events[-1]
    assert (last["event"], last["reason"], last["step"]) == ("exit", "terminated", stop_step)

    acc = EventAccumulator(str(run / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, stop_step + 1))
    assert [s.step for s in acc.Scalars("ckpt/stall_s")] == [save_step, stop_step]
    notes = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("dslurm/events")]
    assert notes[0] == "start: fresh start" and notes[-1] == f"exit: terminated at step {stop_step} (code 143)"
