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

# Seed 209 draws 9 faults in 90 s covering 8 of the 9 kinds (all but usr2, the USR2 to the job
# steps, which the time-limit warning's path shares from the launchers down).
SEED = 209
# The soak's table, as docs/fault-matrix.md is written by its test run.
DOC = Path(__file__).resolve().parents[2] / "docs" / "chaos-suite-soak.md"


@pytest.mark.timeout(480)
def test_a_short_seeded_chaos_soak_keeps_every_promise(slurm_cluster, cli, tmp_path):
    soak = tmp_path / "soak"
    res = cli("selftest", "chaos", "--seed", str(SEED), "--minutes", "1.5", "--every", "10", "--steps", "40",
              "--dir", str(soak), "--timeout-s", "400", env=slurm_cluster.env(), timeout=470)
    out = json.loads((soak / "chaos.json").read_text())
    shutil.copy(soak / "chaos-table.md", DOC)
    assert res.returncode == 0 and out["broken"] == [], res.stdout[-6000:] + res.stderr[-3000:]
    assert f"seed {SEED}" in res.stdout and f"--seed {SEED}" in (soak / "chaos-table.md").read_text()
    rows = out["rows"]
    injected = {r["kind"] for r in rows if r["injected"]}
    # What the schedule could not hit (no worker alive at that moment, the job pending) is said so.
    assert len(injected) >= 5 and all(r["detail"] for r in rows), rows
    assert any(r["ended_it"] for r in rows), rows  # at least one fault interrupted a start and was recovered
    assert (soak / "chaos.png").stat().st_size > 5000 and (soak / "run" / "chaos-table.md").is_file()
    assert out["starts"] >= 2 and out["lost_steps"] >= 0
