"""Silent data corruption (issue 18) with real torchrun + gloo: 3 HSDP replicas (dp_replicate 3),
one bit flipped in rank 1's parameters after step 3 (DSLURM_FAULT_BITFLIP). The check before the
save at step 4 sees it, names rank 1 (2 against 1), blocklists its node and rolls back to the
generation of step 2 (saved right after the last clean check); the replay ends bit for bit where
a run without the flip ends."""

from __future__ import annotations

import pytest

from dslurm.checkpoint import read_pointer
from dslurm.checkpoint.tiers import node_name
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.run import read_blocklist
from train_helpers import run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HSDP3 = ("parallel.dp_replicate=3", "checkpoint.interval=2", "health.sdc_every=50", "train.global_batch=6")


def test_a_bit_flip_in_one_replica_is_named_blocklisted_and_rolled_back(tmp_path):
    job = write_job(tmp_path, "flip", steps=6)
    proc = run_train(3, job, *HSDP3, env={"DSLURM_FAULT_BITFLIP": "3:1"}, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "flip"
    (sdc,) = ev.of(ev.read(run), ev.Sdc)
    assert sdc.step == 4 and sdc.last_clean_step == 2, sdc  # caught at the next check: the save at step 4
    assert sdc.suspects == [1] and sdc.named and sdc.suspect_hosts == [node_name()], sdc
    assert "[1] disagree with the majority [0, 2]" in sdc.why and sdc.params == ["tok_embeddings.weight"], sdc
    assert sdc.action == "rollback" and sdc.resumed_step == 2 and sdc.generation.startswith("step-00000002"), sdc
    assert sdc.blocklisted == [node_name()] and read_blocklist(run) == [node_name()]
    steps = [e["first"] for e in step_records(run)]
    assert steps == [0, 1, 2, 3, 2, 3, 4, 5], steps  # steps 3 and 4 (0-based 2, 3) again
    assert read_pointer(run).step == 6
    events = ev.read(run)
    saves = [(e.step, e.t >= sdc.t) for e in ev.of(events, ev.CkptSave)]
    assert saves == [(2, False), (4, True), (6, True)], saves  # the corrupted step 4 was never saved
    sm = summarize(events)
    assert len(sm.starts) == 1 and any("silent data corruption" in line for line in sm.health), sm.health

    clean = write_job(tmp_path, "clean", steps=6)  # the reference: the same run without the flip
    ref = run_train(3, clean, *HSDP3, timeout=200)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert not list(ev.of(ev.read(tmp_path / "clean"), ev.Sdc))  # no false alarm over 3 checks
    got = {e["first"]: e["loss"] for e in step_records(run)}  # the replay's (last) loss per step
    want = {e["first"]: e["loss"] for e in step_records(tmp_path / "clean")}
    assert got == want, (got, want)  # the corrupted steps left nothing behind
