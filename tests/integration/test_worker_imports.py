"""A worker imports what its layout uses: no pipelining without pp, no parallel styles of ours
without tp, no compiler without compile, no plotting or terminal UI ever (issue 15).

Each worker runs the real entry (`python -m train`, under torchrun for world > 1) through a
wrapper that writes the worker's `sys.modules` on exit.

Two torch modules are in every worker whatever the layout, imported by torch itself, not by us
(torch 2.13): `torch.distributed.tensor.parallel` (torch/distributed/fsdp/_init_utils.py imports
it, and DCP imports torch.distributed.fsdp; ~1 ms once DTensor is loaded, which DCP needs
anyway) and `torch._dynamo` with a part of `torch._inductor` (every torch.optim optimizer
imports torch._dynamo in `add_param_group` and in `step`: torch/_compile.py `_disable_dynamo`,
torch/optim/optimizer.py `_use_grad_for_differentiable`). The compiler proper
(`torch._inductor.compile_fx`, AOTAutograd) stays out without compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslurm.observe import events, phases
from train_helpers import run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The trainer leaves without the interpreter's finalization (dslurm.endings.worker_exit.leave: no atexit),
# so the dump rides on `leave` itself: the modules as they are when the worker exits.
WRAPPER = """\
import json, os, runpy, sys
import dslurm.endings.worker_exit as ex
out, real = sys.argv[1], ex.leave
def leave(code):
    open(out % os.environ.get("RANK", "0"), "w").write(json.dumps(sorted(sys.modules)))
    real(code)
ex.leave = leave
sys.argv = ["train", *sys.argv[2:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""
NEVER = ("matplotlib", "rich")
PIPELINE = ("torch.distributed.pipelining", "train.parallel.pp")
TP = ("train.parallel.tp",)
COMPILER = ("train.parallel.compile", "torch._inductor.compile_fx", "torch._functorch.aot_autograd")


def worker_modules(tmp_path: Path, nproc: int | None, *sets: str) -> list[set[str]]:
    """Run a 2-step job; the modules each rank had imported when it exited."""
    wrapper = tmp_path / "dump_modules.py"
    wrapper.write_text(WRAPPER)
    out = str(tmp_path / "modules-%s.json")
    job = write_job(tmp_path, "imports", steps=2)
    proc = run_train(nproc, job, *sets, entry=(str(wrapper), out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [set(json.loads(Path(out % r).read_text())) for r in range(nproc or 1)]


def test_plain_layout_worker_has_no_pipelining_tp_styles_compiler_or_plotting(tmp_path):
    (mods,) = worker_modules(tmp_path, None)  # pp 1, tp 1, no compile, one process
    assert "train.loop" in mods and "torch.distributed.checkpoint" in mods  # it did train and save
    assert [m for m in (*NEVER, *PIPELINE, *TP, *COMPILER, "train.parallel.ac") if m in mods] == []
    # ... and timed its start: every phase the worker passes, in the reader's order
    (start,) = phases.tables(events.read(tmp_path / "imports"))
    assert [n for n, _ in start.rows] == [n for n in phases.PHASES]
    assert start.cold and start.startup_s() > 0


def test_pipeline_layout_imports_pipelining(tmp_path):
    for mods in worker_modules(tmp_path, 2, "parallel.pp=2", "parallel.microbatches=2"):
        assert set(PIPELINE) <= mods
        assert [m for m in (*NEVER, *TP, *COMPILER) if m in mods] == []


def test_tp_layout_imports_the_parallel_styles_and_no_pipelining(tmp_path):
    for mods in worker_modules(tmp_path, 2, "parallel.tp=2"):
        assert set(TP) <= mods and "torch.distributed.tensor.parallel.style" in mods
        assert [m for m in (*NEVER, *PIPELINE, *COMPILER) if m in mods] == []
