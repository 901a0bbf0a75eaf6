"""The code snapshot (dslurm/remote/snapshot.py): which files, the digest, the copy, and the
rendered script that runs it on every start."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from dslurm.errors import UserError
from dslurm.remote.snapshot import MARKER, materialize, take, tar_bytes

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


def _repo(tmp_path: Path) -> Path:
    wc = tmp_path / "wc"
    (wc / "pkg").mkdir(parents=True)
    (wc / "pkg" / "mod.py").write_text("X = 1\n")
    (wc / ".gitignore").write_text("ignored.txt\n")
    (wc / "run.sh").write_text("#!/bin/sh\n")
    (wc / "run.sh").chmod(0o755)
    subprocess.run([*GIT, "-C", str(wc), "init", "-q"], check=True)
    subprocess.run([*GIT, "-C", str(wc), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(wc), "commit", "-q", "-m", "one"], check=True)
    return wc


def test_git_snapshot_is_head_plus_uncommitted_and_untracked_not_ignored(tmp_path):
    wc = _repo(tmp_path)
    (wc / "pkg" / "mod.py").write_text("X = 2\n")  # uncommitted edit
    (wc / "new.py").write_text("Y = 1\n")  # untracked
    (wc / "ignored.txt").write_text("no\n")
    (wc / "pkg" / "__pycache__").mkdir()
    (wc / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    snap = take("git", wc / "pkg")  # from a subdirectory: the whole working copy
    assert snap.root == wc
    assert snap.files == (".gitignore", "new.py", "pkg/mod.py", "run.sh")
    assert "uncommitted" in snap.source and len(snap.name) == 16


def test_digest_follows_content_and_exec_bit_not_time(tmp_path):
    wc = _repo(tmp_path)
    a = take("git", wc).digest
    (wc / "pkg" / "mod.py").touch()
    assert take("git", wc).digest == a
    (wc / "run.sh").chmod(0o644)
    b = take("git", wc).digest
    assert b != a
    (wc / "pkg" / "mod.py").write_text("X = 3\n")
    assert take("git", wc).digest not in (a, b)


def test_materialize_copies_once_and_the_shipped_copy_hashes_the_same(tmp_path):
    wc = _repo(tmp_path)
    snap = take("git", wc)
    dest = materialize(snap, tmp_path / "run" / "code")
    assert dest.name == snap.name and (dest / MARKER).is_file() and (dest / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert (dest / "run.sh").stat().st_mode & 0o100
    (wc / "pkg" / "mod.py").write_text("X = 9\n")  # the working copy moves on; the copy does not
    assert (dest / "pkg" / "mod.py").read_text() == "X = 1\n"
    again = take(str(dest), tmp_path)  # the remote side: a plain directory, named by its digest
    assert again.digest == snap.digest and again.files == snap.files
    assert materialize(again, tmp_path / "run" / "code") == dest


def test_a_shipped_copy_that_does_not_match_its_name_is_refused(tmp_path):
    code = tmp_path / "run" / "code" / "0123456789abcdef"
    code.mkdir(parents=True)
    (code / "a.py").write_text("A = 1\n")
    with pytest.raises(UserError, match="not the name it was shipped under"):
        materialize(take(str(code)), tmp_path / "run" / "code")


def test_tar_holds_the_files_under_the_prefix_and_extras(tmp_path):
    wc = _repo(tmp_path)
    snap = take("git", wc)
    data = tar_bytes(snap, {"submit/job.yaml": b"name: x\n"}, prefix=f"code/{snap.name}/")
    assert data == tar_bytes(snap, {"submit/job.yaml": b"name: x\n"}, prefix=f"code/{snap.name}/")  # deterministic
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert f"code/{snap.name}/pkg/mod.py" in names and "submit/job.yaml" in names


def test_code_git_outside_a_working_copy_names_the_fix(tmp_path):
    with pytest.raises(UserError, match="not inside a git working copy.*--code DIR"):
        take("git", tmp_path)
    with pytest.raises(UserError, match="is not a directory"):
        take(str(tmp_path / "nope"), tmp_path)


def test_rendered_script_runs_the_snapshot_on_every_start(tmp_path, root, monkeypatch):
    from dslurm.config.resolve import load
    from dslurm.submission import submit

    wc = _repo(tmp_path)
    monkeypatch.chdir(wc)
    r = load(root / "site-configs/local.yaml", root / "examples/jobs/tiny-2node.yaml",
             [f"checkpoint.run_dir={tmp_path / 'run'}"], base_dir=wc)
    sub = submit(r, dry_run=True, code="git")
    code = tmp_path / "run" / "code" / take("git", wc).name
    text = sub.script.read_text()
    assert f"\ncd {code}\n" in text and f'export PYTHONPATH={code}"${{PYTHONPATH:+:$PYTHONPATH}}"' in text
    assert text.index(f"cd {code}") > text.index("set -u")  # after the site's setup, before the step
    assert text.index(f"cd {code}") < text.index("srun ")
    assert (code / "pkg" / "mod.py").is_file()
    if subprocess.run(["which", "shellcheck"], capture_output=True).returncode == 0:
        lint = subprocess.run(["shellcheck", str(sub.script)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


def test_git_submodules_ship_with_the_code_and_one_not_checked_out_is_refused(tmp_path):
    # `git ls-files` lists a submodule as one gitlink entry: the snapshot shipped only .gitmodules.
    lib = tmp_path / "lib"
    (lib / "inner").mkdir(parents=True)
    (lib / "inner" / "util.py").write_text("Z = 3\n")
    subprocess.run([*GIT, "-C", str(lib), "init", "-q"], check=True)
    subprocess.run([*GIT, "-C", str(lib), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(lib), "commit", "-q", "-m", "lib"], check=True)
    wc = _repo(tmp_path)
    subprocess.run([*GIT, "-c", "protocol.file.allow=always", "-C", str(wc), "submodule", "add", "-q", str(lib),
                    "third_party/lib"], check=True)
    subprocess.run([*GIT, "-C", str(wc), "commit", "-q", "-m", "sub"], check=True)
    (wc / "third_party" / "lib" / "local_edit.py").write_text("W = 4\n")  # untracked inside the submodule
    snap = take("git", wc)
    assert {"third_party/lib/inner/util.py", "third_party/lib/local_edit.py", ".gitmodules"} <= set(snap.files)
    assert "third_party/lib" not in snap.files
    dest = materialize(snap, tmp_path / "code")
    assert (dest / "third_party" / "lib" / "inner" / "util.py").read_text() == "Z = 3\n"
    assert take(str(dest)).digest == snap.digest  # the shipped copy (no .git) hashes the same
    clone = tmp_path / "clone"
    subprocess.run([*GIT, "clone", "-q", str(wc), str(clone)], check=True)  # submodule left uninitialised
    with pytest.raises(UserError, match="submodule third_party/lib .* not checked out.*submodule update --init"):
        take("git", clone)
