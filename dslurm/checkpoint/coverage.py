"""Whole-file crc32s from the byte ranges a restore read (torch-free, pure except `read_crc`).

Why: restore used to read every shard twice, once to check its crc32 against the manifest and
once more in `dcp.load`. Now each rank checksums the byte ranges DCP reads while it reads them
(`dslurm.checkpoint.io.CrcReader`), and the manifest's whole-file crc32 is rebuilt from those
ranges. A rank reads only part of a file when the layout changed (or a replicated item lives in
another rank's file), so a file's bytes may come from several ranks: each rank keeps *runs*
(contiguous ranges read in order, one running crc32, with the crc32 of the run's prefix at each
item boundary), the runs are gathered, and a chain of pieces is picked that tiles the file. Bytes
that nobody read (an item nobody asked for) are *gaps*, read once more by one rank. Pieces are
joined with crc32_combine (zlib's algorithm; Python's zlib does not expose it).
"""

from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

_POLY = 0xEDB88320  # crc32's polynomial, reflected
_CHUNK = 8 << 20
SHARD_SUFFIX = ".distcp"  # DCP's data files (__<rank>_<i>.distcp); everything else is small


def is_shard(name: str) -> bool:
    return name.endswith(SHARD_SUFFIX)


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the crc32 polynomial (reflected bit order), as in zlib's crc32.c."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial: x^1, x^2, x^4, ...
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _shift(crc: int, nbytes: int) -> int:
    """crc multiplied by x^(8 * nbytes): what appending nbytes of zeros does to a (raw) crc."""
    p, n, k = 1 << 31, nbytes, 3  # x^0; bytes -> bits is k = 3 doublings
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and len(B)."""
    return _shift(crc1, len2) ^ crc2


def crc32_suffix(crc_ab: int, crc_a: int, len_b: int) -> int:
    """crc32(B) from crc32(A + B), crc32(A) and len(B): crc_ab = shift(crc_a) ^ crc_b."""
    return crc_ab ^ _shift(crc_a, len_b)


@dataclass
class Run:
    """Bytes [start, end) of one file read in order by one rank. `marks` holds (offset, crc32 of
    [start, offset)) at each item boundary after start, the last one being (end, crc32 of it all)."""

    start: int
    marks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.marks[-1][0] if self.marks else self.start

    @property
    def crc(self) -> int:
        return self.marks[-1][1] if self.marks else 0


class RangeSums:
    """What one rank read: file name -> runs. A read contiguous with the last run extends it, so
    a rank reading a whole file in order ends with one run whose crc32 is the file's."""

    def __init__(self) -> None:
        self.runs: dict[str, list[Run]] = {}

    def covered(self, name: str, start: int, end: int) -> bool:
        return any(r.start <= start and end <= r.end for r in self.runs.get(name, ()))

    def prior(self, name: str, offset: int) -> int:
        """The crc32 to continue from for bytes starting at offset: the last run's when it ends
        there, else 0 (a new run starts)."""
        runs = self.runs.get(name)
        return runs[-1].crc if runs and runs[-1].end == offset else 0

    def record(self, name: str, start: int, end: int, crc: int) -> None:
        """Bytes [start, end) were read; crc continues from prior(name, start)."""
        if end <= start:
            return
        runs = self.runs.setdefault(name, [])
        if runs and runs[-1].end == start:
            runs[-1].marks.append((end, crc))
        else:
            runs.append(Run(start, [(end, crc)]))

    def add(self, name: str, offset: int, data: bytes | memoryview) -> None:
        end = offset + len(data)
        if not self.covered(name, offset, end):  # else: one stored item asked for twice
            self.record(name, offset, end, zlib.crc32(data, self.prior(name, offset)))

    def export(self) -> dict[str, list[tuple[int, list[tuple[int, int]]]]]:
        """Plain tuples, for all_gather_object."""
        return {n: [(r.start, list(r.marks)) for r in rs] for n, rs in self.runs.items()}


Gathered = list[dict[str, list[tuple[int, list[tuple[int, int]]]]]]  # one export() per rank


def _points(runs: list[Run]) -> dict[int, list[tuple[Run, int]]]:
    """offset -> [(run, crc32 of the run's prefix up to that offset)], ends excluded."""
    out: dict[int, list[tuple[Run, int]]] = {}
    for r in runs:
        out.setdefault(r.start, []).append((r, 0))
        for off, crc in r.marks[:-1]:
            out.setdefault(off, []).append((r, crc))
    return out


def _runs_of(gathered: Gathered, name: str) -> list[Run]:
    return [Run(start, list(marks)) for per_rank in gathered for start, marks in per_rank.get(name, [])]


def tile(size: int, runs: list[Run]) -> list[tuple[int, int, int | None]]:
    """Pieces (start, end, crc32 or None for a gap to read) that cover [0, size) in order. At
    each position the run reaching furthest is taken; with none starting or having an item
    boundary there, the bytes up to the next such point are a gap."""
    points = _points([r for r in runs if r.end <= size])
    offsets = sorted(points)
    out: list[tuple[int, int, int | None]] = []
    pos = 0
    while pos < size:
        here = points.get(pos)
        if here:
            run, prefix = max(here, key=lambda rp: rp[0].end)
            out.append((pos, run.end, crc32_suffix(run.crc, prefix, run.end - pos)))
            pos = run.end
            continue
        i = bisect.bisect_right(offsets, pos)
        nxt = min(offsets[i], size) if i < len(offsets) else size
        out.append((pos, nxt, None))
        pos = nxt
    return out


def plan_gaps(sizes: dict[str, int], gathered: Gathered) -> list[tuple[str, int, int]]:
    """(file, start, end) of every byte range nobody read, in a fixed order (every rank computes
    the same list from the same gathered runs and reads its share of it)."""
    return [(name, s, e) for name, size in sorted(sizes.items())
            for s, e, crc in tile(size, _runs_of(gathered, name)) if crc is None]


def whole_crcs(sizes: dict[str, int], gathered: Gathered,
               gap_crcs: dict[tuple[str, int, int], int]) -> dict[str, int]:
    """The crc32 of each file from the runs and the gaps' crcs."""
    out = {}
    for name, size in sorted(sizes.items()):
        total = 0
        for s, e, crc in tile(size, _runs_of(gathered, name)):
            total = crc32_combine(total, gap_crcs[(name, s, e)] if crc is None else crc, e - s)
        out[name] = total
    return out


def read_crc(path: Path, start: int, end: int) -> int:
    """crc32 of bytes [start, end) of a file; OSError if it holds fewer."""
    crc, pos = 0, start
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while pos < end:
            data = f.read(min(_CHUNK, end - pos))
            if not data:
                raise OSError(f"{path}: ends at {pos}, expected {end} bytes")
            crc = zlib.crc32(data, crc)
            pos += len(data)
    return crc


class Comm(Protocol):
    """Object collectives (dslurm.checkpoint.core.Comm): gather is an all-gather."""

    rank: int
    world: int

    def gather(self, obj: Any) -> list[Any]: ...

    def bcast(self, obj: Any) -> Any: ...


def verify_reads(comm: Comm, gen: Path, entries: dict[str, dict[str, Any]],
                 sums: RangeSums) -> tuple[list[str], int]:
    """Collective, after a load through CrcReader on every rank: the crc32 of every shard file
    listed in the manifest, from the runs every rank read plus the gaps (split across ranks),
    compared with the manifest on rank 0. Returns (problems, the same on every rank; bytes this
    rank read again for gaps). Problems name the file as dslurm.checkpoint.file_problems does."""
    sizes = {n: int(e["size"]) for n, e in entries.items() if is_shard(n)}
    gathered = comm.gather(sums.export())
    mine: dict[tuple[str, int, int], int] = {}
    errors, reread = [], 0
    for name, s, e in plan_gaps(sizes, gathered)[comm.rank::comm.world]:
        try:
            mine[(name, s, e)] = read_crc(gen / name, s, e)
            reread += e - s
        except OSError as exc:
            errors.append(f"{gen / name}: unreadable at {s}..{e} ({exc})")
    results = comm.gather((mine, errors))
    verdict: list[str] | None = None
    if comm.rank == 0:
        gap_crcs = {k: v for got, _ in results for k, v in got.items()}
        verdict = [p for _, errs in results for p in errs]
        bad = {p.split(": unreadable", 1)[0] for p in verdict}
        whole = whole_crcs({n: s for n, s in sizes.items() if str(gen / n) not in bad}, gathered, gap_crcs)
        for name, crc in whole.items():
            if f"{crc:08x}" != entries[name]["crc32"]:
                verdict.append(f"{gen / name}: crc32 {crc:08x} != {entries[name]['crc32']} "
                               "in manifest (altered)")
        verdict.sort()
    return comm.bcast(verdict), reread
