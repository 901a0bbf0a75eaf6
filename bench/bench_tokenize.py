"""Tokenization tokens/s per process: `dslurm data tokenize` (one shard, here) against calling
`tokenizers`' batch encode directly on the same files (goal >= 0.8x).

The corpus is generated (jsonl, --mb MB of word salad over a fixed vocabulary) and a BPE
tokenizer is trained on a sample of it (nothing is downloaded), or --tokenizer names one.
Both sides read the same jsonl files and parse each line with json; the baseline then calls
`Tokenizer.encode_batch` / `encode_batch_fast` on the same ~1 MB batches and keeps the ids in
memory; dslurm also concatenates them with the separators and writes the HDF5 shard (fsync,
rename) and the manifest. The sides alternate, --runs times each; medians are compared.
Both get the same TOKENIZERS_PARALLELISM (default: the library's own, i.e. all cores).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_tokenize.py [--mb 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from dslurm.data import hf, shards, sources


def make_corpus(d: Path, mb: int, files: int = 4) -> list[Path]:
    rng = np.random.default_rng(0)
    words = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 9))) for _ in range(5000)]
    out = []
    for f in range(files):
        path = d / f"part-{f}.jsonl"
        with open(path, "w") as fh:
            size = 0
            while size < mb * 1e6 / files:
                n = int(rng.integers(50, 400))
                line = json.dumps({"text": " ".join(words[i] for i in rng.zipf(1.2, n) % 5000)}) + "\n"
                fh.write(line)
                size += len(line)
        out.append(path)
    return out


def train_tokenizer(path: Path, sample: list[Path]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    docs = [d for b in sources.batches(sample[:1]) for d in b][:2000]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    tok.save(str(path))


def direct(tok_path: Path, files: list[Path], fast: bool) -> tuple[float, int]:
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer.from_file(str(tok_path))
    n = 0
    for batch in sources.batches(files):
        encs = tok.encode_batch_fast(batch) if fast else tok.encode_batch(batch)
        n += sum(len(e.ids) for e in encs)
    return time.perf_counter() - t0, n


def dslurm_side(tok_path: Path, files: list[Path], out: Path) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    _, info = hf.load(tok_path)
    plan = shards.make_plan(files, info, 1, shards.Options())
    shards.write_plan(out, plan)
    shards.run_local(out, [0])
    from dslurm.data.manifest import read_manifest

    n = read_manifest(out).n_tokens
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=20, help="corpus size in MB (default 20)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        files = make_corpus(d, args.mb)
        tok_path = Path(args.tokenizer) if args.tokenizer else d / "tokenizer.json"
        if not args.tokenizer:
            train_tokenizer(tok_path, files)
        res: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [], "dslurm": []}
        counts = set()
        for _ in range(args.runs):
            for name, fn in (("encode_batch", lambda: direct(tok_path, files, False)),
                             ("encode_batch_fast", lambda: direct(tok_path, files, True)),
                             ("dslurm", lambda: dslurm_side(tok_path, files, d / "out"))):
                secs, n = fn()
                res[name].append(n / secs)
                counts.add(n)
        assert len(counts) == 1, f"token counts differ: {counts}"
        print(f"corpus {args.mb} MB jsonl in {len(files)} files, {counts.pop():,} tokens, "
              f"{args.runs} runs each, medians")
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in med.items():
            print(f"  {k:<18} {v / 1e6:6.2f} M tokens/s")
        for base in ("encode_batch", "encode_batch_fast"):
            print(f"  dslurm / {base:<18} {med['dslurm'] / med[base]:.2f}x (goal >= 0.8x)")


if __name__ == "__main__":
    main()
