"""Two-tier checkpoints, the torch-free half: where the node-local tier lives, what a local commit
records, which local generation a restore may use, what local retention deletes, and the copy of a
file to the durable run directory (docs/checkpoint.md, "Two tiers").

On each node, per run::

    <scratch>/dslurm-<run name>-<8 hex of the run dir>/generations/step-.../
        __<rank>_<i>.distcp           the shards of this node's ranks (dedup'd per node, so every
                                      replicated item this node's ranks load is on this node)
        .metadata                     DCP metadata pointing at this node's copies
        meta.json, ranks/rank-N.json  as in the durable tier
        local/rank-NNNNN.json         rank N's local commit record: written only after every rank
                                      of the save reported its local write complete with crc32s

A generation is locally committed for a job when every rank of that job finds its own record
(same world size and layout). The durable tier (dslurm.checkpoint) is unchanged: its pointer only
ever names a generation whose durable copy was manifested, verified and restore-tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm import checkpoint as ck

LOCAL = "local"  # per-rank commit records inside a local generation
LAG_POLICIES = ("wait", "skip_local", "skip_durable")
_CHUNK = 4 << 20


def node_name(env: dict[str, str] | None = None) -> str:
    """The node this process runs on: Slurm's name for it (SLURMD_NODENAME; on the local cluster
    node1, node2 share one host), else the host name."""
    source = os.environ if env is None else env
    return source.get("SLURMD_NODENAME") or socket.gethostname()


def expand_scratch(template: str, node: str) -> Path:
    """`storage.scratch` for one node: `%n` is the node name, `%%` a percent sign; `~` and $VARS
    expand. Pure (given the environment)."""
    out, i = [], 0
    while i < len(template):
        c = template[i]
        if c == "%" and i + 1 < len(template) and template[i + 1] in "n%":
            out.append(node if template[i + 1] == "n" else "%")
            i += 2
            continue
        out.append(c)
        i += 1
    return Path(os.path.expandvars(os.path.expanduser("".join(out))))


def local_run_dir(scratch: Path, run_dir: Path) -> Path:
    """This run's directory on a node's scratch: named after the run, plus a hash of the durable
    run directory's absolute path so two runs with one name never share local state."""
    digest = hashlib.blake2b(str(Path(run_dir).resolve()).encode(), digest_size=4).hexdigest()
    return Path(scratch) / f"dslurm-{Path(run_dir).name}-{digest}"


def node_groups(scratches: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by the scratch directory they see (one group per node), in order of the
    first rank of each. Pure."""
    groups: dict[str, list[int]] = {}
    for rank, s in enumerate(scratches):
        groups.setdefault(s, []).append(rank)
    return list(groups.values())


def record_path(gen: Path, rank: int) -> Path:
    return gen / LOCAL / f"rank-{rank:05d}.json"


@dataclass(frozen=True)
class LocalRecord:
    """Rank `rank`'s local commit of one generation: the files it vouches for on its node."""

    generation: str
    step: int
    rank: int
    world_size: int
    layout: dict[str, Any]
    files: dict[str, dict[str, Any]]  # name -> {"size", "crc32"}, as in a manifest
    committed_t: float  # unix time of the local commit
    groups: list[list[int]] | None = None  # the save's ranks per node (None: an older record)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "step": self.step, "rank": self.rank,
                "world_size": self.world_size, "layout": self.layout, "files": self.files,
                "committed_t": self.committed_t, "groups": self.groups}


def write_record(gen: Path, rec: LocalRecord) -> None:
    (gen / LOCAL).mkdir(exist_ok=True)
    ck.atomic_write_json(record_path(gen, rec.rank), rec.to_json())


def read_record(gen: Path, rank: int) -> LocalRecord | None:
    """None when absent or unreadable (a kill -9 mid-write leaves no record: atomic writes)."""
    try:
        d = json.loads(record_path(gen, rank).read_text())
        return LocalRecord(str(d["generation"]), int(d["step"]), int(d["rank"]), int(d["world_size"]),
                           dict(d["layout"]), dict(d["files"]), float(d["committed_t"]),
                           [list(map(int, g)) for g in d["groups"]] if d.get("groups") else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def held_generations(local_dir: Path, rank: int, world: int, layout: dict[str, Any]) -> list[str]:
    """Generations this rank holds locally committed for a job of this world size and layout,
    oldest first (the restore intersects every rank's list)."""
    out = []
    for g in ck.list_generations(local_dir):
        rec = read_record(g.path, rank)
        if rec is not None and rec.world_size == world and rec.layout == layout and rec.generation == g.name:
            out.append(g.name)
    return out


def local_candidates(held: Sequence[Sequence[str]], pointer: ck.Pointer | None) -> tuple[list[str], str]:
    """Local generations a restore may try, newest first, and why. A generation qualifies when every
    rank holds it and it is not older than the durable pointer's (a local copy never takes the run
    back behind what is durable). Pure."""
    common = set(held[0]) if held else set()
    for h in held[1:]:
        common &= set(h)
    if not common:
        missing = sum(1 for h in held if not h)
        why = (f"no local generation on {missing} of {len(held)} ranks (new nodes, wiped scratch or "
               "another layout)" if missing else "no generation held locally by every rank")
        return [], why
    newest = sorted(common, key=lambda n: (ck.parse_step(n) or -1, n), reverse=True)
    if pointer is not None:
        floor = ck.parse_step(pointer.generation) or 0
        newer = [n for n in newest if (ck.parse_step(n) or -1) >= floor]
        if not newer:
            return [], f"local generations ({newest[0]} newest) are older than {ck.POINTER} -> {pointer.generation}"
        newest = newer
    return newest, f"{newest[0]} is locally committed on all {len(held)} ranks"


def plan_local_retention(names_committed: Sequence[tuple[str, bool]], keep: int,
                         in_flight: Iterable[str] = ()) -> list[str]:
    """Local generations to delete on one node: partial ones (not every rank of the node committed)
    not in flight, and committed ones beyond the newest `keep`, never one in flight (being written
    or copied). Pure; names_committed is (name, committed on this node), any order."""
    busy = set(in_flight)
    ordered = sorted(names_committed, key=lambda nc: (ck.parse_step(nc[0]) or -1, nc[0]))
    committed = [n for n, ok in ordered if ok]
    keepers = set(committed[-keep:]) | busy
    return [n for n, _ in ordered if n not in keepers]


def collect_local_garbage(local_dir: Path, node_ranks: Sequence[int], keep: int,
                          in_flight: Iterable[str] = ()) -> list[str]:
    gens = [(g.name, all(read_record(g.path, r) is not None for r in node_ranks))
            for g in ck.list_generations(local_dir)]
    doomed = plan_local_retention(gens, keep, in_flight)
    for name in doomed:
        ck.remove_generation(local_dir, name)
    return doomed


def drop_local(local_dir: Path, name: str, rank: int) -> None:
    """Withdraw this rank's local commit of a generation that failed to verify: it is never a
    local candidate again (retention removes the files)."""
    record_path(ck.generations_dir(local_dir) / name, rank).unlink(missing_ok=True)


def copy_file(src: Path, dst: Path, *, want: dict[str, Any] | None = None,
              mbps: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Copy one file, fsync'd, computing its crc32 from the bytes read. `want` (the local commit's
    entry) must match, so a local file altered since its commit is never made durable. `mbps` > 0
    caps the rate (a fault knob: a loaded shared file system). -> {"size", "crc32"}."""
    crc, size, t0 = 0, 0, time.monotonic()
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fi.readinto(buf):
            fo.write(view[:n])
            crc, size = zlib.crc32(view[:n], crc), size + n
            if mbps > 0:
                ahead = size / (mbps * 1e6) - (time.monotonic() - t0)
                if ahead > 0:
                    sleep(ahead)
        fo.flush()
        os.fsync(fo.fileno())
    got = {"size": size, "crc32": f"{crc:08x}"}
    if want is not None and (want["size"], want["crc32"]) != (got["size"], got["crc32"]):
        raise OSError(f"{src}: size {size} crc32 {got['crc32']} != locally committed "
                      f"{want['size']} {want['crc32']} (altered since the local commit)")
    return got
