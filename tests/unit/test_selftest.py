"""`dslurm selftest --gpu`: the model sized from the memory (pure), the goals, the part runner
(a failing part is recorded, the others run, the report is on disk after each part), the CLI's
user errors. The whole check runs in tests/integration/test_selftest_dry_run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dslurm.cli import main
from dslurm.config.models import shape_from
from dslurm.errors import UserError
from dslurm.plan.memory import persistent_state
from dslurm.selftest import report as rp
from dslurm.selftest import sizing
from dslurm.selftest.cli import finish

ROOT = Path(__file__).resolve().parents[2]
BASE = shape_from("8b", vocab_size=32000, seq_len=4096)
H200 = 143771 * 2**20  # what NVML reports for an H200
H100 = 81559 * 2**20


@pytest.mark.parametrize("mem", [H100, H200])
def test_the_sized_model_fills_the_budget_and_one_more_step_would_not_fit(mem):
    sz = sizing.size_model(mem, base=BASE, layout=sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0,
                           fill=0.8, state_share=0.4, max_saved_bytes=20e9)
    budget = 0.8 * mem
    assert sz.planned_bytes <= budget
    state, act, logits = sizing.planned(sz.shape, sz.micro_batch + 1, sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0)
    assert state + act + logits > budget  # the largest micro-batch that fits
    deeper = replace(sz.shape, n_layers=sz.shape.n_layers + 1)
    too_much_state = persistent_state(deeper.num_params(), sizing.BF16_WORLD_OF_ONE).total > 0.4 * budget
    assert too_much_state or sizing.saved_bytes(deeper, sizing.BF16_WORLD_OF_ONE) > 20e9
    assert sz.saved_bytes <= 20e9 and sz.planned_bytes > 0.7 * mem  # "most of the memory"
    # 18 B/param resident, 12 of them (fp32 weights + Adam) in a checkpoint
    assert sz.state_bytes == pytest.approx(18 * sz.shape.num_params())
    assert sz.saved_bytes == pytest.approx(12 * sz.shape.num_params())


def test_the_checkpoint_cap_limits_the_depth_not_the_memory_use():
    wide = sizing.size_model(H200, base=BASE, layout=sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0)
    capped = sizing.size_model(H200, base=BASE, layout=sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0,
                               max_saved_bytes=8e9)
    assert capped.shape.n_layers < wide.shape.n_layers and capped.saved_bytes <= 8e9
    assert capped.micro_batch > wide.micro_batch  # activations take the room the layers left


def test_a_device_too_small_is_a_user_error_with_the_numbers():
    with pytest.raises(UserError, match="1.0 GB of device memory"):
        sizing.size_model(1e9, base=BASE, layout=sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0)
    with pytest.raises(UserError, match="no layer"):
        sizing.size_model(H200, base=BASE, layout=sizing.BF16_WORLD_OF_ONE, bytes_per_value=2.0, max_saved_bytes=1e6)


def test_goals_pass_fail_and_unjudged():
    parts = {"gemm": {"result": {"fraction_of_peak": 0.78}}, "trainer_compiled": {"result": {"mfu": 0.31}}}
    g = rp.judge(parts)
    assert g["gemm_bf16_fraction_of_peak"] == {"goal": 0.70, "value": 0.78, "pass": True}
    assert g["trainer_mfu_compiled"]["pass"] is False
    assert rp.judge({"gemm": {"status": "error"}})["gemm_bf16_fraction_of_peak"]["pass"] is None


def _report(tmp_path: Path, budget: float = 100.0, clock=None) -> rp.Report:
    data = rp.new_report(mode="dry-run", chip="cpu: test", device="cpu", site={}, notes=[], env={})
    return rp.Report(data, tmp_path / "r.json", budget, **({"clock": clock} if clock else {}))


def test_a_failing_part_is_recorded_and_the_next_part_still_runs(tmp_path):
    r = _report(tmp_path)

    def boom() -> dict:
        raise ValueError("disk full")

    assert r.run("checkpoint", boom) is None
    on_disk = json.loads((tmp_path / "r.json").read_text())  # written after each part
    assert on_disk["parts"]["checkpoint"]["status"] == "error"
    assert "ValueError: disk full" in on_disk["parts"]["checkpoint"]["error"]
    assert r.run("gemm", lambda: {"fraction_of_peak": 0.9}) == {"fraction_of_peak": 0.9}
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["parts"]["gemm"]["status"] == "ok" and on_disk["parts"]["gemm"]["chip"] == "cpu: test"
    assert on_disk["goals"]["gemm_bf16_fraction_of_peak"]["pass"] is True
    assert rp.failed(on_disk)[0] == "part nvml: not run"
    assert "part checkpoint: error" in rp.failed(on_disk)


def test_no_part_starts_once_the_budget_is_spent(tmp_path):
    t = iter([0.0, 5.0, 6.0, 7.0, 8.0, 150.0, 150.0])  # start, nvml: check, begin, end, save; gemm: check, save
    r = _report(tmp_path, budget=100.0, clock=lambda: next(t))
    r.run("nvml", lambda: {})
    ran = []
    r.run("gemm", lambda: ran.append(1) or {})
    assert r.data["parts"]["nvml"]["status"] == "ok" and r.data["parts"]["nvml"]["wall_s"] == 1.0
    assert r.data["parts"]["gemm"]["status"] == "skipped" and not ran
    assert "time budget of 100 s" in r.data["parts"]["gemm"]["error"]


def test_a_process_that_died_before_its_report_leaves_an_explained_one():
    rep = finish(None, "gpu", -9, True)
    assert rep["process"] == {"exit_code": -9, "timed_out": True}
    assert all(p["status"] == "not run" and "timeout" in p["error"] for p in rep["parts"].values())
    assert len(rp.failed(rep)) == len(rp.PARTS)


@pytest.mark.parametrize("argv, expect", [
    (["selftest"], "say which check: --gpu"),
    (["selftest", "--gpu", "--site", "nowhere.yaml"], "nowhere.yaml: no such file"),
    (["selftest", "--gpu", "--site", str(ROOT / "site-configs/local.yaml")], "field 'node.gpus' is 0"),
    (["selftest", "--gpu", "--dry-run", "--steps", "0"], "--steps=0 must be positive"),
])
def test_user_errors_exit_2_with_the_fix_and_no_traceback(argv, expect, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_importing_the_cli_imports_neither_torch_nor_the_trainer():
    code = "import sys, dslurm.selftest.cli, dslurm.selftest.sizing, dslurm.selftest.report; " \
           "sys.exit(any(m == 'torch' or m == 'train' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
