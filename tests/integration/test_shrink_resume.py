"""A shrink with the real trainer (issue 17): a 2x2 FSDPxTP run (as on 2 nodes: dp 2) stopped
after step 2 resumes on half the processes (as on 1 node: dp 1) with the gradient accumulation
`recover.shrink_grad_accum` computes, passed the way `dslurm supervise` passes it
(`--set train.grad_accum=N`). The global batch is the same, so every loss matches one
uninterrupted single-process run (dp 1, no accumulation) within 1e-5.

Cost: one 4-process and one 2-process torchrun plus one plain process: ~40 s on 2 idle cores.
"""

from __future__ import annotations

import pytest

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.recover import shrink_grad_accum
from dslurm.recover.srun import SrunRunner
from dslurm.recover.supervisor import Step
from train_helpers import SITE, run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
STEPS, TOL = 4, 1e-5


def test_a_shrunk_run_keeps_the_global_batch_and_the_loss(tmp_path):
    ref_job = write_job(tmp_path, "ref", steps=STEPS)
    assert run_train(None, ref_job).returncode == 0
    ref = {e["first"]: e["loss"] for e in step_records(tmp_path / "ref")}

    job = write_job(tmp_path, "shrink", steps=STEPS)
    two_nodes = resolve(load_site(SITE), load_job(job, ["nodes=2", "parallel.tp=2"]))
    accum = shrink_grad_accum(two_nodes, 1)
    assert (two_nodes.layout.dp, accum) == (2, 2)
    extra = SrunRunner(two_nodes, ["train"], {}).argv(Step(index=1, hosts=("node1",), facts_dir=tmp_path,
                                                            grad_accum=accum))[-2:]
    assert extra == ["--set", "train.grad_accum=2"]

    first = run_train(4, job, "parallel.tp=2", env={"DSLURM_FAULT_STOP": "2:3"})
    assert first.returncode == 1 and "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    second = run_train(2, job, "parallel.tp=2", extra[1])
    assert second.returncode == 0, second.stderr[-3000:]

    records = step_records(tmp_path / "shrink")
    got = {e["first"]: e["loss"] for e in records}
    assert sorted(got) == list(range(STEPS)) and len(records) == STEPS  # resumed at 2: no step twice
    bad = {s: (got[s], ref[s]) for s in ref if abs(got[s] - ref[s]) > TOL}
    assert not bad, bad
