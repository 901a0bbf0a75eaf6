"""The replay check's pure parts (dslurm/checkpoint/replay.py): what a save records about its
step, when a generation is suspect, the probe's verdict (bit-equal, or within the reshard
tolerance, never NaN), what `ckpt ls` shows; and the config value's checks."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import yaml

from dslurm import checkpoint as ck
from dslurm.checkpoint import replay
from dslurm.cli import main
from dslurm.config import load_job
from dslurm.config.resolve import load
from dslurm.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_last_step_records_non_finite_values_as_strict_json_and_marks_them_suspect():
    rec = replay.last_step(2.5, float("inf"))
    assert rec == {"loss": 2.5, "grad_norm": "inf"}
    json.dumps(rec, allow_nan=False)  # meta.json is strict JSON
    assert replay.suspect({"last_step": rec}).startswith("the saved step's grad_norm inf")
    assert "loss nan" in replay.suspect({"last_step": replay.last_step(float("nan"), 1.0)})
    assert replay.suspect({"last_step": replay.last_step(2.5, 0.3)}) == ""
    assert replay.suspect({}) == ""  # an older generation: nothing recorded, nothing suspect
    assert replay.last_step(None, None) == {"loss": None, "grad_norm": None}


def test_verdict_is_bit_equal_for_the_same_layout():
    saved = replay.probe_record(1.2345678)
    assert replay.verdict(saved, 1.2345678, same_layout=True) == ""
    off = replay.verdict(saved, math.nextafter(1.2345678, 2), same_layout=True)  # one ulp
    assert off.startswith("replay: probe loss") and "bit-equal expected" in off


def test_verdict_after_a_reshard_uses_the_documented_tolerance():
    saved = replay.probe_record(2.0)
    inside = 2.0 * (1 + replay.RESHARD_RTOL * 0.9)
    outside = 2.0 * (1 + replay.RESHARD_RTOL * 1.1)
    assert replay.verdict(saved, inside, same_layout=False) == ""
    assert "reshard tolerance" in replay.verdict(saved, outside, same_layout=False)
    assert replay.verdict(saved, inside, same_layout=True) != ""  # same layout: no tolerance at all


@pytest.mark.parametrize("now", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_probe_always_fails_even_with_nothing_recorded(now):
    for saved in (replay.probe_record(2.0), None, replay.probe_record(float("nan"))):
        for same in (True, False):
            assert "not finite" in replay.verdict(saved, now, same_layout=same)
    assert replay.verdict(None, 3.0, same_layout=True) == ""  # saved without replay: finite passes


def test_a_non_finite_saved_probe_never_matches_after_a_reshard():
    assert replay.verdict(replay.probe_record(float("nan")), 2.0, same_layout=False) != ""


def test_describe_for_ckpt_ls():
    meta = {"last_step": replay.last_step(2.34567, float("nan")), "replay": replay.probe_record(2.1)}
    assert replay.describe(meta) == "loss 2.346, grad norm nan, probe 2.1"
    assert replay.describe({}) == ""


def test_ckpt_ls_json_has_the_records_and_the_text_names_a_suspect_generation(tmp_path, capsys):
    gens = []
    for step, loss in ((100, 2.5), (200, float("nan"))):
        gen = ck.generations_dir(tmp_path) / ck.generation_name(step, token="abcdef")
        gen.mkdir(parents=True)
        meta = {"last_step": replay.last_step(loss, 0.5), "replay": replay.probe_record(2.25)}
        files = {".metadata": pickle.dumps("m" * 40, protocol=2), "__0_0.distcp": os.urandom(100),
                 ck.META: json.dumps(meta).encode()}
        for rel, data in files.items():
            (gen / rel).write_bytes(data)
        ck.write_manifest(gen, step, ck.checksum_files(gen, files))
        gens.append(gen)
    ck.write_pointer(tmp_path, gens[1].name, 200)
    assert main(["ckpt", "ls", str(tmp_path), "--json"]) == 0
    rows = {g["step"]: g for g in json.loads(capsys.readouterr().out)["generations"]}
    assert rows[100]["last_step"] == {"loss": 2.5, "grad_norm": 0.5} and rows[100]["suspect"] == ""
    assert rows[100]["replay"]["probe_loss"] == 2.25 and rows[100]["recorded"] == "loss 2.5, grad norm 0.5, probe 2.25"
    assert "loss nan" in rows[200]["suspect"]
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"ckpt ls: {gens[1].name}: suspect: the saved step's loss nan" in err
    assert gens[0].name not in err and len(out.splitlines()) == 3  # stdout: one row per generation


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_verify_resume_is_validated(tmp_path):
    p = _write(tmp_path, "job.yaml", {"name": "j", "nodes": 1, "checkpoint": {"verify_resume": "probe"}})
    with pytest.raises(UserError) as e:
        load_job(p)
    msg = str(e.value)
    assert str(p) in msg and "verify_resume" in msg and "'probe'" in msg and "replay" in msg
    ok = _write(tmp_path, "ok.yaml", {"name": "j", "nodes": 1, "checkpoint": {"verify_resume": "replay"}})
    assert load_job(ok).checkpoint.verify_resume == "replay"
    assert load_job(_write(tmp_path, "d.yaml", {"name": "j", "nodes": 1})).checkpoint.verify_resume == "fingerprint"


def test_replay_is_refused_with_pipeline_parallel(tmp_path):
    site = _write(tmp_path, "site.yaml", yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text()))
    job = _write(tmp_path, "job.yaml", {"name": "j", "nodes": 2, "checkpoint": {"verify_resume": "replay"},
                                        "parallel": {"pp": 2, "dp_shard": -1, "microbatches": 2}})
    with pytest.raises(UserError) as e:
        load(site, job)
    assert "checkpoint.verify_resume" in str(e.value) and "pp=2" in str(e.value) and str(job) in str(e.value)


def test_the_cli_exits_2_on_a_bad_value(tmp_path, capsys):
    p = _write(tmp_path, "job.yaml", {"name": "j", "nodes": 1, "checkpoint": {"verify_resume": "yes"}})
    site = _write(tmp_path, "site.yaml", yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text()))
    assert main(["render", "--site", str(site), "--job", str(p)]) == 2
    assert "verify_resume" in capsys.readouterr().err


def test_bad_probe_refuses_a_commit_only_when_the_probe_is_not_finite():
    assert replay.bad_probe({}) == "" and replay.bad_probe({"replay": replay.probe_record(2.0)}) == ""
    assert "probe loss is nan" in replay.bad_probe({"replay": replay.probe_record(float("nan"))})


def test_a_save_whose_probe_is_not_finite_is_not_committed(tmp_path):
    """Nothing bad becomes durable: finite tensors that compute NaN would be refused by every restore."""
    import torch

    from dslurm.checkpoint.dcp import CheckpointManager
    lin = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, verify_resume="replay") as mgr:
        assert mgr.save(1, {"m": lin}, {}, probe=1.5)
        assert not mgr.save(2, {"m": lin}, {}, probe=float("nan"))
        assert "probe loss is nan" in mgr.last_outcome.reason
    assert ck.read_pointer(tmp_path).step == 1
    meta = json.loads((ck.generations_dir(tmp_path) / ck.read_pointer(tmp_path).generation / ck.META).read_text())
    assert meta["replay"] == {"probe_loss": 1.5, "batch": "next"}
