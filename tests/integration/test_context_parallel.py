"""Context parallel (train/parallel/cp.py) gives what one process gives, on CPU with gloo.

Model level (tests/integration/cp_script.py, one torchrun of 2 and one of 4 processes): cp=2 and
cp=4 alone, with FSDP (dp_shard 2), with HSDP (dp_replicate 2) and with TP 2, for the tiny preset and
for the shapes `model.init_from` builds from a Mistral config.json (sliding window of 8 of 32 keys)
and a Qwen2 one (q/k/v biases), with and without the documents of packed instruction data: every
rank's logits (its two chunks), the loss and every gradient equal the whole model's in one process
within 1e-5 (fp32).

Trainer level: pp 2 x cp 2 on 4 processes trains 4 steps with the same losses and clipped gradient
norms as one process within 1e-5; `parallel.cp=2` on 2 processes trains 2 steps so, saves a
generation (parameters sharded over dp_shard x cp), and one process (cp=1) resumes it: steps 3 and
4 are the reference's too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from train_helpers import SITE, run_procs, run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TOL = 1e-5
SCRIPT = Path(__file__).with_name("cp_script.py")

CASES_2 = [
    {"shape": "tiny", "layout": {"cp": 2}, "docs": False},
    {"shape": "mistral", "layout": {"cp": 2}, "docs": True},
    {"shape": "qwen2", "layout": {"cp": 2}, "docs": False},
]
CASES_4 = [
    {"shape": "tiny", "layout": {"cp": 4}, "docs": False},
    {"shape": "mistral", "layout": {"cp": 4}, "docs": True},
    {"shape": "tiny", "layout": {"cp": 2, "dp_shard": 2}, "docs": True},
    {"shape": "mistral", "layout": {"cp": 2, "dp_shard": 2}, "docs": False},
    {"shape": "tiny", "layout": {"cp": 2, "dp_replicate": 2, "dp_shard": 1}, "docs": False},
    {"shape": "tiny", "layout": {"cp": 2, "tp": 2}, "docs": False},
    {"shape": "mistral", "layout": {"cp": 2, "tp": 2}, "docs": True},
    {"shape": "qwen2", "layout": {"cp": 2, "tp": 2}, "docs": False},
]


def _model_level(tmp_path: Path, nproc: int, cases: list[dict]) -> list[dict]:
    out = tmp_path / f"cp{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), str(out), json.dumps(cases)]
    proc = run_procs(cmd, nproc, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc,cases", [(2, CASES_2), (4, CASES_4)], ids=["2proc", "4proc"])
def test_logits_loss_and_grads_equal_one_process(tmp_path, nproc, cases):
    results = _model_level(tmp_path, nproc, cases)
    assert [(r["shape"], r["layout"]) for r in results] == [(c["shape"], c["layout"]) for c in cases]
    for r in results:
        print(f"\n{r['shape']} {r['layout']} docs={r['docs']}: logits {r['logits']:.1e} loss {r['loss']:.1e} "
              f"grad {r['grad']:.1e} (largest grad {r['grad_scale']:.2f})")  # pytest -s
        assert r["grad_scale"] > 0.01  # the gradients compared are not vanishing
        for term in ("logits", "loss", "grad"):
            assert r[term] < TOL, (r["shape"], r["layout"], term, r[term])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[float, float]]:
    """(loss, grad_norm) of the 4 steps of the single-process run, computed in-process."""
    import torch
    import torch.distributed as dist

    from dslurm.config.resolve import load
    from train.loop import Trainer

    tmp = tmp_path_factory.mktemp("ref")
    resolved = load(SITE, write_job(tmp, "ref"), ["procs_per_node=1"], ["node.nvlink_domain=8"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(resolved, device=torch.device("cpu"), rank=0, world_size=1, checkpoint=False)
        out = [(r.loss, r.grad_norm) for r in (trainer.train_step() for _ in range(4))]
    finally:
        dist.destroy_process_group()
    return out


def _close(got: list[dict], want: list[tuple[float, float]]) -> None:
    for e, (loss, norm) in zip(got, want, strict=True):
        assert abs(e["loss"] - loss) < TOL, (e["first"], e["loss"], loss)
        assert abs(e["grad_norm"] - norm) < TOL, (e["first"], e["grad_norm"], norm)


def test_pp2_x_cp2_trains_as_one_process(tmp_path, reference):
    proc = run_train(4, write_job(tmp_path, "ppcp"), "parallel.cp=2", "parallel.pp=2", "parallel.microbatches=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = step_records(tmp_path / "ppcp")
    assert [e["first"] for e in got] == [0, 1, 2, 3]
    _close(got, reference)


def test_cp2_trains_as_one_process_and_its_generation_resumes_on_one(tmp_path, reference):
    """Steps 1-2 at cp=2 on 2 processes; saved at step 2; steps 3-4 on one process (cp=1). The
    schedule is the 4-step one throughout (train.steps=4 both times), so every step is the reference's."""
    job = write_job(tmp_path, "cpr")
    job.write_text(job.read_text().replace("interval: 100", "interval: 2"))
    proc = run_train(2, job, "parallel.cp=2", env={"DSLURM_FAULT_STOP": "2"})
    assert proc.returncode != 0 and "exitcode  : 75" in proc.stderr, proc.stderr[-3000:]
    got = step_records(tmp_path / "cpr")
    assert [e["first"] for e in got] == [0, 1]
    _close(got, reference[:2])
    proc = run_train(None, job, "procs_per_node=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = step_records(tmp_path / "cpr")
    assert [e["first"] for e in got] == [0, 1, 2, 3]
    _close(got, reference)
