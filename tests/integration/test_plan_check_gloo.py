"""`dslurm plan check` at small worlds agrees with what the real gloo run allocates and sends.

For two 4-rank layouts of the tiny model, CP 2 x TP 2 (FSDP over the cp ranks, sequence-parallel TP,
the K/V all-gathers) and PP 2 (interleaved, 2 stages per rank) x FSDP 2: `dslurm plan check --ranks
0,1,2,3 --json` builds every rank on the fake process group with fake tensors; a torchrun of the same
job on gloo (tests/integration/plan_check_script.py) builds it for real and runs the same micro-batch.
Every rank's local shard shapes are the same, and so are its collectives (calls and bytes per kind
and mesh dimension); and the planner's figures for those ranks are within the check's 10%, so the
command exits 0. Cost: two 4-process torchruns and 8 one-rank fake builds of the tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from train_helpers import SITE, run_procs, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
SCRIPT = Path(__file__).with_name("plan_check_script.py")
LAYOUTS = {
    "cp2xtp2": ["parallel.cp=2", "parallel.tp=2"],
    "pp2xfsdp2": ["parallel.pp=2", "parallel.microbatches=4", "parallel.pp_schedule=Interleaved1F1B"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_fake_build_equals_the_gloo_run_and_the_planner(tmp_path, name):
    sets = [*LAYOUTS[name], "nodes=2"]  # 2 nodes x 2 processes of the local site: a world of 4
    job = write_job(tmp_path, name)
    cmd = [sys.executable, "-m", "dslurm", "plan", "check", "--site", str(SITE), "--job", str(job),
           "--site-set", "node.nvlink_domain=8", "--ranks", "0,1,2,3", "--json"]
    cmd += [x for s in sets for x in ("--set", s)]
    fake = run_procs(cmd, 2, 240)
    assert fake.returncode == 0, fake.stdout[-3000:] + fake.stderr[-3000:]
    report = json.loads(fake.stdout.strip().splitlines()[-1])
    assert report["ok"] and all(r["ok"] for r in report["rows"] if r["gated"])

    real = run_procs([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                      str(SCRIPT), str(SITE), str(job), str(tmp_path), *sets], 4, 120)
    assert real.returncode == 0, real.stderr[-3000:]
    for r in report["ranks"]:
        got = r["measured"]
        want = json.loads((tmp_path / f"rank-{r['rank']}.json").read_text())
        assert got["shapes"] == want["shapes"], r["rank"]
        assert got["collectives"] == want["collectives"], r["rank"]
    kinds = {(c["dim"], c["op"]) for r in report["ranks"] for c in r["measured"]["collectives"]}
    expected = {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")}
    expected |= {("cp", "all_gather"), ("cp", "reduce_scatter"), ("tp", "all_gather")} if name == "cp2xtp2" else set()
    assert expected <= kinds
