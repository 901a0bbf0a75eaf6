"""The torch-free checkpoint protocol: names, manifest, verify, pointer, selection, retention, lock."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm import checkpoint as ck
from dslurm.checkpoint import pointer
from dslurm.errors import UserError

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def make_gen(run: Path, step: int, *, commit: bool = True, token: str = "aaaaaa",
             payload: bytes = b"") -> Path:
    """A fake generation with the files a DCP save leaves (contents are arbitrary bytes)."""
    gen = ck.generations_dir(run) / ck.generation_name(step, T0 + dt.timedelta(seconds=step), token)
    (gen / ck.RANKS).mkdir(parents=True)
    files = {".metadata": pickle.dumps("m" * 10, protocol=2),  # 20 bytes, a plain pickle
             "__0_0.distcp": payload or os.urandom(4096) + bytes([step % 256]),
             "__1_0.distcp": os.urandom(3000), ck.META: b"{}", f"{ck.RANKS}/rank-00000.json": b"{}"}
    for rel, data in files.items():
        (gen / rel).write_bytes(data)
    if commit:
        ck.write_manifest(gen, step, ck.checksum_files(gen, files))
    return gen


def publish(run: Path, gen: Path) -> None:
    ck.write_pointer(run, gen.name, ck.parse_step(gen.name))


def select(run: Path) -> ck.Selection:
    return ck.select_generation(
        ck.plan_restore(run),
        lambda name, crc: ck.verify_generation(ck.generations_dir(run) / name, True, crc))


# ------------------------------------------------------------------ names and writes


def test_generation_names_sort_by_step_then_time_and_parse_back():
    a = ck.generation_name(99_999_999, T0, "000001")
    b = ck.generation_name(100_000_000, T0, "000000")  # 9 digits: still after 8
    c = ck.generation_name(7, T0 + dt.timedelta(seconds=1), "000000")
    d = ck.generation_name(7, T0, "ffffff")
    assert ck.parse_step(a) == 99_999_999 and ck.parse_step(b) == 100_000_000
    assert sorted([a, b, c, d], key=pointer._sort_key) == [d, c, a, b]
    assert ck.parse_step("step-12-foo") is None and ck.parse_step("LATEST") is None
    assert ck.generation_name(1) != ck.generation_name(1)  # random suffix: same-second saves differ


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    p = tmp_path / "x.json"
    ck.atomic_write_json(p, {"a": 1})
    ck.atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]


def test_config_digest_ignores_key_order_but_not_values():
    assert ck.config_digest({"a": 1, "b": [1, 2]}) == ck.config_digest({"b": [1, 2], "a": 1})
    assert ck.config_digest({"a": 1}) != ck.config_digest({"a": 2})


def test_field_differences_names_each_field():
    diffs = ck.field_differences({"dim": 8, "layers": 2}, {"dim": 16, "layers": 2, "heads": 4})
    assert diffs == ["dim: 8 -> 16", "heads: '<absent>' -> 4"]


# ------------------------------------------------------------------ manifest and verify


def test_sound_generation_verifies(tmp_path):
    gen = make_gen(tmp_path, 10)
    assert ck.verify_generation(gen) == []
    doc = ck.read_manifest(gen)
    assert doc["algo"] == "crc32" and set(doc["files"]) >= {".metadata", ck.META, "__0_0.distcp"}


def test_truncated_shard_is_named_with_its_size(tmp_path):
    gen = make_gen(tmp_path, 10)
    shard = gen / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (problem,) = ck.verify_generation(gen, full=False)
    assert str(shard) in problem and "size 100 != 3000" in problem


def test_altered_shard_same_size_needs_full_check(tmp_path):
    gen = make_gen(tmp_path, 10)
    shard = gen / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[17] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert ck.verify_generation(gen, full=False) == []  # sizes alone cannot see a flipped byte
    (problem,) = ck.verify_generation(gen, full=True)
    assert str(shard) in problem and "crc32" in problem


def test_missing_file_manifest_and_required_entries(tmp_path):
    gen = make_gen(tmp_path, 10)
    (gen / "__1_0.distcp").unlink()
    assert ck.verify_generation(gen) == [f"{gen / '__1_0.distcp'}: missing"]
    partial = make_gen(tmp_path, 11, commit=False)
    assert "missing (partial or in-flight" in ck.verify_generation(partial)[0]
    (partial / ck.MANIFEST).write_text("{not json")
    assert "unreadable manifest" in ck.verify_generation(partial)[0]
    ck.write_manifest(partial, 11, ck.checksum_files(partial, ["__0_0.distcp"]))
    problems = ck.verify_generation(partial)
    assert any(".metadata: not listed" in p for p in problems)
    assert any("meta.json: not listed" in p for p in problems)


# ------------------------------------------------------------------ pointer


def test_pointer_roundtrip_missing_and_garbage(tmp_path):
    assert ck.read_pointer(tmp_path) is None
    gen = make_gen(tmp_path, 5)
    publish(tmp_path, gen)
    ptr = ck.read_pointer(tmp_path)
    assert (ptr.generation, ptr.step) == (gen.name, 5) and len(ptr.manifest_crc32) == 8
    (tmp_path / ck.POINTER).write_bytes(b"\x00\xffgarbage")
    with pytest.raises(ck.CheckpointError, match="garbage pointer"):
        ck.read_pointer(tmp_path)
    (tmp_path / ck.POINTER).write_text(json.dumps({"generation": "../../etc", "step": 1}))
    with pytest.raises(ck.CheckpointError, match="not a generation name"):
        ck.read_pointer(tmp_path)


def test_replaced_manifest_is_caught_by_the_pointer_crc(tmp_path):
    gen = make_gen(tmp_path, 5)
    publish(tmp_path, gen)
    ck.write_manifest(gen, 5, ck.checksum_files(gen, [".metadata", ck.META]))  # consistent, but not ours
    ptr = ck.read_pointer(tmp_path)
    assert ck.verify_generation(gen) == []
    (problem,) = ck.verify_generation(gen, pointer_crc=ptr.manifest_crc32)
    assert "recorded in LATEST" in problem


# ------------------------------------------------------------------ choosing what to restore


def test_empty_run_dir_is_a_fresh_start(tmp_path):
    sel = select(tmp_path)
    assert sel.generation is None and not sel.fell_back and "fresh start" in sel.reason


def test_only_partials_is_a_fresh_start_that_names_them(tmp_path):
    gen = make_gen(tmp_path, 3, commit=False)
    sel = select(tmp_path)
    assert sel.generation is None and gen.name in sel.reason


def test_pointer_target_is_chosen_and_newer_generations_are_invisible(tmp_path):
    old, target = make_gen(tmp_path, 2), make_gen(tmp_path, 4)
    publish(tmp_path, target)
    make_gen(tmp_path, 6)  # committed but never published (crash before the pointer moved)
    sel = select(tmp_path)
    assert (sel.generation, sel.step, sel.fell_back) == (target.name, 4, False)
    assert old.name != sel.generation


def test_corrupt_target_falls_back_to_newest_older_verified(tmp_path):
    _oldest, older, target = make_gen(tmp_path, 2), make_gen(tmp_path, 4), make_gen(tmp_path, 6)
    publish(tmp_path, target)
    (target / "__0_0.distcp").write_bytes(b"short")
    make_gen(tmp_path, 8)  # newer than the pointer: must not be used as a fallback
    sel = select(tmp_path)
    assert sel.generation == older.name and sel.fell_back and sel.step == 4
    assert "__0_0.distcp" in sel.reason and target.name in sel.reason
    assert [n for n, _ in sel.rejected] == [target.name]


def test_pointer_to_missing_generation_falls_back(tmp_path):
    older = make_gen(tmp_path, 4)
    target = make_gen(tmp_path, 6)
    publish(tmp_path, target)
    ck.remove_generation(tmp_path, target.name)
    sel = select(tmp_path)
    assert sel.generation == older.name and sel.fell_back and "directory missing" in sel.reason


def test_garbage_pointer_with_verified_generations_falls_back_loudly(tmp_path):
    make_gen(tmp_path, 2)
    newest = make_gen(tmp_path, 4)
    (tmp_path / ck.POINTER).write_text("}}}")
    sel = select(tmp_path)
    assert sel.generation == newest.name and sel.fell_back and "garbage pointer" in sel.reason


def test_missing_pointer_with_committed_generation_falls_back(tmp_path):
    gen = make_gen(tmp_path, 4)  # killed after the manifest, before the first pointer write
    sel = select(tmp_path)
    assert sel.generation == gen.name and sel.fell_back and "LATEST missing" in sel.reason


def test_garbage_pointer_and_nothing_verified_refuses(tmp_path):
    (tmp_path / ck.POINTER).write_text("garbage")
    with pytest.raises(ck.CheckpointError, match="Refusing to start fresh"):
        select(tmp_path)


def test_pointer_and_no_sound_generation_refuses_naming_files(tmp_path):
    gen = make_gen(tmp_path, 4)
    publish(tmp_path, gen)
    (gen / "__1_0.distcp").unlink()
    with pytest.raises(ck.CheckpointError, match=r"__1_0\.distcp: missing"):
        select(tmp_path)


# ------------------------------------------------------------------ retention


def _infos(run: Path) -> list[ck.GenInfo]:
    return ck.list_generations(run)


def test_retention_keeps_last_k_pointer_inflight_and_every_m(tmp_path):
    gens = [make_gen(tmp_path, s) for s in (10, 20, 30, 40, 50)]
    orphan = make_gen(tmp_path, 45, commit=False)
    inflight = make_gen(tmp_path, 60, commit=False)
    names = [g.name for g in gens]
    doomed = ck.plan_retention(_infos(tmp_path), names[4], keep=2, in_flight=[inflight.name])
    assert doomed == [names[0], names[1], names[2], orphan.name]
    doomed = ck.plan_retention(_infos(tmp_path), names[4], keep=2, keep_every=20, in_flight=[inflight.name])
    assert doomed == [names[0], names[2], orphan.name]


def test_retention_never_deletes_pointer_target_or_unpublished_newer(tmp_path):
    gens = [make_gen(tmp_path, s) for s in (10, 20, 30, 40)]
    doomed = ck.plan_retention(_infos(tmp_path), gens[1].name, keep=2)
    assert doomed == []  # 10 and 20 are the last two published; 30 and 40 are newer than the pointer
    doomed = ck.plan_retention(_infos(tmp_path), gens[0].name, keep=2)
    assert doomed == []


def test_after_a_fallback_retention_deletes_the_corrupt_generation_not_the_good_fallback(tmp_path):
    # Issue 12.5: the pointer named 30, which turned out corrupt; restore fell back to 20 and
    # marked 30 rejected; the next save (40) moved the pointer. keep=2 must keep 20 and 40.
    good, bad = make_gen(tmp_path, 20), make_gen(tmp_path, 30)
    make_gen(tmp_path, 10)
    publish(tmp_path, bad)
    (bad / "__0_0.distcp").write_bytes(b"rot")
    sel = ck.select_generation(ck.plan_restore(tmp_path), lambda n, c: ck.verify_generation(
        ck.generations_dir(tmp_path) / n, pointer_crc=c))
    assert sel.fell_back and sel.generation == good.name and sel.rejected[0][0] == bad.name
    ck.mark_rejected(bad, sel.rejected[0][1])
    new = make_gen(tmp_path, 40)
    publish(tmp_path, new)
    ck.collect_garbage(tmp_path, keep=2)
    left = {g.name for g in ck.list_generations(tmp_path)}
    assert left == {good.name, new.name}  # the corrupt one is gone, the good fallback stays
    assert not ck.verify_generation(good)


def test_retention_refuses_keep_below_two(tmp_path):
    with pytest.raises(UserError, match="at least 2"):
        ck.plan_retention([], None, keep=1)


def test_collect_garbage_removes_dirs_and_trash(tmp_path):
    gens = [make_gen(tmp_path, s) for s in (1, 2, 3)]
    publish(tmp_path, gens[2])
    (ck.generations_dir(tmp_path) / f"{ck.TRASH}step-x").mkdir()  # left by a kill mid-removal
    removed = ck.collect_garbage(tmp_path, keep=2)
    assert removed == [gens[0].name]
    assert sorted(p.name for p in ck.generations_dir(tmp_path).iterdir()) == [gens[1].name, gens[2].name]


def test_collect_garbage_refuses_under_a_garbage_pointer(tmp_path):
    make_gen(tmp_path, 1), make_gen(tmp_path, 2), make_gen(tmp_path, 3)
    (tmp_path / ck.POINTER).write_text("??")
    with pytest.raises(ck.CheckpointError, match="garbage pointer"):
        ck.collect_garbage(tmp_path, keep=2)
    assert len(ck.list_generations(tmp_path)) == 3


# ------------------------------------------------------------------ lock


def test_second_writer_is_refused_with_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    first = ck.RunDirLock(tmp_path)
    first.acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "5678")
    with pytest.raises(ck.RunLocked, match="Slurm job 1234"):
        ck.RunDirLock(tmp_path).acquire()
    first.release()
    second = ck.RunDirLock(tmp_path)
    second.acquire()
    assert second.holder()["job_id"] == "5678"
    second.release()
    assert second.holder() is None


def test_requeue_of_the_same_job_is_let_through(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    first = ck.RunDirLock(tmp_path)
    first.acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.WARNING):
        ck.RunDirLock(tmp_path).acquire()
    assert "earlier incarnation of this job" in caplog.text
    first.release()


def test_lock_of_a_kill_9_holder_is_free_and_its_record_replaced(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code = ("import sys,time; from dslurm.checkpoint import RunDirLock; "
            f"RunDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ck.RunLocked, match=f"pid {proc.pid}"):
            ck.RunDirLock(tmp_path).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = ck.RunDirLock(tmp_path)
    with caplog.at_level(logging.INFO):
        lock.acquire()
    assert f"pid {proc.pid}" in caplog.text and "is gone" in caplog.text
    assert lock.holder()["pid"] == os.getpid()
    lock.release()
