"""Inputs at corpus scale: .jsonl.gz, .jsonl.zst, .json (array or lines), a folder of mixed
suffixes; large files cut into byte ranges (jsonl, at line starts) and row-group ranges (parquet)
so --shards outnumbers the files and the shards concatenated equal the single-process
tokenization; linear grouping; the MaxArraySize split and encode threads in the array script;
progress per task in `dslurm data info`. A tokenizer trained here (nothing downloaded)."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from test_data_real_tokenizer import _all_tokens, _cli, _train

from dslurm.config import load_site
from dslurm.data import shards, sources
from dslurm.data.array import ArraySpec, array_parts, render_array
from dslurm.errors import UserError

SITE = Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml"
TEXTS = [f"doc {i}: " + " ".join(["the cat sat on a mat", "a dog ran", "over the hill"][i % 3:]) for i in range(60)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    _train(True).save(str(d / "tokenizer.json"))
    return d


def _lines(texts):
    return "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))


def _mixed(d: Path) -> Path:
    """TEXTS[0:60] over one file of each type, in path order."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_lines(TEXTS[0:10]).encode()))
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(TEXTS[10:20]).encode()))
    (d / "c.json").write_text(json.dumps([{"text": t} for t in TEXTS[20:30]], indent=2))
    (d / "d.json").write_text(_lines(TEXTS[30:35]))  # .json holding one object per line
    (d / "e.jsonl").write_text(_lines(TEXTS[35:50]))
    pq.write_table(pa.table({"text": TEXTS[50:60]}), d / "f.parquet", row_group_size=2)
    (d / "notes.md").write_text("not an input")
    return d


def test_each_new_format_and_a_mixed_folder_read_in_order(tmp_path, monkeypatch):
    d = _mixed(tmp_path / "in")
    found = sources.find_inputs([d])
    assert [p.name for p in found] == ["a.jsonl.gz", "b.jsonl.zst", "c.json", "d.json", "e.jsonl", "f.parquet"]
    assert [doc for b in sources.batches(found) for doc in b] == TEXTS
    monkeypatch.setattr(sources, "_JSON_CHUNK", 7)  # elements straddle every read of the array
    assert list(sources.documents(d / "c.json")) == TEXTS[20:30]


def test_byte_ranges_hold_each_line_once_in_order_and_row_groups_too(tmp_path):
    d = _mixed(tmp_path / "in")
    for k in (2, 3, 7, 50, 400):  # more ranges than lines: cuts move to line starts, none is empty
        ranges = sources.split_points(d / "e.jsonl", k)
        assert ranges is not None and 2 <= len(ranges) <= min(k, 15)
        per = [list(sources.documents(d / "e.jsonl", rng=r)) for r in ranges]
        assert all(per), (k, ranges)
        assert [doc for docs in per for doc in docs] == TEXTS[35:50], k
    groups = sources.split_points(d / "f.parquet", 3)
    assert groups == [(0, 2), (2, 4), (4, 5)]
    assert [doc for r in groups for doc in sources.documents(d / "f.parquet", rng=r)] == TEXTS[50:60]
    assert sources.split_points(d / "a.jsonl.gz", 4) is None  # a stream: read whole


def test_more_shards_than_files_equal_the_single_process_tokenization(tmp_path, tok_dir, monkeypatch):
    d = _mixed(tmp_path / "in")
    base = ["data", "tokenize", str(d), "--tokenizer", str(tok_dir)]
    assert _cli([*base, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")  # as in a task of --cpus-per-task 2: parsing reads ahead
    assert shards.encode_threads() == 2
    assert _cli([*base, "--out", str(tmp_path / "many"), "--shards", "9"]) == 0
    plan = shards.read_plan(tmp_path / "many")
    assert len(plan["shards"]) == 9 > len(sources.find_inputs([d]))
    assert any("range" in f for s in plan["shards"] for f in s["inputs"])
    np.testing.assert_array_equal(_all_tokens(tmp_path / "many"), _all_tokens(tmp_path / "one"))
    with pytest.raises(UserError, match="--shards 500: .*pieces.*Fix"):
        _cli([*base, "--out", str(tmp_path / "x"), "--shards", "500"])


def test_bad_new_inputs_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "x.json").write_text('[{"text": "a"}, {"body": "b"}]')
    with pytest.raises(UserError, match=r"x.json:element 2: no field 'text' \(this element has: 'body'\).*--field"):
        list(sources.documents(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text('[{"text": "a"} {"text": "b"}]')
    with pytest.raises(UserError, match=r"y.json: after element 1: expected ',' or '\]'"):
        list(sources.documents(tmp_path / "y.json"))
    (tmp_path / "z.json").write_text('[{"text": "a"},')
    with pytest.raises(UserError, match="z.json: the array is not closed"):
        list(sources.documents(tmp_path / "z.json"))
    (tmp_path / "w.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="w.jsonl.gz: does not decompress.*Fix"):
        list(sources.documents(tmp_path / "w.jsonl.gz"))
    (tmp_path / "r.jsonl").write_text(_lines(["a", "b"]) + '{"body": 1}\n')
    with pytest.raises(UserError, match=r"r.jsonl:byte \d+: no field 'text'"):
        list(sources.documents(tmp_path / "r.jsonl", rng=(5, 10_000)))
    (tmp_path / "q.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown input type '.csv'"):
        sources.find_inputs([tmp_path / "q.csv"])


def test_group_files_is_linear():
    sizes = [1 + i % 7 for i in range(50_000)]
    t0 = time.perf_counter()
    groups = shards.group_files(sizes, 1000)
    assert time.perf_counter() - t0 < 1.0  # the quadratic one: ~6 s at 50k files
    assert [i for g in groups for i in g] == list(range(50_000)) and all(groups)


def test_array_script_runs_encode_threads_and_offsets_a_split_array():
    site = load_site(SITE)
    text = render_array(site, ArraySpec(out=Path("/o ut"), tasks=[0, 1, 2], concurrency=2, time="1:00:00",
                                        cpus_per_task=8, offset=2002))
    assert "#SBATCH --cpus-per-task=8" in text and "export RAYON_NUM_THREADS=8" in text
    assert "#SBATCH --array=0-2%2" in text
    assert text.rstrip().endswith("\"$SLURM_ARRAY_TASK_ID\" 2002") and "'/o ut'" in text
    spec = ArraySpec(out=Path("/o"), tasks=list(range(2500)), concurrency=8, time="1:00:00")
    parts = array_parts(spec, 1001)  # Slurm's default MaxArraySize: ids 0..1000
    assert [(p.offset, p.tasks[0], p.tasks[-1]) for p in parts] == [(0, 0, 1000), (1001, 0, 1000), (2002, 0, 497)]
    redo = array_parts(ArraySpec(out=Path("/o"), tasks=[5, 1500], concurrency=8, time="1:00:00"), 1001)
    assert [(p.offset, p.tasks) for p in redo] == [(0, [5]), (1001, [499])]
    assert "#SBATCH --array=499%8" in render_array(site, redo[1])


def test_data_info_shows_progress_per_task_before_the_manifest(tmp_path, tok_dir, capsys):
    d = _mixed(tmp_path / "in")
    out = tmp_path / "o"
    assert _cli(["data", "tokenize", str(d), "--tokenizer", str(tok_dir), "--out", str(out), "--shards", "3"]) == 0
    (out / "manifest.json").unlink()
    (out / "shard-00002.h5").unlink()
    (out / "progress" / "shard-00002.json").unlink()
    prog = out / "progress" / "shard-00001.json"
    raw = json.loads(prog.read_text())
    prog.write_text(json.dumps({**raw, "state": "running", "chars": raw["bytes"] // 2}))
    (out / "shard-00001.h5").unlink()
    capsys.readouterr()
    assert _cli(["data", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 of 3 shards done (no manifest yet)" in text
    assert "task     0  done" in text and "task     2  not started" in text
    assert "task     1  running  ~50%" in text and "tokens/s" in text
