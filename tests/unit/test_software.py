"""The software of every start (dslurm/observe/software.py, issue 53): what changed between starts
as report and doctor say it, the packages file a start compares against, and the site's refusal of
named NCCL versions (site.refuse.nccl)."""

from __future__ import annotations

import json

import pytest

from dslurm.config.schema import FieldError
from dslurm.config.site import RefuseSpec
from dslurm.observe import events as ev
from dslurm.observe import software
from dslurm.observe.doctor import diagnose
from dslurm.observe.report import summarize


def env(**kw) -> ev.StartEnv:
    base = dict(t=1.0e9, torch="2.13.0", cuda="12.8", nccl="2.27.3", driver="570.1", gpu="NVIDIA H100",
                image="nvcr.io#nvidia/pytorch:25.01-py3", code_sha="a" * 40, code_dirty=False,
                nodes=["n1", "n2"], env={"NCCL_ALGO": "Ring"})
    return ev.StartEnv(**{**base, **kw})


def test_changes_between_starts_are_named_with_the_step_they_show_at():
    evs = [env(), ev.TrainStart(t=1.0e9, step=0),
           env(step=1200, nccl="2.28.5", nodes=["n1", "n4"], env={}, code_sha="b" * 40, code_dirty=True,
               packages_changed={"numpy": ["1.26.4", "2.1.0"]}), ev.TrainStart(t=1.0e9 + 5, step=1200)]
    lines = software.change_lines(evs)
    assert lines[0].startswith("software (last start): torch 2.13.0, CUDA 12.8, NCCL 2.28.5"), lines
    (changed,) = lines[1:]
    assert changed.startswith("software changed at start 2 of 2 (from step 1200): nccl 2.27.3 -> 2.28.5"), changed
    for part in ("code aaaaaaaaaaaa -> bbbbbbbbbbbb (dirty)", "packages: numpy 1.26.4 -> 2.1.0", "nodes -n2 +n4",
                 "NCCL_ALGO Ring -> unset"):
        assert part in changed, (part, changed)
    assert software.change_lines([env(), env(step=10)])[1:] == []  # same software: nothing to say
    assert changed in summarize(evs).software
    (finding,) = [f for f in diagnose(evs) if f.symptom == "software changed between starts"]
    assert finding.evidence == [changed] and "site.refuse.nccl" in finding.action


def test_packages_file_names_what_changed_since_the_previous_start(tmp_path):
    count, changed = software.packages_since_last(tmp_path)
    assert count > 10 and changed == {}  # a run's first start
    now = json.loads((tmp_path / "packages.json").read_text())
    assert "pytest" in now
    now["pytest"] = "0.0.1"
    del now["tensorboard"]
    now["gone-package"] = "1.0"
    (tmp_path / "packages.json").write_text(json.dumps(now))
    _, changed = software.packages_since_last(tmp_path)
    assert set(changed) == {"pytest", "tensorboard", "gone-package"}, changed
    assert changed["gone-package"] == ["1.0", None] and changed["tensorboard"][0] is None


def test_pure_helpers():
    assert software.env_vars({"NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HOME": "/x"}) == {
        "NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert software.image_digest("nvcr.io#nvidia/pytorch@sha256:abc") == "sha256:abc"
    assert software.image_digest("/images/x.sif") is None
    assert software.package_changes({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "1"}) == {
        "b": ["2", "3"], "c": [None, "1"]}


def test_site_refuses_named_nccl_versions_and_ranges():
    r = RefuseSpec(nccl=["2.28.3-2.28.8", "2.27.0"])
    assert r.refused_nccl("2.28.3") == r.refused_nccl("2.28.8") == r.refused_nccl("2.28.5") == "2.28.3-2.28.8"
    assert r.refused_nccl("2.27.0") == "2.27.0"
    assert r.refused_nccl("2.28.9") is r.refused_nccl("2.27.1") is r.refused_nccl(None) is None  # None: no GPU
    for bad, why in (("2.28.x", "not a version"), ("2.28.8-2.28.3", "ends before it begins")):
        with pytest.raises(FieldError, match=why):
            RefuseSpec(nccl=[bad])


def test_a_start_on_a_refused_nccl_exits_2_naming_it(monkeypatch):
    """The trainer's check (train/software.py) before any process-group work; NCCL is mocked (no GPU here)."""
    from types import SimpleNamespace

    from dslurm.errors import UserError
    from train import software as train_software

    resolved = SimpleNamespace(site=SimpleNamespace(refuse=RefuseSpec(nccl=["2.28.3-2.28.8"])), site_path="site.yaml")
    monkeypatch.setattr(train_software, "nccl_version", lambda: "2.28.4")
    with pytest.raises(UserError) as exc:
        train_software.refuse(resolved)  # type: ignore[arg-type]
    assert exc.value.exit_code == 2
    assert "site.yaml: refuse.nccl: this start runs NCCL 2.28.4" in str(exc.value)
    assert "'2.28.3-2.28.8'" in str(exc.value)
    monkeypatch.setattr(train_software, "nccl_version", lambda: "2.28.9")
    train_software.refuse(resolved)  # type: ignore[arg-type]
