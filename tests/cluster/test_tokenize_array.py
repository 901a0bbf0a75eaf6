"""`dslurm data tokenize --slurm`: a 3-task job array on the real local cluster over a folder of
mixed inputs (.jsonl.gz, .jsonl.zst, a .json array, a .json of lines, a parquet of 3 row groups
and a plain .jsonl large enough to be cut into byte ranges across shards), one task SIGKILLed
mid-shard (DSLURM_FAULT_TOKENIZE_KILL; sbatch exports the submitting environment); `data info`
shows the progress per task; then the same command again: it redoes only that task's shard,
and the shards' tokens concatenated equal a single-process tokenization of the same inputs."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from dslurm.data import manifest
from dslurm.data import tokenize as tk
from testkit import load_scaled

WORDS = "the cat sat on a mat while the dog ran over green hills and far away".split()


def _tokenizer(path):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(path))


def _tokens(out):
    return np.concatenate([tk.TokenFile(s.path).window(0, s.n_tokens) for s in manifest.token_sources(out)])


def test_killed_task_is_the_only_shard_a_rerun_redoes(slurm_cluster, cli, tmp_path):
    _tokenizer(tmp_path / "tokenizer.json")
    data = tmp_path / "data"
    data.mkdir()
    def texts(f, n=20):
        return [" ".join(WORDS[(f + d) % 7:(f + d) % 7 + 5]) for d in range(n)]

    def lines(f, n=20):
        return "".join(json.dumps({"text": t}) + "\n" for t in texts(f, n))

    (data / "part-0.jsonl.gz").write_bytes(gzip.compress(lines(0).encode()))
    (data / "part-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(1).encode()))
    (data / "part-2.json").write_text(json.dumps([{"text": t} for t in texts(2)]))
    (data / "part-3.json").write_text(lines(3))
    pq.write_table(pa.table({"text": texts(4, 21)}), data / "part-4.parquet", row_group_size=7)
    (data / "part-5.jsonl").write_text(lines(5, 200))  # half the bytes: cut into byte ranges
    out = tmp_path / "tok"
    argv = ["data", "tokenize", str(data), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(out),
            "--shards", "3", "--slurm", "--site", "site-configs/local.yaml", "--concurrency", "3", "--wait"]
    timeout = load_scaled(120, procs=3)

    first = cli(*argv, env={**slurm_cluster.env(), "DSLURM_FAULT_TOKENIZE_KILL": "1"}, timeout=timeout)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "shards 1 are not done" in first.stderr
    assert sorted(p.name for p in out.glob("shard-*.h5")) == ["shard-00000.h5", "shard-00002.h5"]
    assert list(out.glob(".shard-00001.h5.*.tmp")), "task 1 was killed mid-shard: its temp file stays"
    assert not (out / "manifest.json").exists()
    plan = json.loads((out / "plan.json").read_text())
    cut = [f["range"] for s in plan["shards"] for f in s["inputs"] if f["path"].endswith("part-5.jsonl")]
    assert len(cut) >= 2, "the large jsonl is read as byte ranges by more than one shard"
    assert "export RAYON_NUM_THREADS=1" in (out / "tokenize.sbatch").read_text()
    info = cli("data", "info", str(out), timeout=timeout)
    assert info.returncode == 0, info.stdout + info.stderr
    assert "2 of 3 shards done (no manifest yet)" in info.stdout and "task     0  done" in info.stdout
    assert "task     1  running" in info.stdout  # its last word before the SIGKILL
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard-*.h5")}

    second = cli(*argv, env=slurm_cluster.env(), timeout=timeout)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "skipped: 0,2" in second.stdout and "submitting shards 1 as one job array" in second.stdout
    assert "#SBATCH --array=1%3" in (out / "tokenize.sbatch").read_text()
    assert {n: (out / n).stat().st_ino for n in kept} == {n: v[0] for n, v in kept.items()}
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == {n: v[1] for n, v in kept.items()}
    assert not list(out.glob(".*.tmp"))

    single = cli("data", "tokenize", str(data), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(tmp_path / "one"), timeout=timeout)
    assert single.returncode == 0, single.stdout + single.stderr
    np.testing.assert_array_equal(_tokens(out), _tokens(tmp_path / "one"))
    assert manifest.read_manifest(out).n_tokens == manifest.read_manifest(tmp_path / "one").n_tokens
