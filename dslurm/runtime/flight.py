"""PyTorch's Flight Recorder in a dslurm job: dumped at a hang, read for the straggler split.

In-job (torch imported inside the functions). The recorder is switched on by
`dslurm.health.process_group.init_process_group` (`health.enable_flight_recorder`: the one init
of the trainer, the burn-in and every `dslurm.runtime` script), before any group exists.

`dump` writes this process's ring as PyTorch's own pickle (`<start dir>/fr/rank-NNNNN`, what
`python -m torch.distributed.flight_recorder.fr_trace DIR` reads) with `pg_config` filled in
from c10d's own table of groups (gloo's recorder leaves it empty: the analyser needs the
members of each group), and returns the per-group states the hang note carries
(dslurm/observe/forensics.py reads them).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_bytes
from dslurm.observe import forensics

log = logging.getLogger(__name__)

def _raw() -> dict[str, Any] | None:
    """This process's recorder as PyTorch's dump dict (None: this torch has none)."""
    from torch._C import _distributed_c10d as c10d

    for name in ("_dump_nccl_trace", "_dump_fr_trace"):  # NCCL's ring on GPU, the generic one (gloo) else
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data: dict[str, Any] = pickle.loads(fn(True, True, False))
        except Exception as exc:  # noqa: BLE001  (a dump must never take the process down)
            log.warning("flight recorder: %s failed: %s", name, exc)
            continue
        if data.get("entries"):
            return data
    return None


def groups_config() -> dict[str, dict[str, str]]:
    """c10d's groups of this process: name -> desc and global ranks (the analyser's pg_config)."""
    try:
        from torch.distributed import distributed_c10d as dc

        world = dc._world
        out = {}
        for pg, name in world.pg_names.items():
            ranks = sorted(world.pg_group_ranks.get(pg, {}))
            out[str(name)] = {"name": str(name), "desc": str(getattr(pg, "group_desc", "") or ""),
                              "ranks": str(ranks)}
        return out
    except Exception as exc:  # noqa: BLE001  (private c10d state: best effort)
        log.warning("flight recorder: process groups not read: %s", exc)
        return {}


def snapshot() -> dict[str, Any] | None:
    """The dump with `pg_config` from c10d (None: nothing recorded)."""
    data = _raw()
    if data is None:
        return None
    cfg = groups_config()
    if cfg:
        data["pg_config"] = cfg
    return data


def dump(start_dir: Path | None, rank: int) -> dict[str, dict[str, Any]]:
    """Write this rank's dump under the start directory; return its group states (the note)."""
    data = snapshot()
    if data is None:
        return {}
    if start_dir is not None:
        try:
            d = start_dir / forensics.SUBDIR
            d.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(d / f"rank-{rank:05d}", pickle.dumps(data))
        except OSError as exc:  # a full disk: the note still carries the states
            log.error("[rank %d] flight-recorder dump not written: %s", rank, exc)
    return forensics.to_note(forensics.group_states(data))


def arrivals(start_ns: int, end_ns: int) -> list[tuple[str, int, int]]:
    """The collectives this process entered between two wall-clock times: (group, #, entered at
    ns), for the straggler split (dslurm/observe/slowrank.py); empty when nothing is recorded."""
    from torch._C import _distributed_c10d as c10d

    fn = getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return []
    try:
        data = pickle.loads(fn(True, False, False))  # no stack traces: the cheap form
    except Exception:  # noqa: BLE001  (a measurement must never take the step down)
        return []
    out = []
    for e in data.get("entries") or []:
        t = int(e.get("time_created_ns") or 0)
        if start_ns <= t <= end_ns and not e.get("is_p2p"):
            out.append((str((e.get("process_group") or ["?"])[0]), int(e.get("collective_seq_id") or 0), t))
    return out
