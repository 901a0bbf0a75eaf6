"""ParallelDims: the torch part of the layout. It checks the shared `Layout` against the launcher's
world and the device, names the mesh dims, and (under torchrun) gives mesh coordinates equal to
the pure `Layout.coords`. The rules themselves are tested in test_layout.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.config.layout import DIM_NAMES, Layout
from dslurm.errors import UserError
from train.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def test_the_launchers_world_must_equal_the_product_and_says_the_numbers():
    with pytest.raises(UserError, match=r"pp\(2\)\*dp_replicate\(1\)\*dp_shard\(3\)\*cp\(1\)\*tp\(1\)=6 != "
                                        r"world_size\(8\)"):
        ParallelDims.from_layout(Layout(pp=2, dp_shard=3), 8)


def test_context_parallel_runs_on_cpu():
    assert ParallelDims.from_layout(Layout(cp=2), 2, "cpu").layout.cp_enabled


def test_dims_carry_the_shared_layout_itself():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    d = ParallelDims.from_layout(layout, 16)
    assert d.layout is layout and d.world_size == 16


def test_get_mesh_with_a_wrong_name_lists_the_valid_ones_before_building_anything():
    d = ParallelDims(layout=Layout())
    with pytest.raises(ValueError, match=r"unknown mesh dim\(s\) \['data'\]; valid names: pp, dp_replicate, "
                                         r"dp_shard, cp, tp, dp"):
        d.get_mesh("data")
    assert d._mesh is None and DIM_NAMES == ("pp", "dp_replicate", "dp_shard", "cp", "tp")


SCRIPT = """
import json, sys, torch.distributed as dist
from dslurm.config.layout import Layout
from train.parallel.dims import ParallelDims
dist.init_process_group("gloo")
layout = Layout(pp=2, dp_replicate=1, dp_shard=1, tp=2)
d = ParallelDims.from_layout(layout, dist.get_world_size())
r = dist.get_rank()
coords = dict(zip(d.mesh.mesh_dim_names, d.mesh.get_coordinate()))
ok = coords == layout.coords(r) and d.get_mesh("tp").get_local_rank() == r % 2 and d.get_mesh("dp").size() == 1
# One file per rank: four processes printing to one pipe can interleave their lines.
open(f"{sys.argv[1]}/rank-{r}.json", "w").write(json.dumps({"rank": r, "ok": ok, "coords": coords}))
dist.destroy_process_group()
"""


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_mesh_coordinates_equal_the_pure_layout(tmp_path):
    script = tmp_path / "mesh.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=110,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3] and all(r["ok"] for r in rows)
