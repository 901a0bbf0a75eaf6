"""The code a job runs, frozen at submit: a snapshot of a working copy, named by its content.

`take("git")` lists what `git ls-files -co --exclude-standard` lists in the working copy that
holds the current directory: the tree at HEAD with its uncommitted edits and its untracked,
not-ignored files (what `git add -A` would commit), and the same of every git submodule, nested
ones too (`git ls-files` alone lists a submodule as one entry, no files: the job would run
without it). A submodule that is not checked out is refused by name. `take(DIR)` does the same for a git working
copy DIR, and lists every file of any other directory (less `.git`, `.venv`, `__pycache__`).
The digest covers each file's path, its executable bit and its bytes, so two snapshots with
the same digest are the same code; `materialize` copies it to `<run_dir>/code/<digest[:16]>`,
where the rendered script runs it on every start of the job, requeued ones included. A
snapshot directory counts once its marker (MARKER) is in it; it is never changed after.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dslurm.durable import atomic_write_bytes, atomic_write_text, fsync_dir
from dslurm.errors import UserError

MARKER = ".dslurm-snapshot.json"
SKIP_DIRS = frozenset({".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
GIT = "git"  # the --code value that means "the git working copy I am in"


@dataclass(frozen=True, slots=True)
class Snapshot:
    root: Path
    files: tuple[str, ...]
    """relative POSIX paths, sorted"""
    digest: str
    """sha256 hex of every file's path, executable bit and bytes"""
    source: str
    """where it came from, for a person: `git working copy /x at HEAD abc123 (+ uncommitted)`"""

    @property
    def name(self) -> str:
        """The directory name under `<run_dir>/code/`."""
        return self.digest[:16]


def digest_of(root: Path, files: Iterable[str]) -> str:
    """sha256 over (path, executable bit, length, bytes) of each file, in the given order. The
    length keeps file boundaries unambiguous."""
    h = hashlib.sha256()
    for rel in files:
        p = root / rel
        data = p.read_bytes()
        h.update(f"{rel}\0{1 if os.access(p, os.X_OK) else 0}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _git(root: Path, *args: str) -> str:
    res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise UserError(f"git {' '.join(args)} in {root} failed: {res.stderr.strip() or res.returncode}")
    return res.stdout


def git_files(root: Path) -> list[str]:
    """Tracked and untracked-not-ignored files that exist (a deleted tracked file is left out),
    of the working copy and of each of its submodules, recursively, as paths from `root`."""
    out = _git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard")
    names = {n for n in out.split("\0") if n}
    for sub in submodules(root):
        if not (root / sub / ".git").exists():
            raise UserError(f"--code git: submodule {sub} of {root} is not checked out, so the job would run "
                            f"without it. Fix: `git -C {root} submodule update --init --recursive`, then submit")
        names.discard(sub)
        names |= {f"{sub}/{n}" for n in git_files(root / sub)}
    return [n for n in sorted(names) if (root / n).is_file() and _kept(n)]


def submodules(root: Path) -> list[str]:
    """The submodule paths of a working copy: its gitlinks (mode 160000 in the index)."""
    out = _git(root, "ls-files", "-z", "-s")
    return sorted(rec.split("\t", 1)[1] for rec in out.split("\0") if rec.startswith("160000 "))


def _kept(rel: str) -> bool:
    """The same rule for both listings: a git copy and the directory ssh unpacked it into
    must list the same files, or their digests differ."""
    parts = rel.split("/")
    return not (SKIP_DIRS.intersection(parts[:-1]) or parts[-1] == MARKER or parts[-1].endswith(".pyc"))


def dir_files(root: Path) -> list[str]:
    """Every regular file under `root`, less SKIP_DIRS, compiled bytecode and the marker."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for f in filenames:
            p = Path(dirpath) / f
            if p.is_file() and _kept(p.relative_to(root).as_posix()):
                found.append(p.relative_to(root).as_posix())
    return sorted(found)


def _work_tree(path: Path) -> Path | None:
    try:
        res = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=60)
    except FileNotFoundError:  # no git here (a login node may lack it): a plain directory
        return None
    return Path(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else None


def take(spec: str, cwd: str | Path | None = None) -> Snapshot:
    """The snapshot `--code SPEC` names: `git` (the working copy holding `cwd`) or a directory."""
    base = Path(cwd or os.getcwd())
    if spec == GIT:
        root = _work_tree(base)
        if root is None:
            raise UserError(f"--code git: {base} is not inside a git working copy. Fix: run from your project's "
                            "checkout, or name the code directory with --code DIR")
    else:
        root = (base / spec).resolve()
        if not root.is_dir():
            raise UserError(f"--code {spec}: {root} is not a directory. Fix: give the directory whose code the "
                            "job runs, or --code git for the git working copy you are in")
        tree = _work_tree(root)
        root = tree if tree is not None and tree.resolve() == root else root
    is_git = (root / ".git").exists()
    files = git_files(root) if is_git else dir_files(root)
    if not files:
        raise UserError(f"--code {spec}: {root} holds no files to ship. Fix: name the directory of your code")
    source = f"directory {root}"
    if is_git:
        head = _git(root, "rev-parse", "--short", "HEAD").strip() if _has_head(root) else "(no commit)"
        dirty = _git(root, "status", "--porcelain").strip()
        source = f"git working copy {root} at HEAD {head}" + (" (+ uncommitted changes)" if dirty else "")
    return Snapshot(root=root, files=tuple(files), digest=digest_of(root, files), source=source)


def _has_head(root: Path) -> bool:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "-q", "--verify", "HEAD"],
                          capture_output=True, timeout=60).returncode == 0


def tar_bytes(snap: Snapshot, extra: dict[str, bytes] | None = None, prefix: str = "") -> bytes:
    """The snapshot as an uncompressed tar under `prefix` (plus `extra` files at the top), with
    fixed owners and times: the same code gives the same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in snap.files:
            p = snap.root / rel
            data = p.read_bytes()
            _add(tar, prefix + rel, data, 0o755 if os.access(p, os.X_OK) else 0o644)
        for name, data in (extra or {}).items():
            _add(tar, name, data, 0o644)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def marker_text(snap: Snapshot) -> str:
    return json.dumps({"digest": snap.digest, "source": snap.source, "files": len(snap.files)}, indent=1)


def materialize(snap: Snapshot, code_root: Path) -> Path:
    """`code_root/<snap.name>`: the snapshot's files, copied once (an existing complete copy
    is the same code: its name is the digest). A snapshot taken of that very directory (the
    remote side, where ssh unpacked it) is checked against its name and marked complete."""
    dest = code_root / snap.name
    if snap.root.resolve() == dest.resolve():
        if not (dest / MARKER).is_file():
            atomic_write_text(dest / MARKER, marker_text(snap))
        return dest
    if snap.root.resolve().parent == code_root.resolve():
        raise UserError(f"{snap.root}: its content has digest {snap.digest[:16]}, not the name it was shipped "
                        "under (changed or cut short on the way). Fix: submit again")
    if (dest / MARKER).is_file():
        return dest
    code_root.mkdir(parents=True, exist_ok=True)
    stage = code_root / f".{snap.name}.{os.getpid()}.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    for rel in snap.files:
        src = snap.root / rel
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(stage / rel, src.read_bytes(), 0o755 if os.access(src, os.X_OK) else 0o644)
    atomic_write_text(stage / MARKER, marker_text(snap))  # last: the copy is whole
    shutil.rmtree(dest, ignore_errors=True)  # an incomplete copy (no marker) of an earlier try
    os.rename(stage, dest)
    fsync_dir(code_root)
    return dest
