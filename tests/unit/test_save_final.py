"""A save an ending needs waits out a full disk for a few tries, and only a full disk
(dslurm/runtime/checkpoint.py `save_final`). Pure: a stand-in manager records the outcomes a real
one agrees on across ranks (tests/cluster/test_fault_matrix.py's full disk is the real one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from dslurm.checkpoint.core import SaveOutcome
from dslurm.runtime import checkpoint as rc

ENOSPC = "RuntimeError: rank 0: OSError: [Errno 28] No space left on device"


@dataclass
class Manager:
    reasons: list[str]
    """each save's failure reason in turn ('' = it commits)"""
    saves: int = 0
    last_outcome: SaveOutcome | None = None
    failed: list[SaveOutcome] = field(default_factory=list)

    def save(self) -> None:
        reason = self.reasons[min(self.saves, len(self.reasons) - 1)]
        self.saves += 1
        self.last_outcome = SaveOutcome("g", 20, not reason, reason)

    def failure(self, out: SaveOutcome) -> Exception:
        self.failed.append(out)
        return RuntimeError(f"save failed: {out.reason}")


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(rc.time, "sleep", lambda s: None)


def test_a_disk_full_for_a_few_tries_is_waited_out():
    m = Manager([ENOSPC, ENOSPC, ""])
    assert rc.save_final(m, m.save, 20) is None and m.saves == 3


def test_a_disk_that_stays_full_fails_after_the_tries_and_other_failures_at_once():
    m = Manager([ENOSPC])
    err = rc.save_final(m, m.save, 20)
    assert isinstance(err, RuntimeError) and "No space left" in str(err) and m.saves == rc.FINAL_SAVE_TRIES
    m = Manager(["non-finite state at step 20"])  # a retry cannot help: no second try
    assert rc.save_final(m, m.save, 20) is not None and m.saves == 1
    m = Manager([""])
    assert rc.save_final(m, m.save, 20) is None and m.saves == 1


def test_the_run_lock_waits_out_a_full_disk_for_its_holder_record(tmp_path, monkeypatch):
    """`dslurm selftest chaos` seed 4343: the lock's holder record met a 3 s full disk as a start
    began, and the start crashed (a restart of the budget spent). Now the write is tried again."""
    import errno

    from dslurm.checkpoint import lock as lk

    real, tries = lk.atomic_write_json, []

    def full_twice(path, obj):
        tries.append(path)
        if len(tries) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, obj)

    monkeypatch.setattr(lk, "atomic_write_json", full_twice)
    monkeypatch.setattr(lk.time, "sleep", lambda s: None)
    with lk.RunDirLock(tmp_path) as held:
        assert len(tries) == 3 and held.holder() is not None
    monkeypatch.setattr(lk, "ENOSPC_RETRY_S", 0.0)
    tries.clear()
    monkeypatch.setattr(lk, "atomic_write_json", lambda p, o: (tries.append(p), full_twice(p, o)) and None)
    with lk.RunDirLock(tmp_path) as held:  # still full past the wait: held, the record left unwritten
        assert held.holder() is None
