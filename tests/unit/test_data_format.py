"""The HDF5 token file: writers, reader, atomicity, and the `dslurm data` CLI."""

from __future__ import annotations

import argparse
import subprocess
import sys

import h5py
import numpy as np
import pytest

from dslurm.data import cli as data_cli
from dslurm.data import tokenize as tk
from dslurm.errors import UserError


def test_synthetic_round_trip_through_hdf5(tmp_path):
    path = tk.write_synthetic(tmp_path / "c.h5", 5000, 256, seed=7, seq_len=64)
    info = tk.read_info(path)
    assert (info.n_tokens, info.vocab_size, info.seq_len, info.dtype) == (5000, 256, 64, "uint16")
    assert "seed=7" in info.source and info.created.endswith("+00:00")
    assert info.samples(64) == (5000 - 1) // 64
    f = tk.TokenFile(path)
    want = tk.synthetic_tokens(5000, 256, 7)
    np.testing.assert_array_equal(f.window(0, 5000), want)
    np.testing.assert_array_equal(f.window(4000, 65), want[4000:4065])
    with pytest.raises(IndexError):
        f.window(4990, 65)
    f.close()


def test_synthetic_corpus_is_deterministic_and_seeded(tmp_path):
    a = tk.TokenFile(tk.write_synthetic(tmp_path / "a.h5", 3000, 256, seed=1)).window(0, 3000)
    b = tk.TokenFile(tk.write_synthetic(tmp_path / "b.h5", 3000, 256, seed=1)).window(0, 3000)
    c = tk.synthetic_tokens(3000, 256, seed=2)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5
    assert a.min() >= 0 and a.max() < 256


def test_synthetic_corpus_is_learnable():
    """Bigram conditional entropy far below ln(V): a model has something to learn."""
    x, v = tk.synthetic_tokens(200_000, 256, seed=0), 256
    counts = np.zeros((v, v))
    np.add.at(counts, (x[:-1], x[1:]), 1)
    p = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    h = -(counts * np.log(np.where(p > 0, p, 1))).sum() / counts.sum()
    assert h < 1.2 < np.log(v)  # ~0.84 nats against 5.55 for uniform tokens


def test_dtype_follows_the_vocabulary(tmp_path):
    assert tk.dtype_for(256) == np.uint16 and tk.dtype_for(65536) == np.uint16
    assert tk.dtype_for(65537) == np.uint32
    path = tk.write_synthetic(tmp_path / "big.h5", 1000, 128256, seed=0)
    assert tk.read_info(path).dtype == "uint32"
    assert tk.TokenFile(path).window(0, 1000).max() >= 65536


def test_tokenize_text_is_byte_level(tmp_path):
    text = "héllo, wörld\n" * 50
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    path = tk.tokenize_text(tmp_path / "in.txt", tmp_path / "out.h5", chunk_bytes=7)
    info = tk.read_info(path)
    raw = text.encode()
    assert (info.vocab_size, info.n_tokens) == (256, len(raw))
    assert bytes(tk.TokenFile(path).window(0, len(raw)).astype(np.uint8)) == raw
    with pytest.raises(UserError, match="no such file"):
        tk.tokenize_text(tmp_path / "missing.txt", tmp_path / "x.h5")


def test_failed_write_leaves_neither_file_nor_temp(tmp_path):
    target = tmp_path / "bad.h5"
    with pytest.raises(ValueError, match="token id 300 >= vocab_size 256"):
        tk._write_atomic(target, [np.array([1, 2, 300])], vocab_size=256, seq_len=0, source="t")
    assert list(tmp_path.iterdir()) == []
    tk.write_synthetic(target, 100, 256)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.h5"]  # the temp file was renamed


def test_malformed_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such token file.*dslurm data synth"):
        tk.read_info(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="not a readable HDF5"):
        tk.read_info(tmp_path / "text.h5")
    with h5py.File(tmp_path / "float.h5", "w") as f:
        f.create_dataset("tokens", data=np.zeros(10, dtype=np.float32))
        f.attrs["vocab_size"] = 256
    with pytest.raises(UserError, match="float32"):
        tk.read_info(tmp_path / "float.h5")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dslurm")
    data_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_synth_tokenize_info(tmp_path, capsys):
    out = tmp_path / "s.h5"
    assert _cli(["data", "synth", str(out), "--tokens", "4096", "--vocab", "512", "--seed", "3",
                 "--seq-len", "64"]) == 0
    assert "4,096" in capsys.readouterr().out
    assert tk.read_info(out).vocab_size == 512
    (tmp_path / "t.txt").write_bytes(b"abcdef" * 10)
    assert _cli(["data", "tokenize", str(tmp_path / "t.txt"), str(tmp_path / "t.h5")]) == 0
    assert _cli(["data", "info", str(tmp_path / "t.h5")]) == 0
    printed = capsys.readouterr().out
    assert "vocab_size  256" in printed and "tokens      60 " in printed
    with pytest.raises(UserError, match="--tokens 1"):
        _cli(["data", "synth", str(out), "--tokens", "1", "--vocab", "256"])
    with pytest.raises(UserError, match="no such token file"):
        _cli(["data", "info", str(tmp_path / "missing.h5")])


def test_cli_module_is_light_to_import():
    code = ("import sys, dslurm.data.cli; bad = {'torch', 'h5py', 'dslurm.data.tokenize'} & "
            "set(sys.modules); sys.exit(f'imported {bad}' if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
