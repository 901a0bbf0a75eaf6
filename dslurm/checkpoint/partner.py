"""Partner copies, the in-job half (imports torch): a node's locally committed files sent to the
next node's local tier after each local commit, and a lost node's files pulled back from there at
a restore, rank to rank over a gloo group of the checkpoint's own (docs/checkpoint.md, "Partner
copies"; the layout and the choices are dslurm.checkpoint.replica's).

The bytes go through the job's processes, never through a path on another node: a node's scratch
is its own (a real node-local NVMe is not mounted anywhere else). Each transfer is a stream of
messages (at most `CHUNK` bytes, 16 MiB; small files share one) sent with isend/irecv in rounds
every rank walks in the same order, so no pair waits on another; a sender sends out of the page
cache (mmap), a receiver holds two messages per peer at most (memory is bounded whatever the
state's size) and checks and writes one while the next is on the wire. The receiver computes each
file's crc32 from the bytes as they arrive (once) and compares it with the sender's local commit
record; only then, fsync'd, is the record written beside the files, last: a copy cut short (a
kill -9 mid-transfer) has no record and is never used. At a restore the pull runs beside the load
(Pull, StreamedReader: the load reads each byte range once it landed).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
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
from dslurm.checkpoint.landing import Landed

log = logging.getLogger(__name__)

CHUNK = 16 << 20


@dataclass
class Stream:
    """The files one rank sends to (or receives from) one peer: directory, {name: {"size", "crc32"}},
    and the rounds they go in: each round one message of at most CHUNK bytes, the pieces of one
    or more files (name, offset, length); small files share a round (a round costs a round trip)."""

    peer: int
    root: Path
    files: dict[str, dict[str, Any]]
    rounds: list[list[tuple[str, int, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the small files first (.metadata, meta.json, ranks/): a load streamed from the transfer
        # (Landed) needs them before it reads a shard
        cur: list[tuple[str, int, int]] = []
        for name in sorted(self.files, key=lambda n: (n.endswith(".distcp"), n)):
            size = int(self.files[name]["size"])
            for off in range(0, size, CHUNK):
                piece = (name, off, min(CHUNK, size - off))
                if cur and sum(p[2] for p in cur) + piece[2] > CHUNK:
                    self.rounds.append(cur)
                    cur = []
                cur.append(piece)
        if cur:
            self.rounds.append(cur)


@dataclass
class Transfer:
    """What one rank moved: bytes sent, seconds, the problems of what it received, and the files
    it wrote (not yet fsync'd: the caller makes them durable before any record vouches for them)."""

    sent: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)


def exchange(comm: Comm, sends: list[Stream], recvs: list[Stream], *, mbps: float = 0.0,
             after_first: Callable[[], None] = lambda: None, landed: Landed | None = None) -> Transfer:
    """Collective over the ranks that appear in some stream: every rank walks rounds 0, 1, ...;
    in round k it posts the k-th message of each of its streams (isend, irecv), and while they fly
    it checks and writes what round k-1 received (crc32 once, from the received bytes; two buffers
    per peer at most). A sender sends from its files' page cache (mmap, no copy) and sends zeros
    for a file it cannot read (the receiver's crc32 says so); a receiver never breaks the rounds,
    it records problems. `mbps` > 0 caps each rank's send rate. `landed` (one receive stream) is
    told how far each file has landed, for a load that reads them as they come. Nothing is
    fsync'd here: see make_durable."""
    assert comm.group is not None, "partner copies need a process group"
    t0, out = time.monotonic(), Transfer()
    crcs: dict[tuple[int, str], int] = {}
    handles: dict[tuple[int, str], Any] = {}
    rounds = max([len(s.rounds) for s in sends + recvs], default=0)
    for s in recvs:
        for name in s.files:
            (s.root / name).parent.mkdir(parents=True, exist_ok=True)
            (s.root / name).write_bytes(b"")  # every file exists, the empty ones too
            out.written.append(s.root / name)
    sources = [_Source(s, out) for s in sends]

    started: list[str] = []

    def land(bufs: list[tuple[Stream, list[tuple[str, int, int]], torch.Tensor]]) -> None:
        for s, pieces, buf in bufs:
            raw, at = buf.numpy().data, 0
            for name, off, length in pieces:
                part = raw[at:at + length]
                at += length
                crcs[(s.peer, name)] = zlib.crc32(part, crcs.get((s.peer, name), 0))
                if landed is not None and landed.holds(name):  # kept in memory for the load
                    landed.put(name, off, part)
                    continue
                if (s.peer, name) not in handles:
                    handles[(s.peer, name)] = open(s.root / name, "ab")  # noqa: SIM115 - closed below
                handles[(s.peer, name)].write(part)
                if landed is not None:
                    handles[(s.peer, name)].flush()  # visible to the load's own open() of the file
                    landed.advance(name, length)
                if not started:
                    started.append(name)
                    after_first()  # the fault hook: a kill here leaves a copy half-written

    try:
        arrived: list[tuple[Stream, list[tuple[str, int, int]], torch.Tensor]] = []
        for k in range(rounds):
            ops, bufs = [], []
            for src in sources:
                if k < len(src.s.rounds):
                    buf = src.message(src.s.rounds[k])
                    ops.append(dist.isend(buf, dst=src.s.peer, group=comm.group))
                    out.sent += buf.numel()
            for s in recvs:
                if k < len(s.rounds):
                    buf = torch.empty(sum(p[2] for p in s.rounds[k]), dtype=torch.uint8)
                    ops.append(dist.irecv(buf, src=s.peer, group=comm.group))
                    bufs.append((s, s.rounds[k], buf))
            land(arrived)  # round k-1's bytes, while round k's are on the wire
            for op in ops:
                if op is not None:  # None: a rank outside the group (never here)
                    op.wait()
            arrived = bufs
            if mbps > 0:
                ahead = out.sent / (mbps * 1e6) - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        land(arrived)
    finally:
        for f in handles.values():
            f.close()
        for src in sources:
            src.close()
        if landed is not None:
            landed.close()
    for s in recvs:
        for name, entry in sorted(s.files.items()):
            got = f"{crcs.get((s.peer, name), 0):08x}"
            path = s.root / name
            try:
                size = landed.held_size(name) if landed is not None and landed.holds(name) else path.stat().st_size
            except OSError as exc:
                out.problems.append(f"{path}: {reason(exc)}")
                continue
            if (size, got) != (int(entry["size"]), entry["crc32"]):
                out.problems.append(f"{path}: size {size} crc32 {got} != {entry['size']} {entry['crc32']} "
                                    f"committed by rank {s.peer}")
    out.seconds = time.monotonic() - t0
    return out


def make_durable(paths: list[Path]) -> None:
    """fsync the files a transfer wrote and their directories: before a record vouches for them."""
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    for d in sorted({p.parent for p in paths}):
        ck.fsync_dir(d)


class _Source:
    """One send stream's files, mapped (the pieces go out of the page cache without a copy into
    a buffer of ours); a file that cannot be read, or is shorter than its record, sends zeros."""

    def __init__(self, s: Stream, out: Transfer) -> None:
        self.s, self.maps = s, {}
        for name, entry in s.files.items():
            size = int(entry["size"])
            if size == 0:
                continue
            try:
                with open(s.root / name, "rb") as f:
                    if os.fstat(f.fileno()).st_size < size:
                        raise OSError(f"shorter than the {size} bytes committed")
                    # ACCESS_COPY: private and writable (torch wants a writable buffer); never written
                    self.maps[name] = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:
                out.problems.append(f"{s.root / name}: unreadable, not sent ({reason(exc)})")

    def piece(self, name: str, off: int, length: int) -> torch.Tensor:
        m = self.maps.get(name)
        if m is None:  # the receiver's crc32 will not match: zeros go instead
            return torch.zeros(length, dtype=torch.uint8)
        return torch.frombuffer(m, dtype=torch.uint8, count=length, offset=off)

    def message(self, pieces: list[tuple[str, int, int]]) -> torch.Tensor:
        """One round's bytes: a shard's chunk as it lies in the page cache, small files joined."""
        parts = [self.piece(*p) for p in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a tensor still views it: the mapping goes with the tensor
                pass


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
        if not err:
            make_durable(xfer.written)
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


@dataclass
class Pulled:
    """This rank's pull at a restore: its files, checked against `record` as they arrived and
    written to its own local tier, but not yet durable nor vouched for (`keep`)."""

    gen: Path
    record: dict[str, Any]
    xfer: Transfer
    landed: Landed | None = None  # shards held in memory (a streamed pull): written by keep

    def keep(self, rank: int) -> str:
        """Once the load verified them: fsync the files, then write the record, last; from then on
        the copy is this node's own. -> problem or "" (a copy not kept costs a later start this
        pull again, never a wrong restore: without its record it is never used)."""
        rec = dict(self.record)
        rec["committed_t"] = time.time()
        try:
            if self.landed is not None:
                self.landed.spill(self.gen)  # what the load read from memory goes to disk now
            make_durable(self.xfer.written)
            (self.gen / tiers.LOCAL).mkdir(exist_ok=True)
            ck.atomic_write_json(tiers.record_path(self.gen, rank), rec)
        except OSError as exc:
            return f"{self.gen}: {reason(exc)}"
        return ""


class Pull:
    """A restore's pulls (collective over the job's ranks, on `comm`, a gloo group of its own):
    each rank in `cand.pulls` receives its files from the copy its holder's node keeps
    (replica.copy_root) into its own local tier, crc32-checked as they arrive, on a thread, while
    the caller loads them (StreamedReader over `landed`); `records` are the holders' copies of the
    records (gathered). `join` -> (this rank's problems, transfer, this rank's pull to keep)."""

    def __init__(self, comm: Comm, cand: replica.Candidate, local_dir: Path,
                 records: dict[int, dict[str, Any]], stream: bool) -> None:
        r, name = comm.rank, cand.name
        sends = [Stream(dst, ck.generations_dir(replica.copy_root(local_dir, kind)) / name, files_of(records[dst]))
                 for dst, (h, kind) in sorted(cand.pulls.items()) if h == r]
        self.gen = ck.generations_dir(local_dir) / name
        recvs = [Stream(cand.pulls[r][0], self.gen, files_of(records[r]))] if r in cand.pulls else []
        self.record = records.get(r)
        files = recvs[0].files if recvs else {}
        # streamed: the shards stay in memory until the load has read them (no write, no read back)
        held = {n for n in files if n.endswith(".distcp")} if stream else set()
        self.landed = Landed({n: int(e["size"]) for n, e in files.items()}, held) if recvs else None
        self.xfer = Transfer()

        def run() -> None:
            try:
                self.xfer = exchange(comm, sends, recvs, landed=self.landed)
            except Exception as exc:
                self.xfer = Transfer(problems=[reason(exc)])
                if self.landed is not None:
                    self.landed.close()
        self._thread = threading.Thread(target=run, name="dslurm-partner-pull", daemon=True)
        self._thread.start()

    def join(self) -> tuple[list[str], Transfer, Pulled | None]:
        """Wait for the transfer (again: a no-op)."""
        self._thread.join()
        if self.landed is None or self.record is None:
            return [], self.xfer, None
        problems = list(self.xfer.problems)
        return problems, self.xfer, (None if problems else Pulled(self.gen, self.record, self.xfer, self.landed))
