"""Every layout trains like one process: the losses and clipped gradient norms of the first
4 steps of FSDPx4, FSDPxTP 2x2, PPx2 (1F1B) and PPxFSDPxTP 2x2x2 equal a single-process
run on the same global batch (tiny model, fp32, gloo on CPU), and the LR follows the
schedule. The reference runs in this process (world of one, in-memory store).

`DSLURM_PARITY_ALL=1 pytest -m integration tests/integration/test_parity.py` adds the layouts kept
out of the suite to keep it short (HSDP, the other pipeline schedules, activation checkpointing
with gradient accumulation, per-block torch.compile alone and with TP): docs/trainer.md."""

from __future__ import annotations

import os

import pytest

from train_helpers import SITE, run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[float, float, float]]:
    """(loss, grad_norm, lr) per step of the single-process run, computed in-process."""
    import torch
    import torch.distributed as dist

    from dslurm.config.resolve import load
    from train.loop import Trainer

    tmp = tmp_path_factory.mktemp("ref")
    job = write_job(tmp, "ref")
    resolved = load(SITE, job, ["procs_per_node=1"], ["node.nvlink_domain=8"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, checkpoint=False)
        out = []
        for _ in range(4):
            r = trainer.train_step()
            out.append((r.loss, r.grad_norm, r.lr))
    finally:
        dist.destroy_process_group()
    return out


LAYOUTS = {
    "fsdp4": (4, []),
    "fsdp2xtp2": (4, ["parallel.tp=2"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=1F1B"]),
    "pp2xfsdp2xtp2": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"]),
}


# Out of the suite (minutes on 2 cores, the compiled ones most): DSLURM_PARITY_ALL=1 runs them.
MORE = {
    "hsdp2x2": (4, ["parallel.dp_replicate=2"]),
    "pp2-interleaved-4mb": (2, ["parallel.pp=2", "parallel.microbatches=4", "parallel.pp_schedule=Interleaved1F1B"]),
    "pp2-gpipe": (2, ["parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=GPipe"]),
    "fsdp2xtp2-selective-ac-accum2": (4, ["parallel.tp=2", "train.activation_checkpoint=selective",
                                          "train.grad_accum=2"]),
    "pp2-full-ac-accum2": (2, ["parallel.pp=2", "parallel.microbatches=2", "train.activation_checkpoint=full",
                               "train.grad_accum=2"]),
    "compile": (2, ["train.compile=true"]),
    "compile-tp2": (2, ["train.compile=true", "parallel.tp=2"]),
}
ALL = os.environ.get("DSLURM_PARITY_ALL") == "1"


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=[pytest.mark.skipif(
    not ALL, reason="out of the suite: DSLURM_PARITY_ALL=1 runs it"), pytest.mark.timeout(1200)]) for n in MORE)])
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, sets = {**LAYOUTS, **MORE}[name]
    job = write_job(tmp_path, name)
    proc = run_train(nproc, job, *sets, timeout=600 if name in MORE else 90)  # compiling takes minutes on CPU
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = step_records(tmp_path / name)
    assert [e["first"] for e in got] == [0, 1, 2, 3]
    dloss = max(abs(e["loss"] - ref[0]) for e, ref in zip(got, reference))
    dnorm = max(abs(e["grad_norm"] - ref[1]) for e, ref in zip(got, reference))
    print(f"\n{name}: max |loss delta| {dloss:.2e}, max |grad-norm delta| {dnorm:.2e}")  # pytest -s
    for e, (loss, norm, lr) in zip(got, reference):
        assert abs(e["loss"] - loss) < TOL, (name, e["first"], e["loss"], loss)
        assert abs(e["grad_norm"] - norm) < TOL, (name, e["first"], e["grad_norm"], norm)
        assert e["lr"] == pytest.approx(lr, rel=1e-12)


def test_reference_clips_and_follows_the_schedule(reference):
    """The comparison above is meaningful: clipping is active and the LR is train.lr's curve."""
    from train.lr import lr_at

    for step, (loss, norm, lr) in enumerate(reference):
        assert norm > 0.3  # above grad_clip: every step was clipped
        assert lr == pytest.approx(lr_at(step, lr=3e-3, warmup_steps=2, total_steps=4, min_lr_ratio=0.1))
    assert reference[-1][0] < reference[0][0]  # and it learns
