"""`dslurm data tokenize --slurm`: a 3-task job array on the real local cluster, one task
SIGKILLed mid-shard (DSLURM_FAULT_TOKENIZE_KILL; sbatch exports the submitting environment),
then the same command again: it redoes only that task's shard, and the shards' tokens
concatenated equal a single-process tokenization of the same inputs."""

from __future__ import annotations

import json

import numpy as np
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
    for f in range(6):  # 2 files per task
        lines = [json.dumps({"text": " ".join(WORDS[(f + d) % 7:(f + d) % 7 + 5])}) for d in range(20)]
        (data / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
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
