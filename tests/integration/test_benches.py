"""Every bench under bench/ that needs no cluster, run in its tiny mode as its docstring says
(`PYTHONPATH=$PWD .venv/bin/python bench/NAME ...`): it must exit 0 and print its figure line.
Not a measurement (one rep, seconds): it keeps the benches from rotting unseen (issue 40:
bench_trainer.py died at once on a moved module and nothing noticed). testkit.TINY_BENCHES
holds the arguments; tests/cluster/test_cluster_benches.py runs the cluster ones."""

from __future__ import annotations

import pytest

from testkit import TINY_BENCHES, run_bench

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", sorted(n for n, (_, _, cluster) in TINY_BENCHES.items() if not cluster))
def test_bench_runs_in_its_tiny_mode(name, tmp_path):
    args, expect, _ = TINY_BENCHES[name]
    out = run_bench(name, args, tmp_path)
    assert out.returncode == 0, f"{name}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert expect in out.stdout, out.stdout[-3000:]
    assert "REJECTED" not in out.stderr
