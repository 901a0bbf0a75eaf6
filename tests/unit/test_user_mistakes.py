"""Mistakes a new user makes, through the real CLI entry: each one is exit 2 with the file or flag,
the field, the value and the fix, never a traceback (issue 54)."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess

import pytest

from dslurm.cli import build_parser, main
from testkit import ROOT, chat_tokenizer, one_start_ended

SITE, JOB = str(ROOT / "site-configs/local.yaml"), str(ROOT / "examples/jobs/tiny-2node.yaml")


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run `dslurm ARGV`: it must exit 2 (an exception would fail the test: no traceback) and
    its stderr must hold every needle."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize(("flag", "name", "why"), [
    ("--set", "SLURM_JOB_ID", "requeue another job"), ("--set", "DSLURM_RUN_DIR", "dslurm's"),
    ("--site-set", "SLURM_NODELIST", "Slurm sets"), ("--set", "MASTER_PORT", "the launcher sets it"),
    ("--set", "RANK", "the launcher sets it"), ("--set", "TORCHELASTIC_RUN_ID", "torchrun's"),
])
def test_reserved_environment_variables_are_refused_naming_them(capsys, flag, name, why):
    refused(capsys, ["render", "--site", SITE, "--job", JOB, flag, f"env.{name}=1"],
            f"{flag} env.{name}=1", f"env.{name}", why, "Fix: remove")


def test_dslurm_inputs_pass_and_path_and_devices_are_warned(capsys):
    assert main(["render", "--site", SITE, "--job", JOB, "--set", "env.DSLURM_FAULT_CRASH=3@0",
                 "--set", "env.PATH=/opt/x", "--set", "env.CUDA_VISIBLE_DEVICES=0"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "field 'env': PATH" in err and "field 'env': CUDA_VISIBLE_DEVICES" in err
    assert main(["render", "--site", SITE, "--job", JOB]) == 0
    assert "warning" not in capsys.readouterr().err


def _parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_accepts_abbreviations(capsys):
    every = list(_parsers(build_parser([])))
    assert len(every) > 30 and all(not p.allow_abbrev for p in every), \
        [p.prog for p in every if p.allow_abbrev]
    refused(capsys, ["render", "--sit", SITE, "--jo", JOB], "unrecognized arguments: --sit")


# ---------------------------------------------------------------- config files and render -o


def test_a_config_that_is_not_utf8_or_not_text_names_the_line_and_the_fix(capsys, tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes((ROOT / "examples/jobs/tiny-2node.yaml").read_bytes() + "# café\n".encode("latin-1"))
    lines = latin.read_bytes().count(b"\n")
    refused(capsys, ["render", "--site", SITE, "--job", str(latin)],
            f"{latin}: not UTF-8 text: byte 0xe9 at line {lines}", "Fix: save the file as UTF-8")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\xd0\xff" * 20)
    refused(capsys, ["render", "--site", str(binary), "--job", JOB], f"{binary}: not a text file", "Fix:")


def test_render_output_must_be_a_file_in_a_directory_that_exists(capsys, tmp_path):
    refused(capsys, ["render", "--site", SITE, "--job", JOB, "-o", str(tmp_path)],
            f"-o {tmp_path}: is a directory", "Fix: name the file")
    missing = tmp_path / "no" / "such" / "x.sbatch"
    refused(capsys, ["render", "--site", SITE, "--job", JOB, "-o", str(missing)],
            f"the directory {missing.parent} does not exist", "mkdir -p")
    assert not (tmp_path / "no").exists()  # nothing created on the way


# ---------------------------------------------------------------- data


def test_data_synth_into_a_folder_is_refused_and_files_follow_the_umask(capsys, tmp_path):
    refused(capsys, ["data", "synth", str(tmp_path), "--tokens", "100", "--vocab", "50"],
            f"OUT {tmp_path}: is a folder", "Fix:")
    old = os.umask(0o022)
    try:
        assert main(["data", "synth", str(tmp_path / "s.h5"), "--tokens", "100", "--vocab", "50"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s.h5").stat().st_mode) == 0o644  # teammates can read a shared dataset


@pytest.fixture
def tok(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    chat_tokenizer(d)
    return d


def test_tokenize_refuses_a_file_as_out_an_empty_corpus_and_shards_out_of_range(capsys, tmp_path, tok):
    existing = tmp_path / "existing"
    existing.write_text("x")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "the cat sat"}\n{"text": "the dog ran"}\n')
    refused(capsys, ["data", "tokenize", "--tokenizer", str(tok), str(corpus), "--out", str(existing)],
            f"--out {existing}: is a file, not a folder", "Fix:")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    refused(capsys, ["data", "tokenize", "--tokenizer", str(tok), str(empty), "--out", str(tmp_path / "e")],
            "the inputs hold no documents (0 tokens", "no manifest was written", "Fix:")
    assert not (tmp_path / "e" / "manifest.json").exists()
    refused(capsys, ["data", "tokenize", "--tokenizer", str(tok), str(corpus), "--out", str(tmp_path / "s"),
                     "--shards", "50"], "--shards 50: must be in 1..2")
    refused(capsys, ["data", "tokenize", "--tokenizer", str(tok), str(corpus), "--out", str(tmp_path / "s"),
                     "--shards", "0"], "--shards 0: must be at least 1")


def test_tokenize_with_eos_does_not_warn_and_its_shards_follow_the_umask(capsys, caplog, tmp_path, tok):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "the cat sat"}\n{"text": "the dog ran"}\n')
    old = os.umask(0o022)
    try:
        assert main(["data", "tokenize", "--tokenizer", str(tok), str(corpus), "--out", str(tmp_path / "o"),
                     "--eos", "</s>", "--shards", "2"]) == 0
    finally:
        os.umask(old)
    assert "adds no BOS/EOS" not in caplog.text + capsys.readouterr().err
    shards = sorted((tmp_path / "o").glob("shard-*.h5"))
    assert len(shards) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in shards)


# ---------------------------------------------------------------- doctor and report


def test_a_ledger_time_of_1e300_is_skipped_by_doctor_and_report(capsys, tmp_path):
    one_start_ended(tmp_path, "completed", 10)
    led = tmp_path / "ledger.jsonl"
    lines = led.read_text().splitlines()
    rec = json.loads(lines[2])
    rec["t"] = 1e300
    led.write_text("\n".join([*lines[:2], json.dumps(rec), *lines[3:]]) + "\n")
    assert main(["doctor", str(tmp_path)]) == 0
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    wall = re.search(r"/ wall (\S+)", out)
    assert wall is not None and len(wall.group(1)) < 12, out  # no 200-digit wall time


def test_report_png_must_be_a_png_file_name_not_a_directory(capsys, tmp_path, monkeypatch):
    one_start_ended(tmp_path, "completed", 10)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pics").mkdir()
    refused(capsys, ["report", str(tmp_path), "--png", "pics"], "--png pics: is a directory", "Fix:")
    refused(capsys, ["report", str(tmp_path), "--png", "timeline"], "not a .png file name", "--png timeline.png")
    assert not list(tmp_path.glob("*.png")) and not list((tmp_path / "pics").iterdir())


def test_a_rendered_script_says_it_reads_the_live_files_and_render_o_creates_its_logs_dir(capsys, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["render", "--site", SITE, "--job", JOB, "-o", "job.sbatch"]) == 0
    text = (tmp_path / "job.sbatch").read_text()
    head = "\n".join(text.splitlines()[:6])
    assert f"reads {SITE} and {JOB} as they are then" in head and "frozen into the run directory" in head
    assert "#SBATCH --output=logs/%x-%j.out" in text and (tmp_path / "logs").is_dir()
    assert f"sbatch it from {tmp_path}" in capsys.readouterr().err


# ---------------------------------------------------------------- loose checks: requeue, storage, ~


@pytest.mark.parametrize(("flag", "field", "needle"), [
    ("--set", "requeue.signal_lead=-5", "-5 seconds gives the job no warning"),
    ("--set", "requeue.signal_lead=0", "0 seconds gives the job no warning"),
    ("--site-set", "requeue.signal_lead_s=-5", "-5 seconds gives jobs no warning"),  # was raised to 60 silently
    ("--set", "requeue.max_restarts=-1", "-1 must not be negative"),
    ("--site-set", "requeue.max_restarts=-1", "-1 must not be negative"),
    ("--site-set", "storage.durable=", "is empty"),
])
def test_requeue_and_storage_values_that_mean_nothing_are_refused(capsys, flag, field, needle):
    refused(capsys, ["render", "--site", SITE, "--job", JOB, flag, field], f"{flag} {field}", needle, "Fix:")


def test_a_lead_that_takes_most_of_the_job_is_warned(capsys):
    assert main(["render", "--site", SITE, "--job", JOB, "--set", "time=00:06:00",
                 "--set", "requeue.signal_lead=300"]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "300s before the 360s limit" in err and "at most 60s" in err


def test_home_in_the_run_dir_expands_on_the_node_not_where_render_runs(capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/on-the-laptop")
    monkeypatch.setenv("USER", "me")
    assert main(["render", "--site", SITE, "--job", JOB, "--set", "checkpoint.run_dir=~/runs/${USER}/a b"]) == 0
    out = capsys.readouterr().out
    assert "/home/on-the-laptop" not in out
    line = """export DSLURM_RUN_DIR="$HOME"'/runs/me/a b'"""
    assert line in out
    got = subprocess.run(["bash", "-c", f'{line}; echo "$DSLURM_RUN_DIR"'],
                         env={"HOME": "/cluster/me", "USER": "me"}, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "/cluster/me/runs/me/a b"


# ---------------------------------------------------------------- plan


def test_plan_refuses_a_zero_peak_and_a_negative_or_unusable_throughput(capsys):
    refused(capsys, ["plan", "--model", "8b", "--peak-tflops", "0"], "--peak-tflops 0: must be greater than 0", "Fix:")
    refused(capsys, ["plan", "--model", "8b", "--tokens-per-s", "-5"], "--tokens-per-s -5: must be greater than 0")
    refused(capsys, ["plan", "--model", "8b", "--tokens-per-s", "5000"], "needs the GPUs' peak", "--peak-tflops")
    assert main(["plan", "--model", "8b"]) == 0
    out = capsys.readouterr().out
    assert "the site gives" not in out and "no peak TFLOP/s given" in out  # no site was given


def test_no_layout_fits_advice_lowers_memory_not_raises_the_batch(capsys):
    err = refused(capsys, ["plan", "--model", "70b", "--nodes", "1", "--gpu-mem-gb", "20"], "no layout fits",
                  "Fix: more nodes or GPUs with more memory")
    assert "global_batch" not in err.split("Fix:")[1]
