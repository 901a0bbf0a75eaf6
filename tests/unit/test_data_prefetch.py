"""Reads off the step (train/reader.py): direct reads equal h5py's, adjacent samples come in one
run, the background reader hands out exactly the batches a reader in the step would, and its
queue never leaks into the saved state (a restore neither repeats nor skips a batch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.data import tokenize as tk
from train.data import GlobalBatchSampler, TokenLoader, TokenSource, make_loader
from train.reader import Prefetcher, plan_reads, read_planned, read_windows

SITE = Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml"


def resolved_for(tmp_path, **data):
    job = load_job(data={
        "name": "t", "nodes": 1, "model": {"preset": "tiny", "seq_len": 16},
        "train": {"global_batch": 8, "seed": 5},
        "data": {"synthetic_tokens": 4096, **data},
        "checkpoint": {"run_dir": str(tmp_path / "run")}})
    return resolve(load_site(SITE), job)


def test_direct_reads_equal_h5py_across_chunks_layouts_and_fields(tmp_path):
    tokens = (np.arange(5000) * 7) % 65521
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:  # small chunks: windows straddle them
        f.create_dataset(tk.DATASET, data=tokens.astype(np.uint16), chunks=(300,))
        f.create_dataset("mask", data=(tokens % 2).astype(np.uint8))  # contiguous layout
        f.create_dataset("gz", data=tokens.astype(np.uint16), compression="gzip", chunks=(512,))
        f.attrs["vocab_size"] = 65536
    tf = tk.TokenFile(path)
    for start, n in [(0, 17), (290, 30), (299, 602), (4983, 17)]:
        out = np.empty(n, np.uint16)
        tf.read_into(start, out)
        assert out.tolist() == tokens[start:start + n].tolist()
        m = np.empty(n, np.uint8)
        tf.read_into(start, m, "mask")
        assert m.tolist() == (tokens[start:start + n] % 2).tolist()
        tf.read_into(start, out, "gz")  # filtered: through h5py
        assert out.tolist() == tokens[start:start + n].tolist()
    with pytest.raises(IndexError):
        tf.read_into(4990, np.empty(17, np.uint16))


def test_a_batch_reads_past_hdf5_and_every_field_follows_the_tokens(tmp_path, mocker):
    tokens = np.arange(1000) % 251
    tk._write_atomic(tmp_path / "a.h5", [tokens], vocab_size=256, seq_len=0, source="t")
    with h5py.File(tmp_path / "a.h5", "a") as f:
        f.create_dataset("loss_mask", data=(tokens % 3 == 0).astype(np.uint8))
    src = TokenSource(tmp_path / "a.h5", where="w")
    extents, read_into = mocker.spy(src.files[0], "extents"), mocker.spy(src.files[0], "read_into")
    sample = np.array([7, 3, 4, 5, 20])  # 3, 4, 5 adjacent (overlapping by a token)
    got = read_windows([src], np.zeros(5, np.int64), sample, 10, {"tokens": np.dtype(np.int64),
                                                                  "loss_mask": np.dtype(np.uint8)})
    assert extents.call_count == 2 and read_into.call_count == 0  # per field, the whole batch's offsets at once
    for row, i in enumerate(sample):
        assert got["tokens"][row].tolist() == tokens[i * 10:i * 10 + 11].tolist()
        assert got["loss_mask"][row].tolist() == (tokens[i * 10:i * 10 + 11] % 3 == 0).tolist()


def _batches(loader, n):
    return [torch.cat(loader.next_batch()).numpy() for _ in range(n)]


def test_prefetch_hands_out_the_batches_of_a_reader_in_the_step(tmp_path):
    res = resolved_for(tmp_path, policy="pad")
    plain = make_loader(resolved_for(tmp_path, prefetch=0), 1, 2, rank=0)
    ahead = make_loader(resolved_for(tmp_path, prefetch=3), 1, 2, rank=0)
    assert plain._pre is None and res.job.data.prefetch == 2
    for a, b in zip(_batches(plain, 40), _batches(ahead, 40)):  # past an epoch's end (31 steps of 8 in 4095)
        np.testing.assert_array_equal(a, b)
    assert ahead._pre is not None and ahead._pre._queue.qsize() <= 3
    ahead.close()


def test_a_state_saved_with_batches_queued_resumes_without_repeat_or_skip(tmp_path):
    straight = make_loader(resolved_for(tmp_path, prefetch=0), 0, 1, rank=0)
    want = _batches(straight, 12)
    first = make_loader(resolved_for(tmp_path, prefetch=4), 0, 1, rank=0)
    got = _batches(first, 5)
    for _ in range(100):  # let the reader fill its queue: 4 batches read ahead of the step
        if first._pre is not None and first._pre._queue.full():
            break
        first._pre._thread.join(0.01)
    assert first._pre is not None and first._pre._queue.full()
    state = first.state_dict()
    assert state["position"] == 5 * 8  # the step's position, not the reader's
    first.close()
    again = make_loader(resolved_for(tmp_path, prefetch=4), 0, 2, rank=0), make_loader(
        resolved_for(tmp_path, prefetch=4), 1, 2, rank=0)  # resumed under another dp size
    for ld in again:
        ld.load_state_dict(dict(state))
    for _ in range(7):
        x0, y0 = again[0].next_batch()
        x1, y1 = again[1].next_batch()
        got.append(torch.cat([x0, x1, y0, y1]).numpy())
    for g, w in zip(got, want, strict=True):  # rows: the inputs of the global batch, then its targets
        np.testing.assert_array_equal(g, w)


def test_a_skipped_batch_is_dropped_from_the_queue_and_a_restore_restarts_the_reader(tmp_path):
    ref = make_loader(resolved_for(tmp_path, prefetch=0), 0, 1, rank=0)
    ld = make_loader(resolved_for(tmp_path, prefetch=2), 0, 1, rank=0)
    ld.next_batch(), ref.next_batch()
    ld.sampler.next_global(), ref.sampler.next_global()  # the loop's skip_positions path
    np.testing.assert_array_equal(ld.next_batch()[0], ref.next_batch()[0])
    state = ref.state_dict()
    ref.next_batch(), ld.next_batch()
    ld.load_state_dict(state)
    ref.load_state_dict(state)
    assert ld._pre is None  # what it read ahead belonged to the old position
    np.testing.assert_array_equal(ld.next_batch()[0], ref.next_batch()[0])
    ld.close()


def test_a_read_error_in_the_reader_reaches_the_step(tmp_path):
    tk.write_synthetic(tmp_path / "c.h5", 2000, 256, seed=0)
    sampler = GlobalBatchSampler(num_samples=500, global_batch=4, seed=1)  # ids past the file's end
    loader = TokenLoader(tk.TokenFile(tmp_path / "c.h5"), sampler, seq_len=16, prefetch=2)
    with pytest.raises(IndexError, match="outside 2000 tokens"):
        for _ in range(50):
            loader.next_batch()
    loader.close()
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda ids: ids, sampler, 0)


def test_planned_reads_equal_h5py_across_chunks_gaps_holes_shards_and_dtypes(tmp_path):
    """Planned reads (one preadv a window) and their read_into fallback: windows inside a chunk, across two chunks
    adjacent on disk, across a chunk apart from its neighbour, in an unallocated chunk, across
    two shards, of a contiguous dataset, read as the disk dtype and widened."""
    tokens = (np.arange(6000) * 7) % 65521
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:  # 300-token chunks written out of order: some neighbours far apart on disk
        ds = f.create_dataset(tk.DATASET, shape=(4000,), dtype=np.uint16, chunks=(300,))
        for c in [0, 1, 2, 5, 3, 4, 6, 8, 9, 10, 11, 12, 13]:  # chunk 7 never written: a hole
            ds[c * 300:min(4000, (c + 1) * 300)] = tokens[c * 300:min(4000, (c + 1) * 300)]
        f.create_dataset("mask", data=(tokens[:4000] % 2).astype(np.uint8))  # contiguous layout
        f.attrs["vocab_size"] = 65536
    with h5py.File(b, "w") as f:
        f.create_dataset(tk.DATASET, data=tokens[4000:].astype(np.uint16), chunks=(512,))
        f.create_dataset("mask", data=(tokens[4000:] % 2).astype(np.uint8), chunks=(512,))
        f.attrs["vocab_size"] = 65536
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "dslurm-manifest", "version": 1, "vocab_size": 65536, "dtype": "uint16", "n_tokens": 6000,
        "shards": [{"path": "a.h5", "n_tokens": 4000}, {"path": "b.h5", "n_tokens": 2000}]}))
    src = TokenSource(tmp_path / "manifest.json", where="w")
    stream = tokens.copy()
    stream[2100:2400] = 0  # the hole reads as the fill value
    seq = 50
    sample = np.array([0, 5, 11, 29, 41, 44, 47, 79, 100, 3, 5])  # 5 twice; 79 crosses into b.h5
    for fields in ({"tokens": np.dtype(np.uint16)}, {"tokens": np.dtype(np.int64), "mask": np.dtype(np.uint8)}):
        got = read_windows([src], np.zeros(len(sample), np.int64), sample, seq, fields)
        for row, i in enumerate(sample):
            want = stream[i * seq:i * seq + seq + 1]
            assert got["tokens"][row].tolist() == want.tolist(), (row, i)
            if "mask" in fields:
                assert got["mask"][row].tolist() == (tokens[i * seq:i * seq + seq + 1] % 2).tolist()
        assert got["tokens"].dtype == fields["tokens"]
    plan = plan_reads([src], np.zeros(len(sample), np.int64), sample, seq, {"tokens": np.dtype(np.uint16)})
    slow = set(sample[plan.odd["tokens"]].tolist())
    # to read_into: across chunks 4|5 (apart on disk), into or out of the hole, across the shards
    assert {29, 41, 44, 47, 79} <= slow and not {0, 3, 100} & slow
    other = open(tmp_path / "manifest.json", "rb")  # a close, and a new file that may reuse its descriptor
    src.files[0].close()
    got = read_planned(plan, [src], 0, len(sample))  # a stale plan reads by read_into
    other.close()
    for row, i in enumerate(sample):
        assert got["tokens"][row].tolist() == stream[i * seq:i * seq + seq + 1].tolist()


def test_adjacent_windows_are_one_read_and_equal_h5py_with_the_shared_boundary_token(tmp_path, mocker):
    """A run of windows adjacent in one file (a shuffle block) is one os.preadv; the rows equal h5py's,
    the boundary token each window shares with the next included; a run crossing into another
    shard or a chunk far away on disk splits where it must."""
    import os

    import train.reader as reader

    tokens = (np.arange(6000) * 7) % 65521
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:  # chunk 5 written after 6: the 4|5 and 5|6 neighbours are apart on disk
        ds = f.create_dataset(tk.DATASET, shape=(4000,), dtype=np.uint16, chunks=(500,))
        for c in [0, 1, 2, 3, 4, 6, 5, 7]:
            ds[c * 500:(c + 1) * 500] = tokens[c * 500:(c + 1) * 500]
        f.attrs["vocab_size"] = 65536
    with h5py.File(b, "w") as f:
        f.create_dataset(tk.DATASET, data=tokens[4000:].astype(np.uint16))
        f.attrs["vocab_size"] = 65536
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "dslurm-manifest", "version": 1, "vocab_size": 65536, "dtype": "uint16", "n_tokens": 6000,
        "shards": [{"path": "a.h5", "n_tokens": 4000}, {"path": "b.h5", "n_tokens": 2000}]}))
    src = TokenSource(tmp_path / "manifest.json", where="w")
    seq = 20
    sample = np.array([0, 1, 2, 3, 9, 10, 11, 197, 198, 199, 200, 201, 60, 61, 62, 63, 123, 124, 125, 126])
    calls = []
    real = os.preadv
    mocker.patch.object(reader.os, "preadv",
                        side_effect=lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
    plan = plan_reads([src], np.zeros(len(sample), np.int64), sample, seq, {"tokens": np.dtype(np.uint16)})
    assert plan.run_end is not None
    got = read_planned(plan, [src], 0, len(sample))["tokens"]
    for row, i in enumerate(sample):
        assert got[row].tolist() == tokens[i * seq:i * seq + seq + 1].tolist(), (row, i)
    # 0-3 one call of 4; 9-11 one of 3; 197-198 one of 2 (199's window crosses into b.h5: read_into),
    # 200-201 one of 2 in b.h5; 60-63 inside chunk 2: one of 4; 123 alone, 124 across chunks 4|5 (apart
    # on disk: read_into), 125-126 one of 2 in chunk 5 (read_into makes single-buffer calls of its own)
    assert sorted((c for c in calls if c > 1), reverse=True) == [4, 4, 3, 2, 2, 2], calls
    # two batches out of one plan: a run never crosses the batch boundary
    calls.clear()
    first, second = read_planned(plan, [src], 0, 2)["tokens"], read_planned(plan, [src], 2, 6)["tokens"]
    assert first.tolist() == got[:2].tolist() and second.tolist() == got[2:6].tolist()
    assert calls == [2, 2, 2], calls  # rows 0-1 | rows 2-3, then 9-10 (11 is in the next batch)


@pytest.mark.parametrize("block,threads,read", [(1, 1, "preadv"), (4, 1, "preadv"), (1, 2, "preadv"),
                                               (4, 2, "preadv"), (1, 1, "mmap"), (4, 2, "mmap")])
def test_the_reader_reads_groups_of_batches_and_hands_out_each_as_a_read_in_the_step_would(
        tmp_path, monkeypatch, block, threads, read):
    """`TokenLoader.batches` reads about READ_GROUP_BYTES of batches per call (one block, views handed
    out), shared among `data.read_threads` threads (2 threads: 6-row slices cut runs of 4): groups
    that cut a plan anywhere, and slices that cut a run of adjacent windows anywhere, give the
    batches of one read per batch (`data.read: mmap`: of the call-per-window reader), boundary
    tokens included, and no group holds more than its bound."""
    import train.data as data
    import train.reader as reader

    ld = make_loader(resolved_for(tmp_path, shuffle_block=block, read_threads=threads, read=read), 1, 2, rank=0)
    ref = make_loader(resolved_for(tmp_path, shuffle_block=block), 1, 2, rank=0)
    assert (ld._pool is None) == (threads == 1) and ld.mapped == (read == "mmap") and not ref.mapped
    batch_bytes = ld.local_batch * (ld.seq_len + 1) * 2  # uint16 tokens
    monkeypatch.setattr(reader, "READ_GROUP_BYTES", 3 * batch_bytes + 1)  # 3 batches a group
    assert reader.read_group(batch_bytes) == 3 and reader.read_group(10**9) == 1
    sizes = []
    real = data.TokenLoader._staged
    monkeypatch.setattr(data.TokenLoader, "_staged", lambda self, plan, lo, hi: sizes.append(hi - lo) or
                        real(self, plan, lo, hi))
    import dataclasses
    it = ld.batches(dataclasses.replace(ld.sampler))
    for _ in range(40):  # past an epoch (4095 tokens: 255 samples, 31 steps of 8)
        position, ids, batch = next(it)
        assert batch["tokens"].shape == (ld.local_batch, ld.seq_len + 1)
        np.testing.assert_array_equal(batch["tokens"], ref.read_arrays(ids)["tokens"])
    assert set(sizes) <= {3 * ld.local_batch, 1 * ld.local_batch, 2 * ld.local_batch} and sizes[0] == 12, sizes


def test_mapped_reads_equal_h5py_copy_every_direct_window_and_leave_the_odd_ones_to_read_into(tmp_path, mocker):
    """`data.read: mmap`: the windows a call would read are copied from the files' memory maps
    (no call for them: the call paths raise here), the odd ones (across shards, chunks apart on
    disk) still go through read_into, every row equals h5py's, every field follows the tokens;
    a span past a map (a file cut short) is read_into's short-read error; a file closes with a
    plan's view alive and maps again."""
    import train.reader as reader

    tokens = (np.arange(6000) * 7) % 65521
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    with h5py.File(a, "w") as f:  # chunk 5 written after 6: windows across 4|5 and 5|6 are odd
        ds = f.create_dataset(tk.DATASET, shape=(4000,), dtype=np.uint16, chunks=(500,))
        for c in [0, 1, 2, 3, 4, 6, 5, 7]:
            ds[c * 500:(c + 1) * 500] = tokens[c * 500:(c + 1) * 500]
        f.create_dataset("mask", data=(tokens[:4000] % 2).astype(np.uint8))
        f.attrs["vocab_size"] = 65536
    with h5py.File(b, "w") as f:
        f.create_dataset(tk.DATASET, data=tokens[4000:].astype(np.uint16))
        f.create_dataset("mask", data=(tokens[4000:] % 2).astype(np.uint8))
        f.attrs["vocab_size"] = 65536
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "dslurm-manifest", "version": 1, "vocab_size": 65536, "dtype": "uint16", "n_tokens": 6000,
        "shards": [{"path": "a.h5", "n_tokens": 4000}, {"path": "b.h5", "n_tokens": 2000}]}))
    src = TokenSource(tmp_path / "manifest.json", where="w")
    seq, sample = 20, np.array([0, 1, 2, 3, 9, 124, 125, 199, 200, 201, 60, 61, 126, 5, 5, 298])
    fields = {"tokens": np.dtype(np.uint16), "mask": np.dtype(np.uint8)}
    mocker.patch.object(reader, "_preadv_rows", side_effect=AssertionError("a call for a mapped window"))
    mocker.patch.object(reader, "_preadv_runs", side_effect=AssertionError("a call for a mapped window"))
    plan = plan_reads([src], np.zeros(len(sample), np.int64), sample, seq, fields, mapped=True)
    assert plan.maps is not None and len(plan.maps) == 2 and plan.odd["tokens"]
    got = read_planned(plan, [src], 0, len(sample))
    for row, i in enumerate(sample):
        assert got["tokens"][row].tolist() == tokens[i * seq:i * seq + seq + 1].tolist(), (row, i)
        assert got["mask"][row].tolist() == (tokens[i * seq:i * seq + seq + 1] % 2).tolist(), (row, i)
    # a file cut short before it is mapped: its spans past the end go to read_into, which says so
    tk._write_atomic(tmp_path / "c.h5", [np.arange(3000) % 251], vocab_size=256, seq_len=0, source="t")
    cut = tk.TokenFile(tmp_path / "c.h5")
    cut.fileno()  # open, at full length
    os.truncate(tmp_path / "c.h5", int(cut.extents(np.array([2500]), 1)[0]))  # tokens 2500 on gone
    short = plan_reads([cut], np.zeros(2, np.int64), np.array([0, 140]), seq, {"tokens": np.dtype(np.uint16)},
                       mapped=True)
    assert short.fd["tokens"][0] >= 0 and short.odd["tokens"] == [1]
    assert read_planned(short, [cut], 0, 1)["tokens"][0].tolist() == (np.arange(seq + 1) % 251).tolist()
    with pytest.raises(OSError, match="short read"):
        read_planned(short, [cut], 1, 2)
    view = src.files[0].mapped()
    src.files[0].close()  # a live view: the map stays until it goes
    assert bytes(view[:4]) == b"\x89HDF"  # still readable: an HDF5 file's signature
    again = plan_reads([src], np.zeros(2, np.int64), np.array([0, 1]), seq, fields, mapped=True)
    assert read_planned(again, [src], 0, 2)["tokens"][1].tolist() == tokens[seq:2 * seq + 1].tolist()


def test_a_read_pool_waits_for_every_slice_and_raises_a_threads_error_in_the_caller():
    from train.reader import ReadPool

    pool = ReadPool(3)
    seen: list[tuple[int, int]] = []

    def fn(x: int, y: int) -> None:
        import time
        time.sleep(0.02 if x else 0)  # the caller's own slice ends first: share still waits
        seen.append((x, y))

    pool.share(fn, 0, 30)
    assert sorted(seen) == [(0, 10), (10, 20), (20, 30)]
    seen.clear()
    pool.share(fn, 0, 7)  # too few rows to be worth a hand-off: one slice, the caller's
    assert seen == [(0, 7)]

    def bad(x: int, y: int) -> None:
        if x == 10:
            raise OSError(f"EIO at row {x}")

    with pytest.raises(OSError, match="EIO at row 10"):
        pool.share(bad, 0, 30)
    pool.close()
    with pytest.raises(ValueError, match="1 reads in the caller"):
        ReadPool(1)


def test_a_mapped_file_unmaps_on_close_once_no_plan_holds_a_view(tmp_path):
    """TokenFile.close unmaps the file (its pages no longer pinned by the map: they can be evicted),
    and a view still held keeps the map until it goes, without an error."""
    tk._write_atomic(tmp_path / "a.h5", [np.arange(4096) % 251], vocab_size=256, seq_len=0, source="t")
    tf = tk.TokenFile(tmp_path / "a.h5")

    def mapped() -> bool:
        return any(str(tmp_path / "a.h5") in line for line in open("/proc/self/maps"))

    assert tf.mapped() is tf.mapped() and mapped()
    tf.close()
    assert not mapped()
    view = tf.mapped()
    tf.close()
    assert mapped() and bytes(view[:4]) == b"\x89HDF"  # still readable: an HDF5 file's signature
    del view
    assert not mapped()


def test_a_page_cached_file_is_mapped_whole_and_a_larger_one_as_it_is_touched(tmp_path, monkeypatch):
    """`TokenFile.mapped`: a file whose pages are all cached (just written) and within
    POPULATE_MAX_BYTES is resident in the map at once (its Rss in /proc/self/smaps is the file);
    over the cap nothing is resident until touched, and a touched page then is."""
    tk._write_atomic(tmp_path / "a.h5", [np.arange(1 << 20) % 251], vocab_size=256, seq_len=0, source="t")

    def resident_kb() -> int:
        lines = open("/proc/self/smaps").read().splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(str(tmp_path / "a.h5")))
        return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:"))

    size_kb = (tmp_path / "a.h5").stat().st_size // 1024
    tf = tk.TokenFile(tmp_path / "a.h5")
    assert tk.cached_share(tf.fileno()) == 1.0
    tf.mapped()
    assert resident_kb() >= size_kb - 4
    tf.close()
    monkeypatch.setattr(tk, "POPULATE_MAX_BYTES", 1 << 20)  # the 2 MB file is over it
    lazy = tk.TokenFile(tmp_path / "a.h5")
    view = lazy.mapped()
    assert resident_kb() < size_kb // 2
    view[1 << 20].item()  # a touch
    assert resident_kb() >= 4
    del view
    lazy.close()
