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
    # pp=2, 8 microbatches, Interleaved1F1B with v=2: (p-1)/(v*m+p-1) = 1/17, not 1F1B's 1/9.
    assert checked["layout"]["schedule"] == "Interleaved1F1B"
    assert checked["bubble"] == pytest.approx(1 / 17) and checked["bubble_overhead"] == pytest.approx(1 / 16)
    assert checked["first_stage_in_flight"] == pytest.approx(2.5)  # p + (p-1)/v
    assert code == (0 if checked["fits"] else 1)
    assert out["cluster"]["nvlink_domain"] == 8 and "tokens_per_s_at_40pct_mfu" in out


def test_simulate_json_reports_goodput_and_chosen_interval(capsys):
    code, out = _json(capsys, ["plan", "simulate", "--gpus", "16384", "--mtbf-years", "5", "--mechanism", "requeue",
                               "--save", "sync", "--save-s", "240", "--trials", "50", "--json"])
    (s,) = out["results"]
    assert code == 0 and s["job_mtbf_h"] == pytest.approx(2.675, abs=0.01)
    assert s["best_interval_s"] == max(s["intervals"], key=lambda r: r["mean"])["interval_s"]
    assert 0.6 < s["goodput_mean"] < 0.85


@pytest.mark.parametrize("argv, message", [
    (["plan", "simulate", "--gpus", "0", "--save-s", "60"], "gpus=0"),
    (["plan", "simulate", "--gpus", "8", "--save-s", "-1"], "save_s=-1"),
    (["plan", "simulate", "--gpus", "8", "--save-s", "60", "--mtbf-years", "0"], "--mtbf-years=0"),
    (["plan", "--nodes", "0"], "nodes=0"),
    (["plan", "--model", "13b"], "--model '13b' is unknown"),
    (["plan", "--model", "70b", "--nodes", "1"], "no layout fits"),
    (["plan", "--job", "examples/jobs/llama8b-h100.yaml"], "--job needs --site"),
    (["plan", "--set", "train.steps=5"], "--set train.steps=5 changes a job field and needs --job"),
    (["plan", "--site-set", "node.gpus=8"], "--site-set node.gpus=8 changes a site field and needs --site"),
    (["plan", "--site", "site-configs/h100-ib.yaml", "--job", "examples/jobs/llama8b-h100.yaml", "--nodes", "2"],
     "Fix: --set nodes=2"),
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


# ------------------------------------------------------------------ shipped examples and the site path

from dslurm.cli.render import EXAMPLES  # noqa: E402  (the one list of shipped (site, job) pairs)


@pytest.mark.parametrize("site,job", EXAMPLES)
def test_every_shipped_example_fits_its_site(capsys, monkeypatch, site, job):
    """`dslurm plan --site S --job J` on every pair the repo ships: exit 0 and the job's layout fits."""
    monkeypatch.chdir(ROOT)  # as users run them, with repo-relative paths
    code, out = _json(capsys, ["plan", "--site", site, "--job", job, "--json"])
    checked = out["job_layout"]
    assert checked["fits"], f"{job} does not fit {site}: {checked['problems']}"
    assert code == 0


def test_examples_cover_every_shipped_job_file():
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "examples/jobs").glob("*.yaml")}
    assert shipped == {job for _, job in EXAMPLES}, "a job under examples/jobs has no site in EXAMPLES"


def test_70b_example_prints_schedule_collectives_and_mfu(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "250")  # no wrapping inside the asserted lines
    assert main(["plan", "--site", "site-configs/h100-ib.yaml", "--job", "examples/jobs/llama70b-h100.yaml"]) == 0
    text = capsys.readouterr().out
    assert "Interleaved1F1B, p=2 stages, v=2" in text and "(p-1)/(v*m+p-1) = 1/17" in text
    assert "(p-1)/(v*m) = 1/16" in text and "first stage holds 2.5 microbatches" in text
    for dim in ("dp_shard", "dp_replicate", "tp", "pp"):
        assert f"│ {dim}" in text
    assert "busbw" in text and "per dimension:" in text
    assert "executed 641.9 GFLOP/token (full recomputation re-runs the forward: +2N + 4LHQT)" in text
    assert "40% MFU = 105,177 tokens/s" in text


def test_site_with_model_and_nodes_needs_no_job(capsys):
    code, out = _json(capsys, ["plan", "--site", str(ROOT / "site-configs/h100-ib.yaml"), "--model", "8b",
                               "--nodes", "2", "--json"])
    assert code == 0 and "job_layout" not in out
    c = out["cluster"]
    assert (c["nodes"], c["gpus_per_node"], c["gpu_mem_gb"], c["inter_gbytes_per_s"]) == (2, 8, 80, 400)
    assert out["proposal"]["fits"] and out["proposal"]["mfu"]["peak_flops"] == pytest.approx(16 * 989e12)


def test_gpu_memory_flag_applies_before_the_check_that_names_it(capsys):
    site = str(ROOT / "site-configs/h100-ib.yaml")
    argv = ["plan", "--site", site, "--site-set", "node.gpu_mem_gb=0", "--model", "8b", "--nodes", "2"]
    assert main(argv) == 2
    assert "or pass --gpu-mem-gb 80" in capsys.readouterr().err
    code, out = _json(capsys, argv + ["--gpu-mem-gb", "80", "--json"])  # the fix it names works
    assert code == 0 and out["cluster"]["gpu_mem_gb"] == 80


def test_cpu_site_plans_against_memory_per_process_or_the_flag(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = ["plan", "--site", "site-configs/local.yaml", "--job", "examples/jobs/tiny-2node.yaml", "--json"]
    code, out = _json(capsys, argv)
    assert code == 0 and out["cluster"]["gpu_mem_gb"] == 4  # node.mem_gb 8 / 2 processes
    assert "CPU site 'local'" in out["cluster"]["memory_note"]
    code, out = _json(capsys, argv + ["--gpu-mem-gb", "16"])
    assert code == 0 and out["cluster"]["gpu_mem_gb"] == 16 and out["cluster"]["memory_note"] == ""


def test_set_overrides_the_job_and_errors_name_the_override(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    base = ["plan", "--site", "site-configs/h100-ib.yaml", "--job", "examples/jobs/llama70b-h100.yaml"]
    code, out = _json(capsys, base + ["--set", "parallel.microbatches=16", "--set", "train.global_batch=1024",
                                      "--json"])
    assert code == 0 and out["job_layout"]["bubble"] == pytest.approx(1 / 33)  # (p-1)/(v*m+p-1), m=16
    assert main(base + ["--set", "parallel.tp=abc"]) == 2
    assert "--set parallel.tp=abc" in capsys.readouterr().err


def test_measured_throughput_becomes_mfu_and_hfu(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out = _json(capsys, ["plan", "--site", "site-configs/h100-ib.yaml", "--job",
                               "examples/jobs/llama70b-h100.yaml", "--tokens-per-s", "100000", "--json"])
    f = out["job_layout"]["mfu"]
    peak = 128 * 989e12
    assert f["recompute"] == "full"
    assert f["measured"]["mfu"] == pytest.approx(1e5 * f["model_flops_per_token"] / peak)
    assert f["measured"]["hfu"] == pytest.approx(f["measured"]["mfu"] * 4 / 3)
