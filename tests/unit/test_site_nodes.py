"""The site's memory of its nodes (dslurm/observe/nodes.py, `dslurm site nodes`, issue 53): the
evidence a run's ledger holds against nodes, kept per node in an append-only crash-safe file under
the site's durable path, fed idempotently, decayed, and used to leave nodes out of new jobs."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from dslurm.cli import main
from dslurm.config.site import NodeEvidenceSpec
from dslurm.observe import events as ev
from dslurm.observe import nodes
from dslurm.observe.ledger import Ledger
from dslurm.submission import remembered_bad

ROOT = Path(__file__).resolve().parents[2]
NOW = 1.9e9
JOB = "finetune-tiny.yaml"


def ledger_with_evidence(run: Path) -> None:
    led = Ledger(run)
    led.append(ev.Preflight(passed=False, bad_nodes=["n3"], problems=["n3: gemm 40% of peak", "n1: warm"]))
    led.append(ev.Hang(step=12, idle_s=121.0, suspects=[5], suspect_hosts=["n2"]))
    led.append(ev.Sdc(step=40, suspects=[1], suspect_hosts=["n4"], named=True))
    led.append(ev.Sdc(step=41, suspects=[0, 1], suspect_hosts=["n1"], named=False))  # unnamed: no evidence
    led.append(ev.DeviceHealth(step=50, host="n2", findings=["Xid 79 on GPU 3"]))
    for _ in range(2):
        led.append(ev.Stragglers(step=60, hosts=["n5"], factor=1.6))
    led.append(ev.Stragglers(step=70, hosts=["n6"], factor=1.4))  # once: noise


def test_evidence_from_a_ledger_kinds_nodes_and_numbers(tmp_path):
    ledger_with_evidence(tmp_path)
    got = {(x.node, x.kind) for x in nodes.from_events(ev.read(tmp_path), "r1")}
    assert got == {("n3", "burnin"), ("n2", "hang"), ("n4", "sdc"), ("n2", "xid"), ("n5", "straggler")}
    hang = next(x for x in nodes.from_events(ev.read(tmp_path), "r1") if x.kind == "hang")
    assert hang.numbers == {"idle_s": 121.0, "step": 12} and hang.run == "r1"


def test_the_store_is_append_only_idempotent_and_survives_a_torn_line(tmp_path):
    run, site = tmp_path / "run", tmp_path / "durable"
    ledger_with_evidence(run)
    assert nodes.record_run(site, run) == 5
    assert nodes.record_run(site, run) == 0  # the same ledger fed again adds nothing
    f = nodes.store_dir(site) / "n2.jsonl"
    assert len(f.read_text().splitlines()) == 2
    with open(f, "ab") as fh:
        fh.write(b'{"node": "n2", "kind": "ha')  # a writer killed mid-line
    later = nodes.Evidence("n2", "hang", time.time(), "r2", "hang suspect after step 3", {"idle_s": 90.0})
    assert nodes.record(site, [later]) == 1
    store = nodes.read(site)
    assert [x.kind for x in store["n2"]] == ["hang", "xid", "hang"]  # the torn line skipped, the next one whole
    assert set(store) == {"n2", "n3", "n4", "n5"}


def test_recent_repeated_evidence_excludes_decay_forgets_and_a_user_overrides():
    fresh = [nodes.Evidence("n2", "hang", NOW - 3600, "r", "x"), nodes.Evidence("n2", "xid", NOW - 60, "r", "y")]
    old = [nodes.Evidence("n7", "hang", NOW - 30 * 86400, "r", "x")] * 3
    store = {"n2": fresh, "n7": old, "n9": fresh[:1]}
    assert nodes.excluded(store, exclude_after=2, half_life_h=72, now=NOW) == {"n2": 2.0}
    assert nodes.excluded(store, exclude_after=2, half_life_h=72, now=NOW, use=["n2"]) == {}
    assert nodes.excluded(store, exclude_after=0, half_life_h=72, now=NOW) == {}  # off
    action, cmd = nodes.suggestion("n2", fresh, 1.9, 2)
    assert cmd is None and "burnin" in action  # under the threshold, but an Xid: check it
    action, cmd = nodes.suggestion("n2", fresh, 2.0, 2)
    assert cmd == 'scontrol update nodename=n2 state=drain reason="dslurm: hang+xid x2"'


def test_submit_leaves_out_remembered_nodes_and_says_so(tmp_path, capsys):
    now = time.time()
    nodes.record(tmp_path, [nodes.Evidence("n2", "hang", now - 10, "r", "a"),
                            nodes.Evidence("n2", "sdc", now - 5, "r", "b")])
    r = SimpleNamespace(site=SimpleNamespace(storage=SimpleNamespace(durable=str(tmp_path)),
                                             nodes=NodeEvidenceSpec(exclude_after=2, half_life_h=72)))
    assert remembered_bad(r) == ["n2"]  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "leaving out n2 (weight 2.0)" in err and "--use-node NODE" in err, err
    assert remembered_bad(r, ["n2"]) == []  # type: ignore[arg-type]


def test_site_nodes_command_shows_evidence_age_and_the_admin_command(tmp_path, capsys):
    run = tmp_path / "run"
    ledger_with_evidence(run)
    site = ROOT / "site-configs" / "local.yaml"
    args = ["site", "nodes", "--site", str(site), "--site-set", f"storage.durable={tmp_path / 'durable'}",
            "--site-set", "nodes.exclude_after=1"]
    assert main([*args, "--record", str(run)]) == 0
    out = capsys.readouterr().out
    assert "recorded 5 new piece(s) of evidence" in out
    assert "n2  weight 2.0  EXCLUDED from new jobs" in out, out
    assert 'admin:  scontrol update nodename=n2 state=drain reason="dslurm: hang+xid x2"' in out, out
    assert "hang suspect after step 12" in out and "min ago" in out
    assert main([*args, "--record", str(tmp_path / "nowhere")]) == 2


def test_requeue_me_feeds_the_sites_memory_from_the_runs_ledger(tmp_path, capsys):
    """At the end of each start (dslurm/requeue `remember_nodes`): the frozen site's storage.durable."""
    from dslurm.requeue import remember_nodes

    run = tmp_path / "run"
    ledger_with_evidence(run)
    site = (ROOT / "site-configs" / "local.yaml").read_text()
    (run / "site.yaml").write_text(site.replace("durable: checkpoints", f"durable: {tmp_path / 'durable'}"))
    (run / "job.yaml").write_text((ROOT / "examples" / "jobs" / JOB).read_text())
    remember_nodes(run)
    remember_nodes(run)  # the next start feeds the same ledger again: nothing new
    assert sorted(nodes.read(tmp_path / "durable")) == ["n2", "n3", "n4", "n5"]
    out = capsys.readouterr().out
    assert out.count("5 new piece(s) of evidence") == 1, out
    (run / "site.yaml").unlink()
    remember_nodes(run)  # a run without its frozen site: said, never fatal
    assert "site node memory not updated" in capsys.readouterr().out


def test_the_local_test_sites_record_but_never_exclude_a_node():
    """The suite's own faults (burn-in failures, hangs, SDC, stragglers by load on shared cores) are
    evidence against the local cluster's 3 nodes; with the default policy its later jobs were
    submitted with `--exclude node1` and refused. The local sites keep the record, never exclude."""
    from dslurm.config import load_site

    sites = sorted((ROOT / "site-configs").glob("local*.yaml"))
    assert len(sites) >= 2
    for path in sites:
        assert load_site(path).nodes.exclude_after == 0, path
