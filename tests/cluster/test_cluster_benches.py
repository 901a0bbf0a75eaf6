"""The benches that need the local Slurm cluster, each in its tiny mode (one rep, the fewest
steps): each must exit 0, print its figure line, and reject no rep for phases out of order
(issue 40). Not a measurement. tests/integration/test_benches.py runs the others."""

from __future__ import annotations

import pytest

from testkit import TINY_BENCHES, run_bench

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("name", sorted(n for n, (_, _, cluster) in TINY_BENCHES.items() if cluster))
def test_cluster_bench_runs_in_its_tiny_mode(name, tmp_path, slurm_cluster):
    args, expect, _ = TINY_BENCHES[name]
    out = run_bench(name, args, tmp_path)
    assert out.returncode == 0, f"{name}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert expect in out.stdout, out.stdout[-3000:]
    assert "REJECTED" not in out.stderr
