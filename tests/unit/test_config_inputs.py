"""Inputs read as the user meant them: YAML 1.2 scalars (times stay text, `3e-4` is a number),
duplicate keys refused with both lines, errors that name the override the user typed, and a
site `python` with arguments. Real PyYAML, real files, the real renderer."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from dslurm.cli.render import render_files
from dslurm.config import load_job, load_site, yaml12
from dslurm.config.resolve import load
from dslurm.errors import UserError
from testkit import sbatch_flags

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "site-configs" / "local.yaml")


def job_file(tmp_path: Path, body: str, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body).lstrip() if body.startswith("\n") else body)
    return p


TINY = textwrap.dedent("""
    name: t
    nodes: 2
    model:
      preset: tiny
    parallel:
      tp: 2
    """).lstrip()


# ------------------------------------------------------------------ YAML 1.2 scalars


def test_unquoted_time_renders_as_written(tmp_path):
    p = job_file(tmp_path, TINY + "time: 12:00:00\n")
    assert load_job(p).time == "12:00:00"  # YAML 1.1 read base-60 43200 -> --time=30-00:00:00
    assert sbatch_flags(render_files(LOCAL, str(p)))["time"] == "12:00:00"


@pytest.mark.parametrize("value,flag", [("25:00:00", "1-01:00:00"), ("1:30", "00:02:00"), ("90", "01:30:00"),
                                        ("2-00:00:00", "2-00:00:00")])
def test_time_override_is_a_slurm_time_not_base_60(tmp_path, value, flag):
    p = job_file(tmp_path, TINY)
    assert sbatch_flags(render_files(LOCAL, str(p), [f"time={value}"]))["time"] == flag


def test_site_fields_follow_the_same_rules(tmp_path):
    site = (ROOT / "site-configs" / "local.yaml").read_text().replace('default_time: "00:10:00"',
                                                                      "default_time: 12:00:00")
    assert "default_time: 12:00:00" in site
    sp = tmp_path / "site.yaml"
    sp.write_text(site)
    p = job_file(tmp_path, TINY)
    assert load_site(sp).slurm.default_time == "12:00:00"
    assert sbatch_flags(render_files(str(sp), str(p)))["time"] == "12:00:00"
    text = render_files(str(sp), str(p), site_overrides=["slurm.default_time=25:00:00", "burnin.max_temp_c=9e1"])
    assert sbatch_flags(text)["time"] == "1-01:00:00"
    assert load_site(sp, ["burnin.max_temp_c=9e1"]).burnin.max_temp_c == 90


def test_float_exponents_are_numbers(tmp_path):
    p = job_file(tmp_path, TINY + "train:\n  lr: 3e-4\n  weight_decay: 1E-2\n  steps: 1e3\n")
    job = load_job(p)
    assert job.train.lr == 0.0003 and job.train.weight_decay == 0.01
    assert job.train.steps == 1000 and isinstance(job.train.steps, int)
    assert load_job(p, ["train.steps=2e3", "train.lr=1e-3"]).train.steps == 2000


@pytest.mark.parametrize("value,expect", [
    ("1.5e0", "got 1.5, which is not a whole number. Fix: write a whole number, e.g. 1 or 2"),
    ("2.5", "not a whole number"),
    (".inf", "expected an integer, got inf"),
    ("1e30", "too large to hold exactly"),
])
def test_an_inexact_integer_is_refused_clearly(tmp_path, value, expect):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError) as e:
        load_job(p, [f"train.steps={value}"])
    assert f"--set train.steps={value}: field 'train.steps': expected an integer" in str(e.value)
    assert expect in str(e.value)


def test_non_finite_float_is_refused(tmp_path):
    p = job_file(tmp_path, TINY + "train:\n  lr: .nan\n")
    with pytest.raises(UserError, match=r"field 'train.lr': expected a finite number, got nan"):
        load_job(p)


def test_yaml11_booleans_are_text_with_a_hint(tmp_path):
    p = job_file(tmp_path, TINY + "preflight:\n  enabled: no\n")
    with pytest.raises(UserError, match=r"field 'preflight.enabled': expected true or false, got 'no' "
                                        r"\(YAML 1.2 reads yes/no/on/off as text\)\. Fix: write true or false"):
        load_job(p)
    assert load_job(p, ["preflight.enabled=false"]).preflight.enabled is False


def test_other_yaml11_surprises_stay_as_written():
    data = yaml12.load("a: 017\nb: 0o17\nc: 0x1f\nd: 2024-01-01\ne: 1_000\nf: +12\ng: ~\nh: 1:30\n")
    assert data == {"a": 17, "b": 15, "c": 31, "d": "2024-01-01", "e": "1_000", "f": 12, "g": None, "h": "1:30"}


@pytest.mark.parametrize("text", ["1e3", "12:00:00", "yes", "off", "017", "0o17", "1_000", "2024-01-01", ".inf",
                                  "null", "3e-4", "plain", "1:30"])
def test_frozen_configs_read_back_unchanged_by_both_readers(text):
    dumped = yaml12.dump({"v": text, "lr": 3e-4, "n": 1000, "flag": True})
    expected = {"v": text, "lr": 3e-4, "n": 1000, "flag": True}
    assert yaml12.load(dumped) == expected and yaml.safe_load(dumped) == expected


def test_submit_freezes_strings_the_loader_would_retype(tmp_path):
    from dslurm.submission import freeze_and_render

    p = job_file(tmp_path, TINY + f"time: 12:00:00\nenv:\n  K: '1e3'\n  B: 'yes'\ncheckpoint:\n"
                                  f"  run_dir: {tmp_path / 'run'}\n")
    r = load(LOCAL, p, base_dir=tmp_path)
    freeze_and_render(r)
    again = load_job(tmp_path / "run" / "job.yaml")
    assert again.env == {"K": "1e3", "B": "yes"} and again.time == "12:00:00"


# ------------------------------------------------------------------ duplicate keys


def test_duplicate_key_is_refused_with_both_lines(tmp_path):
    p = job_file(tmp_path, """
        name: t
        nodes: 2
        model:
          preset: tiny
        train:
          steps: 10
        model:
          preset: small
        """)
    with pytest.raises(UserError) as e:
        load_job(p)
    assert str(e.value).startswith(f"{p}: key 'model' appears twice (lines 3 and 7)")
    assert "Fix:" in str(e.value)


def test_nested_and_site_duplicates_are_refused_too(tmp_path):
    p = job_file(tmp_path, TINY + "train:\n  lr: 1e-3\n  steps: 5\n  lr: 2e-3\n")
    with pytest.raises(UserError, match=r"key 'lr' appears twice \(lines 8 and 10\)"):
        load_job(p)
    site = tmp_path / "site.yaml"
    text = (ROOT / "site-configs" / "local.yaml").read_text()
    first, second = text.splitlines().index("python: python") + 1, len(text.splitlines()) + 1
    site.write_text(text + "python: python3\n")
    with pytest.raises(UserError, match=rf"{site}: key 'python' appears twice \(lines {first} and {second}\)"):
        load_site(site)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    p = job_file(tmp_path, TINY + "x_base: &b {steps: 5}\n")
    data = yaml12.load(p.read_text() + "m:\n  <<: *b\n  lr: 1\n")
    assert data["m"] == {"steps": 5, "lr": 1}


def test_duplicate_key_in_an_override_names_the_override(tmp_path):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError, match=r"^--set model=\{preset: tiny, preset: small\}: key 'preset' appears twice"):
        load_job(p, ["model={preset: tiny, preset: small}"])


# ------------------------------------------------------------------ errors name what the user typed


def test_override_error_names_the_override_not_the_file(tmp_path):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError) as e:
        load_job(p, ["train.steps=5", "parallel.tp=abc"])
    msg = str(e.value)
    assert msg.startswith("--set parallel.tp=abc: field 'parallel.tp': expected an integer, got 'abc'. Fix:")
    assert str(p) not in msg


def test_file_error_still_names_the_file(tmp_path):
    p = job_file(tmp_path, TINY.replace("tp: 2", "tp: abc"))
    with pytest.raises(UserError, match=rf"^{p}: field 'parallel.tp': expected an integer"):
        load_job(p, ["train.steps=5"])


@pytest.mark.parametrize("overrides,start", [
    (["parallel={tp: abc}"], "--set parallel={tp: abc}: field 'parallel.tp'"),
    (["parallel={tp: abc}", "parallel.tp=x"], "--set parallel.tp=x: field 'parallel.tp'"),  # the later wins
    (["parallel.tp=x", "parallel={tp: y}"], "--set parallel={tp: y}: field 'parallel.tp'"),
    (["parallel.tpp=2"], "--set parallel.tpp=2: field 'parallel': unknown key(s) 'tpp'"),
    (["parallel.tp=0"], "--set parallel.tp=0: field 'parallel.tp': 0 must be at least 1. Fix: set parallel.tp"),
    (["nodes=0"], "--set nodes=0: field 'nodes': nodes=0 must be at least 1. Fix: set nodes: 1 or more"),
    (["train.lr=-1"], "--set train.lr=-1: field 'train.lr': -1.0 must be above 0. Fix:"),
])
def test_each_override_error_starts_with_the_override(tmp_path, overrides, start):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError) as e:
        load_job(p, overrides)
    assert str(e.value).startswith(start), str(e.value)


def test_site_override_error_names_the_site_override(tmp_path):
    with pytest.raises(UserError, match=r"^--site-set node.gpus=x: field 'node.gpus': expected an integer"):
        load_site(LOCAL, ["node.gpus=x"])
    with pytest.raises(UserError, match=r"^--site-set slurm.default_time=soon: field 'slurm.default_time': "
                                        r"'soon' is not a Slurm time"):
        load_site(LOCAL, ["slurm.default_time=soon"])


def test_class_checks_name_their_fields_never_top_level(tmp_path):
    p = job_file(tmp_path, "name: t\nnodes: 0\n")
    with pytest.raises(UserError) as e:
        load_job(p)
    assert "top level" not in str(e.value) and "see the value named above" not in str(e.value)
    assert str(e.value).startswith(f"{p}: field 'nodes': ")
    site = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    del site["node"]["procs_per_node"]
    with pytest.raises(UserError) as e:
        load_site(data=site)
    assert str(e.value).startswith("site: fields 'node.gpus', 'node.procs_per_node': ")
    assert "Fix: add node.procs_per_node: N" in str(e.value)


def test_model_shape_error_names_the_override_and_a_real_fix(tmp_path):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError) as e:
        load_job(p, ["model.dim=90"])
    msg = str(e.value)
    assert msg.startswith(f"{p} with --set model.dim=90: field 'model': dim(90) is not divisible by n_heads(4)")
    assert "change the overrides" not in msg and "Fix: choose model fields" in msg


def test_cross_field_error_names_the_field_and_the_overrides(tmp_path):
    p = job_file(tmp_path, TINY)
    with pytest.raises(UserError) as e:
        load(LOCAL, p, overrides=["parallel.tp=3"])
    msg = str(e.value)
    assert "field 'parallel'" in msg and "Fix:" in msg and msg.endswith("(overrides in effect: --set parallel.tp=3)")


def test_pipeline_error_has_a_fix(tmp_path):
    p = job_file(tmp_path, TINY.replace("tp: 2", "tp: 1\n  pp: 4"))
    with pytest.raises(UserError, match=r"field 'parallel': microbatches\(1\) < pipeline stages\(4\).*\. Fix: "):
        load(LOCAL, p)


def test_time_from_the_site_default_is_blamed_on_the_site(tmp_path):
    from dslurm.config.resolve import resolve

    site = load_site(LOCAL)
    site.slurm.default_time = "soon"  # past the loader's own check, as a notebook could do
    with pytest.raises(UserError, match=r"^site.yaml: field 'slurm.default_time': 'soon'"):
        resolve(site, load_job(job_file(tmp_path, TINY)), site_path="site.yaml")


# ------------------------------------------------------------------ the site's python


def test_python_with_arguments_is_split_and_each_word_quoted(tmp_path):
    p = job_file(tmp_path, TINY)
    text = render_files(LOCAL, str(p), site_overrides=["python=python3 -X dev"])
    assert "dslurm-launch python3 -X dev -m dslurm launch --mode torchrun" in text
    assert "-- python3 -X dev -m train --site" in text
    assert "\npython3 -X dev -m dslurm requeue-me" in text
    text = render_files(LOCAL, str(p), site_overrides=["python='/opt/my env/bin/python3' -u"])
    assert "'/opt/my env/bin/python3' -u -m dslurm launch" in text


@pytest.mark.parametrize("value,expect", [("python3 '-X dev", "is not a command line"), ("''", "names no interpreter")])
def test_python_that_is_not_a_command_line_is_refused(value, expect):
    with pytest.raises(UserError, match=rf"^--site-set python=.*: field 'python': .*{expect}.*Fix: "):
        load_site(LOCAL, [f"python={value}"])


def test_local_runner_keeps_its_own_interpreter(tmp_path):
    import sys

    from dslurm.api.job import trainer_argv

    r = load(LOCAL, job_file(tmp_path, TINY), site_overrides=["python=python3 -X dev"])
    assert trainer_argv(r, "s.yaml", "j.yaml")[:3] == [sys.executable, "-m", "train"]


def test_numbers_where_text_is_wanted_keep_their_spelling(tmp_path):
    p = job_file(tmp_path, TINY + "time: 90\nenv:\n  A: 1e3\n  B: 007\n  C: 0x1f\n  D: 1.10\n  E: 3\n")
    job = load_job(p)
    assert job.env == {"A": "1e3", "B": "007", "C": "0x1f", "D": "1.10", "E": "3"} and job.time == "90"
    assert load_job(p, ["env.A=2e3"]).env["A"] == "2e3"
    assert type(load_job(p, ["train.steps=0x10"]).train.steps) is int  # a plain int, not the loader's
