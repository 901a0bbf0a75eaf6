"""Partner copies, the in-job half (imports torch): a node's locally committed files sent to the
next node's local tier after each local commit, and a lost node's files pulled back from there at
a restore, rank to rank over a gloo group of the checkpoint's own (docs/checkpoint.md, "Partner
copies"; the layout and the choices are dslurm.checkpoint.replica's).

The bytes go through the job's processes, never through a path on another node: a node's scratch
is its own (a real node-local NVMe is not mounted anywhere else). Each transfer is a stream of
chunks (`CHUNK` bytes, 16 MiB, one buffer per peer at a time: memory is bounded whatever the state's
size) sent with isend/irecv in rounds every rank walks in the same order, so no pair waits on
another. The receiver computes each file's crc32 from the bytes as they arrive and compares it
with the sender's local commit record; only then is the record written beside the files, last:
a copy cut short (a kill -9 mid-transfer) has no record and is never used.
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dslurm import checkpoint as ck
from dslurm import faults
from dslurm.checkpoint import replica, tiers
from dslurm.checkpoint.core import Comm, reason

log = logging.getLogger(__name__)

CHUNK = 16 << 20


@dataclass
class Stream:
    """The files one rank sends to (or receives from) one peer: directory, {name: {"size", "crc32"}}."""

    peer: int
    root: Path
    files: dict[str, dict[str, Any]]
    pieces: list[tuple[str, int, int]] = field(default_factory=list)  # (name, offset, length)

    def __post_init__(self) -> None:
        for name in sorted(self.files):
            size = int(self.files[name]["size"])
            self.pieces += [(name, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]


@dataclass
class Transfer:
    """What one rank moved: bytes sent, seconds, and the problems of what it received."""

    sent: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def exchange(comm: Comm, sends: list[Stream], recvs: list[Stream], *, mbps: float = 0.0,
             after_first: Callable[[], None] = lambda: None) -> Transfer:
    """Collective over the ranks that appear in some stream: every rank walks rounds 0, 1, ...;
    in round k it posts the k-th piece of each of its streams (isend, irecv) and waits for them.
    A sender that cannot read sends zeros (the receiver's crc32 says so); a receiver never breaks
    the rounds, it records problems. `mbps` > 0 caps each rank's send rate."""
    assert comm.group is not None, "partner copies need a process group"
    t0, out = time.monotonic(), Transfer()
    crcs: dict[tuple[int, str], int] = {}
    handles: dict[tuple[int, str], Any] = {}
    rounds = max([len(s.pieces) for s in sends + recvs], default=0)
    for s in recvs:
        for name in s.files:
            (s.root / name).parent.mkdir(parents=True, exist_ok=True)
            (s.root / name).write_bytes(b"")  # every file exists, the empty ones too
    try:
        for k in range(rounds):
            ops, bufs = [], []
            for s in sends:
                if k < len(s.pieces):
                    buf = _read_piece(s, *s.pieces[k], out)
                    ops.append(dist.isend(buf, dst=s.peer, group=comm.group))
                    out.sent += buf.numel()
            for s in recvs:
                if k < len(s.pieces):
                    buf = torch.empty(s.pieces[k][2], dtype=torch.uint8)
                    ops.append(dist.irecv(buf, src=s.peer, group=comm.group))
                    bufs.append((s, s.pieces[k], buf))
            for op in ops:
                if op is not None:  # None: a rank outside the group (never here)
                    op.wait()
            for s, (name, _, _), buf in bufs:
                raw = buf.numpy().data
                if (s.peer, name) not in handles:
                    handles[(s.peer, name)] = open(s.root / name, "ab")  # noqa: SIM115 - closed below
                handles[(s.peer, name)].write(raw)
                crcs[(s.peer, name)] = zlib.crc32(raw, crcs.get((s.peer, name), 0))
            if k == 0:
                after_first()
            if mbps > 0:
                ahead = out.sent / (mbps * 1e6) - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    finally:
        for f in handles.values():
            f.close()
    for s in recvs:
        for name, entry in sorted(s.files.items()):
            got = f"{crcs.get((s.peer, name), 0):08x}"
            path = s.root / name
            try:
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                size = path.stat().st_size
            except OSError as exc:
                out.problems.append(f"{path}: {reason(exc)}")
                continue
            if (size, got) != (int(entry["size"]), entry["crc32"]):
                out.problems.append(f"{path}: size {size} crc32 {got} != {entry['size']} {entry['crc32']} "
                                    f"committed by rank {s.peer}")
    for d in {p.parent for s in recvs for p in (s.root / n for n in s.files)}:
        ck.fsync_dir(d)
    out.seconds = time.monotonic() - t0
    return out


def _read_piece(s: Stream, name: str, off: int, length: int, out: Transfer) -> torch.Tensor:
    buf = torch.empty(length, dtype=torch.uint8)
    try:
        with open(s.root / name, "rb", buffering=0) as f:
            f.seek(off)
            view = buf.numpy().data.cast("B")
            got = 0
            while got < length and (n := f.readinto(view[got:])):
                got += n
    except OSError as exc:  # the receiver's crc32 will not match: zeros go instead
        buf.zero_()
        if off == 0:
            out.problems.append(f"{s.root / name}: unreadable, not sent ({reason(exc)})")
    return buf


def files_of(rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The files a local commit record vouches for (its `files`)."""
    return dict(rec["files"])


def push(comm: Comm, groups: list[list[int]], local_gen: Path, partner_gen: Path, rec: tiers.LocalRecord,
         *, mbps: float, nth: int) -> tuple[str, Transfer]:
    """After a local commit (collective, on the flight's group): send this rank's committed files to
    its ring partner and receive its predecessor's into `partner_gen`; the senders' records are
    written last, once every rank received everything intact. -> (error or "", this rank's transfer)."""
    r = comm.rank
    recs = comm.gather(rec.to_json())
    pairs = replica.ring(groups)
    sends = [Stream(pairs[r], local_gen, files_of(recs[r]))] if r in pairs else []
    recvs = [Stream(s, partner_gen, files_of(recs[s])) for s, d in sorted(pairs.items()) if d == r]
    err = ""
    try:
        xfer = exchange(comm, sends, recvs, mbps=mbps,
                        after_first=lambda: faults.ckpt_kill("mid_partner", r, nth))
        err = "; ".join(xfer.problems)
    except Exception as exc:
        xfer, err = Transfer(), reason(exc)
    errors = [e for e in comm.gather(err) if e]
    if errors:
        return errors[0], xfer
    try:
        for s in recvs:
            (partner_gen / tiers.LOCAL).mkdir(exist_ok=True)
            ck.atomic_write_json(tiers.record_path(partner_gen, s.peer), recs[s.peer])
    except OSError as exc:
        err = reason(exc)
    errors = [e for e in comm.gather(err) if e]
    return (errors[0] if errors else ""), xfer


def pull(comm: Comm, cand: replica.Candidate, local_dir: Path, records: dict[int, dict[str, Any]]
         ) -> tuple[list[str], Transfer]:
    """A restore's pulls (collective): each rank in `cand.pulls` receives its files from the copy
    its holder's node keeps (replica.copy_root) into its own local tier and, once they check out,
    writes its record there; `records` are the holders' copies of those records (gathered).
    -> (this rank's problems, transfer)."""
    r, name = comm.rank, cand.name
    sends = [Stream(dst, ck.generations_dir(replica.copy_root(local_dir, kind)) / name, files_of(records[dst]))
             for dst, (h, kind) in sorted(cand.pulls.items()) if h == r]
    gen = ck.generations_dir(local_dir) / name
    recvs = [Stream(cand.pulls[r][0], gen, files_of(records[r]))] if r in cand.pulls else []
    try:
        xfer = exchange(comm, sends, recvs)
    except Exception as exc:
        xfer = Transfer(problems=[reason(exc)])
    problems = list(xfer.problems) if recvs else []
    if recvs and not problems:
        rec = dict(records[r])
        rec["committed_t"] = time.time()
        try:
            (gen / tiers.LOCAL).mkdir(exist_ok=True)
            ck.atomic_write_json(tiers.record_path(gen, r), rec)
        except OSError as exc:
            problems.append(f"{tiers.record_path(gen, r)}: {reason(exc)}")
    return problems, xfer
