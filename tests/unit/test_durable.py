"""dslurm.durable: the one atomic, durable write."""

from __future__ import annotations

import os
import stat

import pytest

from dslurm.durable import atomic_write_bytes, atomic_write_text


def test_replaces_content_and_leaves_no_temp_files(tmp_path):
    p = tmp_path / "x"
    atomic_write_text(p, "old")
    atomic_write_text(p, "new", mode=0o600)
    assert p.read_text() == "new" and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["x"]


def test_a_failed_write_keeps_the_old_file_and_cleans_up(tmp_path, monkeypatch):
    p = tmp_path / "pointer"
    atomic_write_bytes(p, b"generation-1")

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        atomic_write_bytes(p, b"generation-2")
    monkeypatch.undo()
    assert p.read_bytes() == b"generation-1" and os.listdir(tmp_path) == ["pointer"]


def test_secret_mode_is_set_before_content(tmp_path):
    atomic_write_bytes(tmp_path / "key", b"s3cret", mode=0o400)
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o400
