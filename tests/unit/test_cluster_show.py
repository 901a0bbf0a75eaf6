"""`dslurm cluster status`: readable lines and JSON from recorded sinfo/squeue output (no cluster)."""

from __future__ import annotations

import argparse
import json

from dslurm import cluster, slurm
from dslurm.cluster.show import format_status

# `sinfo -N -h -o '%N|%T|%c|%m|%P'` and `squeue -h -o '%i|%j|%T|%D|%R|%u|%M'` on the local
# cluster (3 nodes declaring 4 CPUs each, on a machine with 2 cores), captured while a job ran.
SINFO = "node1|allocated|4|4096|debug*\nnode2|allocated|4|4096|debug*\nnode3|idle|4|4096|debug*\n"
SQUEUE = "6042949|race-a|RUNNING|2|node[1-2]|root|0:17\n"
SETTINGS = {"nodes": 3, "cpus": 4, "memory_mb": 4096, "accounting": True}


def _status(jobs: str = SQUEUE) -> dict:
    return {"up": True, "state_dir": "/tmp/dslurm-cluster", "settings": SETTINGS, "host_cpus": 2,
            "nodes": slurm.parse_sinfo_nodes(SINFO), "jobs": slurm.parse_squeue(jobs)}


def test_status_is_readable_and_says_the_cpus_are_declared_not_real():
    lines = format_status(_status())
    text = "\n".join(lines)
    assert "{" not in text and "': " not in text  # no Python dict repr
    assert lines[0] == "cluster up: 3 node(s), accounting on (state dir /tmp/dslurm-cluster)"
    assert "each node declares 4 CPUs and 4096 MB in slurm.conf: not real capacity" in text
    assert "all 3 nodes share this machine's 2 CPU core(s)" in text
    table = lines[lines.index("") + 1:]
    assert table[0].split() == ["NODE", "STATE", "CPUS(DECLARED)", "MEMORY_MB(DECLARED)", "PARTITIONS"]
    assert table[1].split() == ["node1", "allocated", "4", "4096", "debug"]
    assert lines[-1].split() == ["6042949", "race-a", "RUNNING", "2", "node[1-2]", "0:17"]
    assert max(map(len, lines)) <= 80


def test_status_without_jobs_and_when_down():
    assert format_status(_status(jobs=""))[-1] == "no jobs"
    assert format_status({"up": False, "state_dir": "/s", "nodes": [], "jobs": []}) == [
        "no cluster running (state dir /s)"]


def test_cli_status_json(monkeypatch, capsys):
    monkeypatch.setattr(cluster, "status", lambda state_dir=None: _status())
    args = argparse.Namespace(cluster_command="status", state_dir=None, json=True)
    assert cluster.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_cpus"] == 2 and out["settings"]["cpus"] == 4 and out["nodes"][2]["state"] == "idle"
    args.json = False
    assert cluster.run(args) == 0 and "not real capacity" in capsys.readouterr().out
