"""Resharded resume with the real trainer (`python -m train`, under torchrun): a run stopped by
the test hook (DSLURM_FAULT_STOP -> agreed stop -> synchronous save -> exit 75) and resumed in
another layout trains on as if it had never stopped.

One uninterrupted single-process run is the reference for every step. Against it:
  - a chain of starts on ONE run directory, each resuming in a new layout and stopping after
    one step: FSDPx4 (dp 4) -> 2x2 FSDPxTP (dp 2) -> 3D PPxFSDPxTP 2x2x2 (8 processes, dp 2)
    -> one process (dp 1) to the end; every loss within 1e-5;
  - same layout (one process stopped after step 3, resumed): losses bit-identical.
The step right after each resume is the sharp check: it needs the parameters, AdamW moments,
the LR step and the sampler's global position (counted in samples, so it carries over a change
of dp size) all restored. Consecutive batches' losses differ by far more than 1e-5 here (asserted
on the reference), so a sampler that restarted or skipped a batch fails by orders of magnitude.

Cost: every process imports torch and the trainer (~5-10 CPU-s each), so this file is ~170
CPU-s, i.e. ~90 s on 2 idle cores; the chain shares its runs between the layout changes to keep
it there. Same-layout bitwise resume across ranks is covered with the real trainer by
tests/cluster/test_requeue_chain.py (2x2, real Slurm) and for FSDPx2 by test_checkpoint_dist.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dslurm.observe.ledger import read_events
from testkit import load_scaled
from train_helpers import run_train, step_records, write_job

# Only a backstop: each start has its own deadline that follows the load as it runs (run_train).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(load_scaled(400, procs=8)))]
STEPS = 5
TOL = 1e-5
# (name, nproc (None: one plain process), --set overrides, stop after this many steps or None)
# The first two links also run checkpoint.verify_resume: replay: the trainer's probe under FSDP and
# under TP's loss parallel, recorded at fsdp4's stop and recomputed after the reshard to 2x2 (within
# dslurm.checkpoint.replay.RESHARD_RTOL); pipeline parallel refuses replay, so the third does not.
REPLAY = "checkpoint.verify_resume=replay"
CHAIN = [
    ("fsdp4", 4, (REPLAY,), 1),
    ("fsdp2xtp2", 4, ("parallel.tp=2", REPLAY), 2),
    ("pp2xfsdp2xtp2", 8, ("parallel.pp=2", "parallel.tp=2", "parallel.microbatches=2"), 3),
    ("1 process", None, (), None),
]


def losses(run_dir: Path) -> dict[int, float]:
    """0-based step -> loss over every start of the run; a step trained twice fails."""
    out: dict[int, float] = {}
    for e in step_records(run_dir):
        assert e["first"] not in out, f"step {e['first']} trained twice in {run_dir}"
        out[e["first"]] = e["loss"]
    return out


def run_link(nproc: int | None, job: Path, sets: tuple[str, ...], stop_at: int | None) -> None:
    """One start: stopped by the hook on the LAST rank (the others learn it from the all-reduce)
    with exit 75, or run to the end with exit 0."""
    env = {"DSLURM_FAULT_STOP": f"{stop_at}:{(nproc or 1) - 1}"} if stop_at else None
    proc = run_train(nproc, job, *sets, env=env)
    if stop_at is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    elif nproc is None:
        assert proc.returncode == 75, proc.stderr[-3000:]
    else:  # torchrun exits 1 for any worker failure; the workers' 75 is in its report
        assert proc.returncode == 1 and "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]


def check_deltas(name: str, got: dict[int, float], ref: dict[int, float], tol: float) -> None:
    assert sorted(got) == sorted(ref), (name, sorted(got))
    deltas = {s: abs(got[s] - ref[s]) for s in ref}
    print(f"\n{name}: |loss delta| per step " + ", ".join(f"{s}:{d:.1e}" for s, d in deltas.items()))
    bad = {s: (got[s], ref[s]) for s, d in deltas.items() if d > tol}
    assert not bad, (name, tol, bad)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of one uninterrupted single-process run, every step."""
    tmp = tmp_path_factory.mktemp("ref")
    run_link(None, write_job(tmp, "ref", steps=STEPS), (), None)
    ref = losses(tmp / "ref")
    assert sorted(ref) == list(range(STEPS))
    values = list(ref.values())
    assert min(abs(a - b) for a, b in zip(values, values[1:])) > 100 * TOL
    return ref


def test_resume_across_layouts_matches_uninterrupted(reference, tmp_path):
    job = write_job(tmp_path, "chain", steps=STEPS)
    for _, nproc, sets, stop_at in CHAIN:
        run_link(nproc, job, sets, stop_at)
    events = list(read_events(tmp_path / "chain"))
    starts = [e for e in events if e["event"] == "train_start"]
    restores = [e for e in events if e["event"] == "ckpt_restore"]
    # Each start resumed exactly where the previous one saved, in the layout it was given.
    assert [s["step"] for s in starts] == [0, 1, 2, 3]
    assert [r["step"] for r in restores] == [1, 2, 3] and not any(
        e["event"] == "ckpt_fallback" for e in events)
    assert restores[0]["replay_s"] > 0 and restores[1]["replay_s"] is None  # fsdp2xtp2 replayed; pp did not
    assert [tuple(s["layout"][k] for k in ("pp", "dp_shard", "tp")) for s in starts] == [
        (1, 4, 1), (1, 2, 2), (2, 2, 2), (1, 1, 1)]
    check_deltas(" -> ".join(name for name, *_ in CHAIN), losses(tmp_path / "chain"), reference, TOL)


def test_same_layout_resume_is_bit_identical(reference, tmp_path):
    """With checkpoint.verify_resume: replay (dslurm/checkpoint/replay.py): the stop's save records
    the trainer's probe loss (a forward on the next step's batch) and the resume recomputes it
    bit-equal before its first step; neither probe moves the data order or the RNG (the losses are
    still the reference's, bit for bit)."""
    job = write_job(tmp_path, "same", steps=STEPS)
    replay = ("checkpoint.verify_resume=replay",)
    run_link(None, job, replay, 3)
    run_link(None, job, replay, None)
    events = list(read_events(tmp_path / "same"))
    starts = [e["step"] for e in events if e["event"] == "train_start"]
    assert starts == [0, 3]
    got = losses(tmp_path / "same")
    check_deltas("1 process -> 1 process", got, reference, 0.0)
    assert got == reference  # bitwise: same layout, same data order, RNG restored
    (restore,) = [e for e in events if e["event"] == "ckpt_restore"]
    assert restore["step"] == 3 and restore["replay_s"] > 0 and not restore["rejected"]
    assert restore["last_step"]["loss"] == reference[2]  # the saved step's loss, as the step logged it
