"""Real tokenizers: a tokenizer trained here (nothing downloaded) over txt, jsonl and parquet;
the separators docs/data.md promises; shards, plan, manifest; the errors users meet."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from dslurm.data import cli as data_cli
from dslurm.data import hf, manifest, shards, sources
from dslurm.data import tokenize as tk
from dslurm.errors import UserError

DOCS = ["the cat sat on the mat", "a dog ran\nover the hill", "tokens are small pieces",
        "hello world again", "the end of the data"]


def _train(template: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer)
    if template:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    _train(True).save(str(d / "tokenizer.json"))
    _train(False).save(str(d / "plain.json"))
    return d


def _inputs(d):
    d.mkdir(exist_ok=True)
    (d / "a.txt").write_text(f"{DOCS[0]}\n\n\n{DOCS[1]}\n")
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[2:4]))
                               + "\n")
    pq.write_table(pa.table({"text": [DOCS[4], None], "n": [1, 2]}), d / "c.parquet", row_group_size=1)
    return d


def _cli(argv):
    parser = argparse.ArgumentParser(prog="dslurm")
    data_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _all_tokens(out):
    return np.concatenate([tk.TokenFile(s.path).window(0, s.n_tokens) for s in manifest.token_sources(out)])


def test_documents_of_each_format_in_order(tmp_path):
    d = _inputs(tmp_path / "in")
    assert [doc for b in sources.batches(sources.find_inputs([d])) for doc in b] == DOCS
    assert list(sources.documents(d / "a.txt", txt_docs="file")) == [f"{DOCS[0]}\n\n\n{DOCS[1]}\n"]


def test_every_document_is_encode_of_it_with_the_post_processors_separators(tmp_path, tok_dir, capsys):
    d = _inputs(tmp_path / "in")
    assert _cli(["data", "tokenize", str(d), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"),
                 "--shards", "2"]) == 0
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    want = [i for doc in DOCS for i in ref.encode(doc).ids]
    assert ref.encode(DOCS[0]).ids[0] == 1 and ref.encode(DOCS[0]).ids[-1] == 2  # <s> ... </s>
    np.testing.assert_array_equal(_all_tokens(tmp_path / "o"), want)
    m = manifest.read_manifest(tmp_path / "o")
    assert (m.n_tokens, m.dtype, m.vocab_size) == (len(want), "uint16", ref.get_vocab_size())
    assert m.tokenizer["bos_id"] == 1 and m.tokenizer["eos_id"] == 2 and len(m.tokenizer["hash"]) == 64
    pieces = [f for s in json.loads((tmp_path / "o/manifest.json").read_text())["shards"] for f in s["inputs"]]
    assert sorted({Path(f["path"]).name for f in pieces}) == ["a.txt", "b.jsonl", "c.parquet"]
    assert len(m.inputs) == 3  # the manifest's inputs: each file once, however it was cut
    info = tk.read_info(m.shards[0].path)
    assert (info.tokenizer_hash, info.bos_id, info.eos_id) == (m.tokenizer["hash"], 1, 2)
    assert "all present and complete" in capsys.readouterr().out


def test_explicit_eos_flag_separates_documents(tmp_path, tok_dir):
    d = _inputs(tmp_path / "in")
    assert _cli(["data", "tokenize", str(d / "b.jsonl"), "--tokenizer", str(tok_dir / "plain.json"),
                 "--out", str(tmp_path / "o"), "--eos", "</s>"]) == 0
    ref = Tokenizer.from_file(str(tok_dir / "plain.json"))
    want = [i for doc in DOCS[2:4] for i in [*ref.encode(doc).ids, 2]]
    np.testing.assert_array_equal(_all_tokens(tmp_path / "o"), want)
    assert manifest.read_manifest(tmp_path / "o").tokenizer["bos_id"] is None


def test_rerun_skips_finished_shards_and_redoes_a_missing_one(tmp_path, tok_dir, capsys):
    d = _inputs(tmp_path / "in")
    argv = ["data", "tokenize", str(d), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"), "--shards", "3"]
    assert _cli(argv) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o").glob("shard-*.h5")}
    (tmp_path / "o/shard-00001.h5").unlink()
    (tmp_path / "o/.shard-00001.h5.abc.tmp").write_bytes(b"partial")
    capsys.readouterr()
    assert _cli(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped: 0,2" in printed and "tokenizing shards 1 here" in printed
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "o").glob("shard-*.h5")}
    assert after["shard-00000.h5"] == before["shard-00000.h5"] and after["shard-00002.h5"] == before["shard-00002.h5"]
    assert not list((tmp_path / "o").glob(".*.tmp"))


def test_group_files_is_contiguous_balanced_and_never_empty():
    assert shards.group_files([1, 1, 1], 3) == [[0], [1], [2]]
    assert shards.group_files([5] * 10, 3) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert shards.group_files([100, 1, 1, 1, 1], 3) == [[0], [1], [2, 3, 4]]
    with pytest.raises(UserError, match="--shards 4"):
        shards.group_files([1, 1, 1], 4)


def test_jsonl_line_without_the_field_names_file_line_and_fix(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no"}\n')
    with pytest.raises(UserError, match=r"x.jsonl:2: no field 'text' \(this line has: 'body'\).*--field"):
        list(sources.documents(tmp_path / "x.jsonl"))


def test_parquet_without_the_column_lists_the_columns(tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "x.parquet")
    with pytest.raises(UserError, match=r"x.parquet: no column 'text' \(columns: body\).*--field"):
        list(sources.documents(tmp_path / "x.parquet"))


def test_tokenizer_that_does_not_parse_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(UserError, match="tokenizer.json: does not parse"):
        hf.load(tmp_path)
    with pytest.raises(UserError, match="no tokenizer file"):
        hf.load(tmp_path / "nope")


def test_manifest_names_a_missing_shard_and_a_count_that_disagrees(tmp_path, tok_dir):
    d = _inputs(tmp_path / "in")
    assert _cli(["data", "tokenize", str(d), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"),
                 "--shards", "2"]) == 0
    mpath = tmp_path / "o/manifest.json"
    good = mpath.read_text()
    raw = json.loads(good)
    raw["shards"][0]["n_tokens"] += 1
    raw["n_tokens"] += 1
    mpath.write_text(json.dumps(raw))
    with pytest.raises(UserError, match=r"shard-00000.h5: \d+ tokens but the manifest .* says"):
        manifest.read_manifest(tmp_path / "o")
    mpath.write_text(good)
    (tmp_path / "o/shard-00001.h5").unlink()
    with pytest.raises(UserError, match="shard-00001.h5 is missing.*re-run"):
        manifest.token_sources(mpath)
    with pytest.raises(UserError, match="no manifest"):
        manifest.read_manifest(tmp_path)


def test_token_sources_of_a_single_old_token_file(tmp_path):
    path = tk.write_synthetic(tmp_path / "c.h5", 100, 256)
    (src,) = manifest.token_sources(path)
    assert (src.path, src.n_tokens) == (path.resolve(), 100)
    assert tk.read_info(path).tokenizer_hash == "" and tk.read_info(path).eos_id is None


def test_bad_inputs_fail_cleanly_through_the_cli(tmp_path, tok_dir):
    (tmp_path / "x.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(UserError, match="x.jsonl:1: field 'text' is a int"):
        _cli(["data", "tokenize", str(tmp_path / "x.jsonl"), "--tokenizer", str(tok_dir), "--out",
              str(tmp_path / "o")])
    with pytest.raises(UserError, match="--eos 'nope': not a token"):
        hf.load(tok_dir, eos="nope")
    with pytest.raises(UserError, match="byte-level form IN OUT"):
        _cli(["data", "tokenize", "a", "b", "c"])
