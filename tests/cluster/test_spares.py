"""Recovery inside the allocation on the real local Slurm (issue 17): a job with spares survives
a kill -9 of one training process, the loss of a node for real (its slurmd killed) and, with no
spare left, shrinks to fewer nodes or requeues without the bad nodes. Each test writes its row
into docs/spares-results.md when it ends, passed or failed (tests/cluster/doc_rows.py).

The cluster has 3 nodes; a 2+1 job holds all of them. Jobs take node1, node2, node3 in that
order: node1 runs the batch shell (and `dslurm supervise`), so the tests lose node2 and node3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cluster_jobs import events, job_spec, kill_node, logs, submit, trained_steps, wait_for
from doc_rows import DocTable
from dslurm import slurm
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.run import read_blocklist
from dslurm.selftest.chaos.run import NEVER_CLEARS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/spares-results.md"
TABLE = DocTable(
    DOC, "Recovery inside the allocation: results",
    "Produced by `pytest tests/cluster/test_spares.py`. Time to training = the failure (the earliest report of it; "
    "for a lost node, when its step ended) to the first step of the next job step, from `dslurm report`. The spare "
    "swap against a requeue after the same node loss is measured by `bench/bench_warm_spare.py --cold-swap` "
    "(docs/recovery.md \"Warm restarts\"), not by the suite.",
    ["scenario", "recoveries (cause: mode, time to training)", "sacct", "endings"], sys.modules[__name__])


@pytest.fixture(autouse=True)
def _row(request):
    yield
    TABLE.done(request.node)


def _trained_in(run: Path, nth_start: int, step: int) -> bool:
    """The nth train_start (1-based) happened and a steps window after it reached `step`."""
    recs = events(run)
    starts = [i for i, e in enumerate(recs) if e["event"] == "train_start"]
    if len(starts) < nth_start:
        return False
    return any(e["event"] == "steps" and e["last"] >= step for e in recs[starts[nth_start - 1]:])


def _resumed_from_newest_checkpoint(run: Path) -> list[int]:
    """For each recovery: the step the next job step resumed from equals the newest committed
    save before the failure (0 steps lost beyond the last checkpoint). Returns the resume steps."""
    recs = events(run)
    out = []
    for i, e in enumerate(recs):
        if e["event"] != "recovery":
            continue
        saved = [x["step"] for x in recs[:i] if x["event"] == "ckpt_save"]
        nxt = next(x for x in recs[i:] if x["event"] == "train_start")
        assert nxt["step"] == e["resume_step"] == max(saved), (e, nxt, saved)
        out.append(nxt["step"])
    return out


def _losses(run: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in events(run, "steps"):
        out.setdefault(e["last"], []).append(e["loss"])
    return out


def _row(scenario: str, run: Path, job: int, env) -> None:
    sm = summarize(ev.read(run))
    recs = ", ".join(f"{r.cause}: {r.mode} {r.resumed_s:.0f} s" if r.resumed_s is not None else f"{r.cause}: {r.mode}"
                     for r in sm.recoveries)
    info = slurm.job_info(job, env=env)
    TABLE.set([scenario, recs or "-", f"1 job, {info['restarts']} restart(s), {info['state']}",
               ", ".join(e["cls"] for e in events(run, "ending"))])


@pytest.mark.timeout(1200)
def test_kill9_node_loss_and_shrink_recovered_inside_one_allocation(slurm_cluster, cli, tmp_path):
    """One 2+1 job, `on_spares_exhausted: shrink`. Step 0: rank 1 SIGKILLs itself before step 12
    (no report at all): a crash with no node at fault, retried on the same nodes. Step 1: node2's
    slurmd and everything under it die: the spare node3 takes its place, node2 is blocklisted.
    Step 2: node3 dies too, no spare is left: training goes on on node1 alone with grad_accum 2
    (same global batch). The job completes; sacct shows one job and no restart; the loss at every
    step trained twice matches; every step resumed from the newest checkpoint."""
    from dslurm import cluster

    env = slurm_cluster.env()
    run = tmp_path / "spares"
    spec = job_spec(tmp_path, "spares", steps=40, interval=5, spares=1, on_spares_exhausted="shrink",
                    env={"DSLURM_FAULT_KILL9": "12:1@0.0"}, requeue={"max_restarts": 4, "no_progress_limit": 2})
    job = submit(cli, env, spec)
    try:
        wait_for(lambda: events(run, "recovery"), 300, "the kill -9 recovered inside the allocation")
        wait_for(lambda: _trained_in(run, 2, 17), 300, "training in the second job step")
        kill_node("node2")
        wait_for(lambda: len(events(run, "recovery")) >= 2, 300, "node2's loss recovered with the spare")
        wait_for(lambda: _trained_in(run, 3, 27), 300, "training on node1 + node3")
        kill_node("node3")
        assert slurm.wait_job(job, timeout=600, env=env) == "COMPLETED", logs(run)
    finally:
        cluster.up(nodes=3, accounting=True)  # node2 and node3 back for the tests after this one
    info = slurm.job_info(job, env=env)
    assert info["restarts"] == 0, info  # no requeue: sacct shows one job, no restart
    assert [e["cls"] for e in events(run, "ending")] == ["crash", "node_failure", "node_failure", "completed"]
    assert [e["decision"] for e in events(run, "requeue")] == ["end"]
    recs = events(run, "recovery")
    assert [(r["mode"], r["removed"], r["added"]) for r in recs] == [
        ("same_nodes", [], []), ("spare", ["node2"], ["node3"]), ("shrink", ["node3"], [])]
    assert recs[2]["grad_accum"] == 2 and recs[2]["nodes"] == ["node1"]
    assert read_blocklist(run) == ["node2", "node3"]
    starts = events(run, "train_start")
    assert [s["step"] for s in starts] == [0, *_resumed_from_newest_checkpoint(run)]
    assert starts[1]["step"] == 10  # the kill before step 12: the save at 10 is the newest
    sizes = [ev.TrainStart(layout=s["layout"]).world_size for s in starts]
    assert sizes == [4, 4, 4, 2], sizes
    for step, losses in _losses(run).items():  # loss continuous: a redone step trains the same batch
        assert max(losses) - min(losses) <= 0.05 * abs(losses[0]) + 1e-3, (step, losses)
    assert max(trained_steps(run)) == 39
    sm = summarize(ev.read(run))
    assert [r.mode for r in sm.recoveries] == ["same_nodes", "spare", "shrink"]
    assert all(r.resumed_s is not None for r in sm.recoveries)
    _row("2+1, shrink: kill -9 of rank 1, then node2 lost, then node3 lost", run, job, env)


@pytest.mark.timeout(900)
def test_spares_exhausted_with_requeue_requeues_to_wait_for_the_lost_nodes(slurm_cluster, cli, tmp_path):
    """The same 2+1 job with `on_spares_exhausted: requeue`: node2 lost -> the spare takes over;
    node3 lost -> no spare left: requeued. Both lost nodes are blocklisted, but the 3-node cluster
    cannot spare either for a 3-node job: excluded, they would make it "never runnable" even once
    they are back (BadConstraints for ever). So both are readmitted and the job waits for them,
    pending for a reason a wait clears (the test cancels it)."""
    from dslurm import cluster
    from dslurm.slurm.hosts import expand_hosts

    env = slurm_cluster.env()
    run = tmp_path / "spares-rq"
    spec = job_spec(tmp_path, "spares-rq", steps=60, interval=5, spares=1, on_spares_exhausted="requeue")
    job = submit(cli, env, spec)
    try:
        wait_for(lambda: _trained_in(run, 1, 7), 300, "training in the first job step")
        kill_node("node2")
        wait_for(lambda: events(run, "recovery"), 300, "node2's loss recovered with the spare")
        wait_for(lambda: _trained_in(run, 2, 13), 300, "training on node1 + node3")
        kill_node("node3")
        wait_for(lambda: events(run, "requeue"), 300, "the requeue decision")
        wait_for(lambda: slurm.job_info(job, env=env)["restarts"] >= 1, 120, "the job requeued")
        rec = slurm.parse_scontrol_records(slurm.run_cmd(["scontrol", "-o", "show", "job", str(job)], env=env).stdout)
        excluded = expand_hosts(rec[0].get("ExcNodeList", "")) if rec[0].get("ExcNodeList") not in (None, "(null)") \
            else []
        waived = [h for e in events(run, "blocklist_waived") for h in e["hosts"]]
        assert excluded == [] and sorted(waived) == ["node2", "node3"], (rec[0], waived)
        # past the requeue's BeginTime a scheduling pass names Slurm's reason: one a wait clears
        def reason() -> str | None:
            r = slurm.parse_scontrol_records(slurm.run_cmd(["scontrol", "-o", "show", "job", str(job)],
                                                           env=env).stdout)[0]
            return None if r.get("Reason") in (None, "None", "BeginTime") else f"{r.get('JobState')} {r['Reason']}"
        why = wait_for(reason, 120, "Slurm's reason for the requeued job")
        assert why.startswith("PENDING") and not why.split()[1].startswith(NEVER_CLEARS), why
        _row("2+1, requeue: node2 lost, then node3 lost", run, job, env)
    finally:
        slurm.run_cmd(["scancel", str(job)], env=env, check=False)
        cluster.up(nodes=3, accounting=True)
    assert [e["cls"] for e in events(run, "ending")][:2] == ["node_failure", "node_failure"]
    assert [e["decision"] for e in events(run, "requeue")][:1] == ["requeue"]
    assert [(r["mode"], r["removed"], r["added"]) for r in events(run, "recovery")] == [("spare", ["node2"], ["node3"])]
    assert read_blocklist(run) == ["node2", "node3"]
