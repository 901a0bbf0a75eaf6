"""Fixtures for tests against the built-in local real Slurm (see dslurm/cluster/__init__.py).

`slurm_cluster` brings the cluster up once per pytest session: 3 nodes (tests need 3) with
accounting (slurmdbd + MariaDB: ~5 s warm, ~7 s on a fresh database), so one fixture serves
everything including sacct. If a cluster with these settings already runs it is reused
(`up` is a no-op); one with other settings is restarted.

The same cluster serves GPU-style jobs: every node declares GPUS placeholder GPUs (gres gpu;
a CPU job, which asks for none, runs as before), and never-started partitions shaped like the
shipped GPU sites take `sbatch --test-only` (tests/cluster/test_gpu_gres.py). One cluster for
both keeps the suite to one start-up. Its devices are constrained as on GPU sites (task/cgroup,
ConstrainDevices=yes): a step opens only the GPUs it was given (tests/cluster/test_gpu_devices.py).

It is LEFT RUNNING at the end of the session: several pytest sessions (other engineers,
CI steps) share one cluster per machine, and tearing it down under a concurrent session would
break that session's tests. Stop it with `dslurm cluster down`, or set
DSLURM_CLUSTER_TEARDOWN=1 to stop it at session end when this session started it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cluster_jobs import GPUS, Reference, session_shapes, submit_reference
from doc_rows import REPORT
from dslurm import cluster
from testkit import run_cli

NODES = 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test in this folder needs real daemons: mark them so `-m "not cluster"` skips them.
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Each phase's report kept on the test, for the tables tests write (doc_rows.py)."""
    rep = yield
    item.stash.setdefault(REPORT, {})[rep.when] = rep
    return rep


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[cluster.ClusterInfo]:
    was_up = cluster.is_up()
    try:
        info = cluster.up(nodes=NODES, accounting=True, gpus=GPUS, shapes=session_shapes(), constrain_devices=True)
    except Exception as exc:  # not root and no cluster running: nothing this session can do
        if os.geteuid() != 0:
            pytest.skip(str(exc))
        raise
    yield info
    if os.environ.get("DSLURM_CLUSTER_TEARDOWN") == "1" and not was_up:
        cluster.down()


@pytest.fixture(scope="session")
def two_tier_reference(slurm_cluster: cluster.ClusterInfo, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run the two-tier scenarios compare with (test_two_tier.py, test_partner.py):
    one job per session, not one per scenario. Submitted, not waited for (same_as_reference waits)."""
    return submit_reference(run_cli, slurm_cluster.env(), tmp_path_factory.mktemp("two_tier_ref"))
