"""`dslurm ckpt ls|verify|gc` on fake generations (no torch needed to inspect a run)."""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from dslurm import checkpoint as ck
from dslurm.cli import main

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def make_gen(run: Path, step: int, commit: bool = True) -> Path:
    gen = ck.generations_dir(run) / ck.generation_name(step, T0 + dt.timedelta(minutes=step), "abcdef")
    gen.mkdir(parents=True)
    files = {".metadata": pickle.dumps("m" * 40, protocol=2),  # 50 bytes, a plain pickle
             "__0_0.distcp": os.urandom(5000), ck.META: b"{}"}
    for rel, data in files.items():
        (gen / rel).write_bytes(data)
    if commit:
        ck.write_manifest(gen, step, ck.checksum_files(gen, files))
    return gen


@pytest.fixture
def run3(tmp_path: Path) -> tuple[Path, list[Path]]:
    gens = [make_gen(tmp_path, s) for s in (100, 200, 300)]
    ck.write_pointer(tmp_path, gens[2].name, 300)
    return tmp_path, gens


def test_verify_sound_pointer_target_exits_0(run3, capsys):
    run, gens = run3
    assert main(["ckpt", "verify", str(run)]) == 0
    assert f"OK {gens[2].name}" in capsys.readouterr().out


def test_verify_altered_shard_exits_1_naming_the_file(run3, capsys):
    run, gens = run3
    shard = gens[2] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert str(shard) in out and "crc32" in out
    assert main(["ckpt", "verify", str(run), "--generation", gens[1].name]) == 0


def test_verify_truncated_shard_of_named_generation_exits_1(run3, capsys):
    run, gens = run3
    shard = gens[0] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    assert main(["ckpt", "verify", str(run), "-g", "step-00000100"]) == 1
    assert f"{shard}: size 10 != 5000" in capsys.readouterr().out


def test_verify_garbage_or_missing_pointer_exits_1(tmp_path, capsys):
    make_gen(tmp_path, 1)
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "LATEST: missing" in capsys.readouterr().err
    (tmp_path / ck.POINTER).write_text("xx")
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    assert "garbage pointer" in capsys.readouterr().err


def test_verify_unknown_generation_or_run_dir_is_a_user_error(run3, tmp_path, capsys):
    run, _ = run3
    assert main(["ckpt", "verify", str(run), "-g", "step-9"]) == 2
    assert "no such generation" in capsys.readouterr().err
    assert main(["ckpt", "ls", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_ls_shows_steps_status_and_pointer(run3, capsys):
    run, gens = run3
    partial = make_gen(run, 400, commit=False)
    (gens[0] / "__0_0.distcp").write_bytes(b"x")
    assert main(["ckpt", "ls", str(run)]) == 0
    out, err = capsys.readouterr()
    rows = {ln.split()[-1]: ln.split() for ln in out.splitlines()[1:]}
    assert rows[gens[2].name][:4] == ["300", "5.4KB", "sizes", "LATEST"]  # shards + manifest
    assert rows[gens[0].name][2] == "BAD" and rows[partial.name][2:4] == ["partial", "-"]
    assert rows[gens[1].name][3] == "-"
    assert f"ckpt ls: {gens[0].name}: BAD: " in err and "size 1 != 5000" in err  # problems apart, whole


def test_ls_fits_80_columns_and_splits_on_whitespace_when_piped(cli, run3):
    run, gens = run3
    make_gen(run, 12345678)  # the widest step a generation name holds
    res = cli("ckpt", "ls", str(run), env={"COLUMNS": "80"})  # a pipe: no terminal
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and "…" not in res.stdout and "\x1b" not in res.stdout
    assert max(len(ln) for ln in lines) <= 80
    assert lines[0].split() == ["STEP", "SIZE", "CHECK", "POINTER", "GENERATION"]
    assert [ln.split()[0] for ln in lines[1:]] == ["100", "200", "300", "12345678"]
    assert all(len(ln.split()) == 5 for ln in lines)
    assert [ln.split()[4] for ln in lines[1:4]] == [g.name for g in gens]


def test_ls_json(run3, capsys):
    import json

    run, gens = run3
    (gens[1] / ck.REJECTED).write_text("{}")  # a restore refused it
    gone = make_gen(run, 999)
    ck.write_pointer(run, gone.name, 999)
    shutil.rmtree(gone)  # the pointer names a generation that is gone
    assert main(["ckpt", "ls", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pointer"] == {"generation": gone.name, "step": 999}
    by_name = {g["generation"]: g for g in out["generations"]}
    first = by_name[gens[0].name]
    assert first["step"] == 100 and first["bytes"] > 5000 and first["saved_utc"] == "2026-01-02T04:44:05Z"
    assert first["check"] == "sizes" and first["pointer"] is False
    assert by_name[gens[1].name]["check"] == "rejected"
    row = by_name[gone.name]
    assert row["check"] == "missing" and row["pointer"] is True and row["bytes"] is None


def test_ls_with_a_garbage_pointer_still_lists(run3, capsys):
    run, _ = run3
    (run / ck.POINTER).write_text("xx")
    assert main(["ckpt", "ls", str(run)]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 4 and "LATEST" not in out and "garbage pointer" in err


def test_gc_keeps_last_k_and_removes_orphans(run3, capsys):
    run, gens = run3
    orphan = make_gen(run, 250, commit=False)
    assert main(["ckpt", "gc", str(run), "--dry-run"]) == 0
    assert len(ck.list_generations(run)) == 4
    assert main(["ckpt", "gc", str(run)]) == 0
    assert [g.name for g in ck.list_generations(run)] == [gens[1].name, gens[2].name]
    assert orphan.name in capsys.readouterr().out


def test_gc_refuses_while_a_job_holds_the_run(run3, monkeypatch, capsys):
    run, _ = run3
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = ck.RunDirLock(run)
    lock.acquire()
    try:
        monkeypatch.delenv("SLURM_JOB_ID")
        assert main(["ckpt", "gc", str(run)]) == 79  # exitcodes.REFUSED: another job holds the run
        assert "Slurm job 4242" in capsys.readouterr().err
        assert len(ck.list_generations(run)) == 3
    finally:
        lock.release()


def test_gc_refuses_keep_below_two(run3, capsys):
    run, _ = run3
    assert main(["ckpt", "gc", str(run), "--keep", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_cli_process_exit_code_and_no_torch_import(run3, cli):
    run, gens = run3
    (gens[2] / ".metadata").unlink()
    res = cli("ckpt", "verify", str(run))
    assert res.returncode == 1 and ".metadata: missing" in res.stdout
    res = cli("-v", "ckpt", "ls", str(run), env={"PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0
    import subprocess
    import sys
    probe = subprocess.run([sys.executable, "-c", "import sys, dslurm.cli as c; c.build_parser(); "
                            "import dslurm.checkpoint.cli; print('torch' in sys.modules)"],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert probe.stdout.strip() == "False"


@pytest.mark.parametrize("entry", ["oops", {"crc32": "00000000"}, {"size": 50}, {"size": "50", "crc32": "0"}])
def test_a_manifest_entry_that_is_not_an_object_with_size_and_crc32_is_bad_not_a_crash(run3, capsys, entry):
    run, gens = run3
    doc = json.loads((gens[2] / ck.MANIFEST).read_text())
    doc["files"][".metadata"] = entry
    (gens[2] / ck.MANIFEST).write_text(json.dumps(doc))
    ck.write_pointer(run, gens[2].name, 300)
    assert main(["ckpt", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"{gens[2] / ck.MANIFEST}: unreadable manifest (entry '.metadata'" in out
    assert main(["ckpt", "ls", str(run)]) == 0
    assert "BAD" in capsys.readouterr().out


def test_a_pointer_that_is_a_directory_is_named_with_the_fix(run3, capsys):
    run, _ = run3
    (run / ck.POINTER).unlink()
    (run / ck.POINTER).mkdir()
    for argv in (["ckpt", "verify", str(run)], ["ckpt", "gc", str(run), "--dry-run"]):
        assert main(argv) == 1
        assert f"{run / ck.POINTER}: not the pointer file" in capsys.readouterr().err
    assert main(["ckpt", "ls", str(run)]) == 0
    assert "not the pointer file" in capsys.readouterr().err
    assert "not the pointer file" in (ck.plan_restore(run).pointer_problem or "")  # the restore falls back
