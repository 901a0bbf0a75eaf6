"""`dslurm plan` and `dslurm plan simulate` through the real CLI entry point."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_plan_8b_json(capsys):
    code, out = _json(capsys, ["plan", "--model", "8b", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                               "--nodes", "4", "--json"])
    assert code == 0
    lay = out["proposal"]["layout"]
    assert (lay["tp"], lay["pp"], lay["dp_shard"], lay["dp_replicate"]) == (1, 1, 8, 4)
    assert out["model_flops_per_token"] / 1e9 == pytest.approx(57.9, abs=0.1)


def test_plan_table_names_the_reasons(capsys):
    assert main(["plan", "--model", "70b", "--nodes", "4"]) == 0
    text = capsys.readouterr().out
    assert "proposed layout: fits" in text and "NVLink domain" in text


def test_plan_from_site_and_job_files(capsys):
    site, job = ROOT / "site-configs/h100-ib.yaml", ROOT / "examples/jobs/llama70b-h100.yaml"
    if not (site.exists() and job.exists()):
        pytest.skip("example site/job files not present")
    code, out = _json(capsys, ["plan", "--site", str(site), "--job", str(job), "--json"])
    checked = out["job_layout"]
    assert (checked["layout"]["tp"], checked["layout"]["pp"]) == (8, 2)
    assert checked["bubble"] == pytest.approx(1 / 9)  # pp=2, 8 microbatches
    assert code == (0 if checked["fits"] else 1)
    assert out["cluster"]["nvlink_domain"] == 8 and "tokens_per_s_at_40pct_mfu" in out


def test_simulate_json_reports_goodput_and_chosen_interval(capsys):
    code, out = _json(capsys, ["plan", "simulate", "--gpus", "16384", "--mtbf-years", "5",
                               "--save-s", "240", "--trials", "50", "--json"])
    s = out["summary"]
    assert code == 0 and s["job_mtbf_h"] == pytest.approx(2.675, abs=0.01)
    assert s["best_interval_s"] == max(out["intervals"], key=lambda r: r["mean"])["interval_s"]
    assert 0.6 < s["goodput_mean"] < 0.85


@pytest.mark.parametrize("argv, message", [
    (["plan", "simulate", "--gpus", "0", "--save-s", "60"], "gpus=0"),
    (["plan", "simulate", "--gpus", "8", "--save-s", "-1"], "save_s=-1"),
    (["plan", "simulate", "--gpus", "8", "--save-s", "60", "--mtbf-years", "0"], "--mtbf-years=0"),
    (["plan", "--nodes", "0"], "nodes=0"),
    (["plan", "--model", "13b"], "--model '13b' is unknown"),
    (["plan", "--model", "70b", "--nodes", "1"], "no layout fits"),
    (["plan", "--site", "x.yaml"], "--site and --job go together"),
])
def test_bad_input_exits_2_without_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_cli_imports_no_numpy_rich_or_torch():
    code = ("import sys, dslurm.plan.cli, dslurm.plan.choose, dslurm.plan.simulate; "
            "print(sorted(m for m in ('numpy', 'rich', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
