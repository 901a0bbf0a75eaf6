"""The chaos soak on the real local Slurm (issue 41): `dslurm selftest chaos` with a short seeded
schedule -- a worker killed -9 and one SIGSTOPped, the time-limit warning at the batch shell,
slurmctld stopped and started again, the durable path (a size-limited tmpfs) full, an
`scontrol requeue`, a node's whole job step killed -9, the spare drained -- against a 2+1 job with
warm restarts, then the same training uninterrupted. Every promise holds: the final parameters are
bit-identical, no step was trained twice beyond the last commit, every start has its ending,
nothing is torn, only the run's own failures spent its restart budget. The soak's table and PNG
are left in its directory. The 30-minute soak is docs/chaos.md's command, not the suite's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dslurm.observe.ledger import read_events
from dslurm.selftest.chaos.schedule import draw, parse_kinds

# Seed 209 draws 9 faults in 90 s covering 8 of the 9 kinds (all but usr2, the USR2 to the job
# steps, which the time-limit warning's path shares from the launchers down).
SEED, MINUTES, EVERY, INTERVAL = 209, 1.5, 10.0, 5  # INTERVAL: the soak's checkpoint interval (its default)
# The soak's table, as docs/fault-matrix.md is written by its test run.
DOC = Path(__file__).resolve().parents[2] / "docs" / "chaos-suite-soak.md"
# Why a fault may find nothing to hit at its moment (dslurm/selftest/chaos/inject.py): the job
# restarting or pending. Anything else (an error, a durable path not mounted) fails the soak.
MOMENT = ("no training process alive within", "no training node within", "no idle spare (job", "job ")


def lost_steps_bound(run: Path) -> int:
    """What promise 3 allows (no step trained twice beyond the last commit): at each start after
    the first, the steps the run had reached past its newest committed checkpoint. From the
    ledger's raw lines, not through the report's accounting."""
    recs = sorted(read_events(run), key=lambda e: e["t"])
    bound = 0
    for i, e in enumerate(recs):
        if e["event"] != "train_start" or not any(r["event"] == "train_start" for r in recs[:i]):
            continue
        reached = max([r["last"] + 1 for r in recs[:i] if r["event"] == "steps"]  # as the report counts it
                      + [r["step"] for r in recs[:i] if r["event"] in ("exit", "signal", "ckpt_save") and r.get("step")]
                      + [0])
        committed = max((r["step"] for r in recs[:i] if r["event"] == "ckpt_save"), default=0)
        bound += max(0, reached - committed)
    return bound


@pytest.mark.timeout(480)
def test_a_short_seeded_chaos_soak_keeps_every_promise(slurm_cluster, cli, tmp_path):
    soak = tmp_path / "soak"
    res = cli("selftest", "chaos", "--seed", str(SEED), "--minutes", str(MINUTES), "--every", str(EVERY), "--steps",
              "40", "--interval", str(INTERVAL), "--dir", str(soak), "--timeout-s", "400", env=slurm_cluster.env(),
              timeout=470)
    out = json.loads((soak / "chaos.json").read_text())
    shutil.copy(soak / "chaos-table.md", DOC)
    assert res.returncode == 0 and out["broken"] == [], res.stdout[-6000:] + res.stderr[-3000:]
    assert f"seed {SEED}" in res.stdout and f"--seed {SEED}" in (soak / "chaos-table.md").read_text()
    rows = out["rows"]
    # Every fault of the seed's schedule has its row, all 8 kinds of it; each was injected, or
    # found nothing to hit at its moment and says so. The disk is mounted (root): it is filled.
    drawn = draw(SEED, MINUTES, EVERY, parse_kinds("all", spares=True))
    assert [r["kind"] for r in rows] == [f.kind for f in drawn] and len({f.kind for f in drawn}) == 8, rows
    assert all(r["injected"] or r["detail"].startswith(MOMENT) for r in rows), rows
    assert all(r["injected"] for r in rows if r["kind"] in ("disk_full", "ctld_restart")), rows
    assert any(r["ended_it"] for r in rows), rows  # at least one fault interrupted a start and was recovered
    assert (soak / "chaos.png").stat().st_size > 5000 and (soak / "run" / "chaos-table.md").is_file()
    # Lost steps as promise 3 says: none beyond the newest commit at each restart.
    assert out["starts"] >= 2 and out["lost_steps"] <= lost_steps_bound(soak / "run"), out
