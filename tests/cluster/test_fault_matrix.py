"""The fault matrix on the real local Slurm (issue 12): every way a start can end, forced
deterministically with the knobs of dslurm/faults.py, classified from recorded facts and
decided right. Each test writes its row (scenario, promise, observed, lost steps, recovery
time) into docs/fault-matrix.md when it ends, passed or failed (tests/cluster/doc_rows.py).

Node layout of a 2-node x 2-process job: node1 holds ranks 0,1 and node2 ranks 2,3 (torchrun
orders nodes by host name). Jobs are tiny and share a start wherever the scenario allows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cluster_jobs import decisions, endings, events, job_spec, kill_node, logs, submit, trained_steps, wait_for
from doc_rows import DocTable
from dslurm import exitcodes as X
from dslurm import slurm
from dslurm.cluster.disrupt import job_pids, signal_pids
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from testkit import mount_tmpfs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / os.environ.get("DSLURM_FAULT_MATRIX_DOC", "docs/fault-matrix.md")
# scripts/race-soak.sh runs the crash race this many times per exit order, under a CPU hog.
RACE_REPEAT = int(os.environ.get("DSLURM_RACE_REPEAT", "1"))
TABLE = DocTable(
    DOC, "Crash race soak" if RACE_REPEAT > 1 else "Fault matrix",
    f"Produced by `{os.environ.get('DSLURM_FAULT_MATRIX_CMD', 'scripts/test.sh')}`. Recovery = the requeue decision "
    "to the first step of the next start (includes Slurm's requeue cycle, ~10 s here). Lost steps = steps trained "
    "twice plus steps trained after the last committed checkpoint of a finished run.",
    ["scenario", "promise", "observed", "lost steps", "recovery"], sys.modules[__name__])


@pytest.fixture(autouse=True)
def _row(request):
    yield
    TABLE.done(request.node)


def record(scenario: str, promise: str, observed: str, run: Path, recovery: bool = True) -> None:
    sm = summarize(ev.read(run))
    rec = []
    for prev, nxt in zip(sm.starts, sm.starts[1:]) if recovery else ():
        ends = [e.t for e in prev.all(ev.Ending)] + [e.t for e in prev.all(ev.Requeue)]
        if ends and nxt.windows:
            rec.append(nxt.windows[0].t - max(ends))
    TABLE.set([scenario, promise, observed, str(sm.lost_steps), ", ".join(f"{r:.0f} s" for r in rec) or "-"])


def rank_reports(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run / "starts").glob("*/rank-*.json"))]


# ---------------------------------------------------------------- the crash race, both orders


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attempt", range(RACE_REPEAT))
def test_crash_first_then_srun_kills_the_other_node_is_a_crash(slurm_cluster, cli, tmp_path, attempt):
    """Order A (the race that lost a retry): node1's ranks crash and exit first; node2's ranks
    linger, so srun's --kill-on-bad-exit TERMs node2's launcher (the step's code is then 1 or
    143: it decides nothing). The crash is retried; the same crash on the next start stops on
    the no-progress guard."""
    env = slurm_cluster.env()
    run = tmp_path / "race-a"
    spec = job_spec(tmp_path, "race-a", steps=20, env={"DSLURM_FAULT_CRASH": "15:0,1",
                                                       "DSLURM_FAULT_EXIT_DELAY": "8:2,3"},
                    requeue={"max_restarts": 4, "no_progress_limit": 1})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=400, env=env) == "FAILED", logs(run)
    info = slurm.job_info(job, env=env)
    assert info["restarts"] == 1 and str(info["exit_code"]).startswith(f"{X.NO_PROGRESS}:")
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["crash", "crash"], ends
    assert all(e["origin_rank"] in (0, 1) and e["origin_host"] == _hosts(run, e["restart"])[0] for e in ends), ends
    assert decisions(run) == ["requeue", "stop"]
    assert [e["step"] for e in events(run, "train_start")] == [0, 10]
    assert "injected crash before step 15" in logs(run)
    first = events(run, "requeue")[0]
    nth = f" #{attempt + 1}" if RACE_REPEAT > 1 else ""
    record(f"crash on node1 first, srun TERMs node2 (order A){nth}", "crash retried, same crash stops (76)",
           f"endings crash, crash (origin node1); step rc {first['step_rc']}; decisions requeue, stop 76", run)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("attempt", range(RACE_REPEAT))
def test_victims_exit_first_then_the_crashed_node_is_torn_down_is_a_crash(slurm_cluster, cli, tmp_path, attempt):
    """Order B: node1's crashing ranks report and then linger; node2's ranks see their peers
    vanish and exit first; srun then TERMs node1's launcher. Still node1's crash, retried,
    and the run completes on the next start."""
    env = slurm_cluster.env()
    run = tmp_path / "race-b"
    spec = job_spec(tmp_path, "race-b", steps=16, env={"DSLURM_FAULT_CRASH": "12:0,1@0",
                                                       "DSLURM_FAULT_EXIT_DELAY": "8:0,1@0"})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED", logs(run)
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["crash", "completed"], ends
    first, second = _hosts(run, 0)
    assert ends[0]["origin_host"] == first and ends[0]["origin_rank"] in (0, 1)
    victims = [r for r in rank_reports(run) if r["host"] == second and r["kind"] != "completed"]
    assert victims and all(r["kind"] in ("peer_lost", "killed_by_teardown") for r in victims), victims
    assert decisions(run) == ["requeue", "end"]
    assert [e["step"] for e in events(run, "train_start")] == [0, 10]
    nth = f" #{attempt + 1}" if RACE_REPEAT > 1 else ""
    record(f"node2's victims exit first, node1 torn down later (order B){nth}", "crash on node1 retried, completes",
           f"endings crash (origin node1), completed; node2 reported {sorted({v['kind'] for v in victims})}", run)


# ---------------------------------------------------------------- nothing bad is ever committed


def _finite_pointer_generation(run: Path, tmp_path: Path) -> int:
    """Load the pointer's generation whole and check every tensor is finite; returns its step."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dslurm.checkpoint import read_pointer, verify_generation

    ptr = read_pointer(run)
    assert ptr is not None, "no generation survived"
    gen = run / "generations" / ptr.generation
    assert verify_generation(gen) == []
    out = tmp_path / "ptr.pt"
    dcp_to_torch_save(gen, out)

    def tensors(obj):
        if isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, torch.Tensor) and obj.is_floating_point():
            yield obj

    ts = list(tensors(torch.load(out, weights_only=False)))
    assert ts and all(bool(torch.isfinite(t).all()) for t in ts)
    return ptr.step


@pytest.mark.timeout(400)
def test_a_diverging_run_never_commits_non_finite_state(slurm_cluster, cli, tmp_path):
    """train.lr=1000: the loss goes NaN within a few steps. Saves of non-finite state fail
    instead of committing, the pointer stays on a finite generation, the final save's failure
    ends the run as save_failed (74, not retried), and the ledger stays strict JSON."""
    env = slurm_cluster.env()
    run = tmp_path / "nan"
    # nonfinite off: this scenario proves the checkpoint layer's own refusal (the default policy,
    # stop, would end the run at the first NaN step with exit 81: test_hang_and_nan below).
    spec = job_spec(tmp_path, "nan", nodes=1, steps=16, interval=2, sleep=0.0,
                    train={"lr": 1000.0, "nonfinite": "off"})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=300, env=env) == "FAILED", logs(run)
    assert str(slurm.job_info(job, env=env)["exit_code"]).startswith(f"{X.SAVE_FAILED}:")
    losses = [e["loss"] for e in events(run, "steps")]
    assert any(x != x for x in losses), losses  # it really diverged (NaN read back as a float)
    failed = events(run, "ckpt_save_failed")
    assert failed and all("non-finite" in e["reason"] for e in failed)
    step = _finite_pointer_generation(run, tmp_path)
    assert endings(run) == ["save_failed"] and decisions(run) == ["stop"]
    assert "non-finite" in events(run, "ending")[0]["reason"]

    def refuse(name):
        raise ValueError(name)

    for line in (run / "ledger.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)  # strict JSON: no bare NaN
    sm = summarize(ev.read(run))
    assert sm.undurable_steps == 16 - step and sm.lost_steps >= 16 - step
    record("train.lr=1000 (NaN from a few steps in)", "no non-finite generation committed; ends save_failed",
           f"pointer on finite step {step}; {len(failed)} save(s) refused as non-finite; exit 74, no retry", run)


@pytest.mark.timeout(500)
def test_a_hang_on_node2_is_caught_and_the_requeue_completes(slurm_cluster, cli, tmp_path):
    """Issue 18: rank 2 (node2) hangs before step 12 on the first start only. The watchdog
    (bound max(3 x median step, 3 s)) fires on every rank, dumps stacks, names rank 2 on node2;
    the start ends as a crash (node2's rank reports it, node1's ranks report peer_lost), the
    requeue resumes from step 10 and the run completes."""
    env = slurm_cluster.env()
    run = tmp_path / "hang"
    spec = job_spec(tmp_path, "hang", steps=16, interval=10, sleep=0.2, env={"DSLURM_FAULT_HANG": "12:2@0"},
                    health={"hang_k": 3, "hang_floor_s": 3, "hang_ceiling_s": 60})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=450, env=env) == "COMPLETED", logs(run)
    (hang,) = events(run, "hang")
    second = _hosts(run, 0)[1]
    assert hang["suspects"] == [2] and hang["suspect_hosts"] == [second] and hang["step"] == 11, hang
    assert hang["idle_s"] <= hang["bound_s"] + 5, hang
    stacks = Path(hang["stacks_dir"])
    assert "before_step" in (stacks / "hang-rank-00002.txt").read_text()
    assert sorted(p.name for p in stacks.glob("hang-rank-*.txt")) == [f"hang-rank-{r:05d}.txt" for r in range(4)]
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["crash", "completed"], ends
    assert ends[0]["origin_rank"] == 2 and ends[0]["origin_host"] == second and "hang" in ends[0]["reason"]
    assert decisions(run) == ["requeue", "end"]
    assert [e["step"] for e in events(run, "train_start")] == [0, 10]
    record("rank 2 hangs before step 12 (DSLURM_FAULT_HANG)", "caught within the bound, stacks, crash retried",
           f"hang event after {hang['idle_s']:.1f} s (bound {hang['bound_s']:.1f} s), suspect rank 2 on node2; "
           "endings crash, completed", run)


@pytest.mark.timeout(500)
def test_a_bit_flip_in_one_hsdp_replica_is_named_blocklisted_and_rolled_back(slurm_cluster, cli, tmp_path):
    """Issue 18: 3 nodes x 2 processes, 3 HSDP replicas x tp 2 (node k holds replica k-1). Rank 2
    (node2) flips one parameter bit after step 7. The replica check before the save at step 10 finds
    node2's shard disagreeing with the other two, names and blocklists node2, rolls back to step 5's
    generation (saved after the clean check at step 5), and the run completes in one start. (The rollback on
    the cluster: a NaN's rollback, the same restore and skip, is tests/integration/test_health.py's.)"""
    env = slurm_cluster.env()
    run = tmp_path / "sdc"
    spec = job_spec(tmp_path, "sdc", nodes=3, steps=12, interval=5, sleep=0.1, env={"DSLURM_FAULT_BITFLIP": "7:2"},
                    train={"global_batch": 6}, parallel={"tp": 2, "dp_replicate": 3})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=450, env=env) == "COMPLETED", logs(run)
    (sdc,) = events(run, "sdc")
    assert sdc["step"] == 10 and sdc["last_clean_step"] == 5 and sdc["named"], sdc
    assert sdc["suspects"] == [2] and sdc["suspect_hosts"] == ["node2"] and sdc["blocklisted"] == ["node2"], sdc
    assert sdc["action"] == "rollback" and sdc["resumed_step"] == 5, sdc
    assert (run / "blocklist.txt").read_text().split() == ["node2"]
    assert endings(run) == ["completed"] and decisions(run) == ["end"]
    assert [e["step"] for e in events(run, "ckpt_save")] == [5, 10, 12]  # the corrupted step 10 never saved
    record("rank 2 (node2) flips a parameter bit after step 7 (DSLURM_FAULT_BITFLIP), 3 HSDP replicas",
           "caught at the next check, node named and blocklisted, rolled back to a clean generation, completes",
           f"sdc at step {sdc['step']}: rank 2 on node2 against the majority; blocklisted node2; rolled back to "
           f"{sdc['generation']}", run, recovery=False)

@pytest.fixture
def tiny_disks(tmp_path):
    """3 MB tmpfs mounts, one per run: the run's data (~2.1 MB) and logs fit, no checkpoint
    generation (~4.4 MB) does."""
    import subprocess

    mounts = []

    def make(name: str) -> Path:
        mnt = tmp_path / name
        mount_tmpfs(mnt, "3m")  # a failure as root, as the cluster is
        mounts.append(mnt)
        return mnt

    yield make
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(500)
def test_a_full_disk_is_never_called_success(slurm_cluster, cli, tmp_path, tiny_disks):
    """ENOSPC on every save, with each on_error policy: both end as save_failed with the disk
    named, exit 74, no retry (not 'completed', not 76 'no progress'); the report counts the
    steps that are in no checkpoint."""
    env = slurm_cluster.env()
    jobs, runs = {}, {}
    for policy in ("continue", "stop"):
        runs[policy] = tiny_disks(f"disk-{policy}") / "run"
        spec = job_spec(tmp_path, f"full-{policy}", nodes=1, steps=8, interval=3, sleep=0.0,
                        run_dir=runs[policy], checkpoint={"on_error": policy})
        jobs[policy] = submit(cli, env, spec)
    for policy, job in jobs.items():
        run = runs[policy]
        assert slurm.wait_job(job, timeout=300, env=env) == "FAILED", logs(run)
        assert str(slurm.job_info(job, env=env)["exit_code"]).startswith(f"{X.SAVE_FAILED}:")
        ends = events(run, "ending")
        assert [e["cls"] for e in ends] == ["save_failed"], ends
        assert "ENOSPC" in ends[0]["reason"] or "No space left" in ends[0]["reason"], ends[0]
        assert decisions(run) == ["stop"] and "not durable" in events(run, "requeue")[0]["reason"]
        assert not [e for e in events(run, "exit") if e["reason"] == "completed"]
        sm = summarize(ev.read(run))
        reached = 8 if policy == "continue" else 3
        assert sm.undurable_steps == reached and sm.lost_steps == reached, (policy, sm.undurable_steps)
        record(f"disk full, on_error: {policy}", "ends save_failed naming the disk; never 'completed'",
               f"ending save_failed (ENOSPC), exit 74, no retry; report: {sm.undurable_steps} step(s) in no "
               "checkpoint", run)


# ---------------------------------------------------------------- two submissions of one run


@pytest.mark.timeout(400)
def test_a_second_job_for_a_running_run_is_refused_not_retried(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "twice"
    spec = job_spec(tmp_path, "twice", nodes=1, steps=30)
    first = submit(cli, env, spec)
    wait_for(lambda: events(run, "train_start"), 120, "the first job training")
    res = cli("submit", "--site", "site-configs/local.yaml", "--job", spec, env=env)
    assert res.returncode == 0 and f"already has job {first} (RUNNING)" in res.stderr, res.stderr
    import re

    second = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
    assert slurm.wait_job(second, timeout=200, env=env) == "FAILED", logs(run)
    info = slurm.job_info(second, env=env)
    assert info["restarts"] == 0 and str(info["exit_code"]).startswith(f"{X.REFUSED}:")
    mine = [e for e in events(run, "ending") if e["job_id"] == str(second)]
    assert [e["cls"] for e in mine] == ["refused"] and "lock" in mine[0]["reason"].lower(), mine
    assert slurm.wait_job(first, timeout=300, env=env) == "COMPLETED", logs(run)
    assert [e["cls"] for e in events(run, "ending") if e["job_id"] == str(first)] == ["completed"]
    record("two submissions of one run", "the second is refused (79), not retried; the first completes",
           "warning at submit; second ended refused, 0 restarts; first completed", run, recovery=False)


# ---------------------------------------------------------------- preemptions vs the crash budget


def _hosts(run: Path, restart: int) -> list[str]:
    """The nodes a start ran on, in node-rank order (its launcher's job_start): Slurm picks them,
    and a start may land elsewhere than node1, node2 when another job still holds one."""
    (start,) = [e for e in events(run, "job_start") if e["restart"] == restart]
    return list(start["hosts"])


def _steps_in(run: Path, restart: int, job: int | None = None) -> int:
    got = [e["last"] for e in events(run, "steps")
           if e["restart"] == restart and (job is None or e["job_id"] == str(job))]
    return max(got, default=-1)


@pytest.mark.timeout(700)
def test_preemptions_spend_no_crash_budget_and_lose_no_steps(slurm_cluster, cli, tmp_path):
    """max_restarts: 1. Two external `scontrol requeue`s while training (each saves on TERM and
    resumes at exactly that step), then a crash on the third start: still retried, because
    preemptions are not failures of the job. The fourth start completes."""
    env = slurm_cluster.env()
    run = tmp_path / "preempt"
    spec = job_spec(tmp_path, "preempt", nodes=1, steps=40, env={"DSLURM_FAULT_CRASH": "26:0@2"},
                    requeue={"max_restarts": 1, "no_progress_limit": 3})
    job = submit(cli, env, spec)
    for restart in (0, 1):
        start = max([e["step"] for e in events(run, "train_start") if e["restart"] == restart], default=0)
        wait_for(lambda: _steps_in(run, restart) >= start + 3, 240, f"training in start {restart}")
        slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)
        wait_for(lambda: [e for e in events(run, "ending") if e["restart"] == restart], 120, "the ending")
    assert slurm.wait_job(job, timeout=500, env=env) == "COMPLETED", logs(run)
    assert endings(run) == ["preempted", "preempted", "crash", "completed"], events(run, "ending")
    assert decisions(run) == ["stop", "stop", "requeue", "end"]
    assert slurm.job_info(job, env=env)["restarts"] == 3
    exits = [e for e in events(run, "exit")]
    starts = events(run, "train_start")
    for prev, nxt in zip(exits[:2], starts[1:3]):  # the two preemptions: resumed exactly where saved
        assert prev["reason"] == "terminated" and nxt["step"] == prev["step"], (prev, nxt)
    redone = {s: n for s, n in trained_steps(run).items() if n > 1}
    assert all(s >= starts[3]["step"] for s in redone), redone  # only the crash cost steps
    record("2 x scontrol requeue, then a crash (max_restarts 1)", "preemptions lose 0 steps and spend no "
           "crash budget; the crash is still retried", f"endings {', '.join(endings(run))}; "
           f"{len(redone)} step(s) redone, all after the crash", run)


@pytest.mark.timeout(600)
def test_requeue_before_the_first_checkpoint_then_kill_9_of_one_rank(slurm_cluster, cli, tmp_path):
    """Start 0: `scontrol requeue` two steps in, before the first periodic checkpoint: the stop
    save is the first generation and start 1 resumes there. Start 1: rank 1 is SIGKILLed (no
    report at all): the launcher's facts name the crash, it is retried, start 2 completes."""
    env = slurm_cluster.env()
    run = tmp_path / "early"
    spec = job_spec(tmp_path, "early", nodes=1, steps=24, interval=10, env={"DSLURM_FAULT_KILL9": "16:1@1"})
    job = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0) >= 1, 240, "two steps in start 0")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)
    assert slurm.wait_job(job, timeout=500, env=env) == "COMPLETED", logs(run)
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["preempted", "crash", "completed"], ends
    assert ends[0]["saved"] and ends[0]["step"] < 10
    # the node the killed rank ran on: Slurm may place the requeued start on another node than start 0's
    host1 = [e["host"] for e in events(run, "job_start") if e["restart"] == 1]
    assert "left no report" in ends[1]["reason"] and [ends[1]["origin_host"]] == host1, (ends[1], host1)
    starts = events(run, "train_start")
    assert starts[1]["step"] == ends[0]["step"]  # resumed exactly at the stop save
    assert starts[2]["step"] == 10  # the last periodic save before the kill at 16
    record("requeue before the first checkpoint; then kill -9 of one rank", "stop save resumes exactly; "
           "a silent rank is a crash, retried", f"endings {', '.join(e['cls'] for e in ends)}; resumed at "
           f"{starts[1]['step']} then {starts[2]['step']}", run)


# ---------------------------------------------------------------- cancel, resubmit, torn ledger, corrupt metadata


@pytest.mark.timeout(760)
def test_cancel_resubmit_torn_ledger_corrupt_metadata_and_a_stray_term(slurm_cluster, cli, tmp_path):
    """One run directory, three jobs. Job 1 is cancelled (`dslurm cancel JOB`: scancel) while
    training: it saves on TERM, ends 'cancelled', Slurm does not requeue it. A torn line is left in
    the ledger (a kill -9 mid-write). Job 2 resumes at exactly the saved step, and its first event
    is intact (the report's queue wait is job 2's own); it is cancelled again, with
    `dslurm cancel --save RUN_DIR` (the request on record, then TERM to the job step). The
    pointer's `.metadata` is then corrupted: job 3 falls back loudly to the older generation, marks
    the corrupt one rejected, and retention deletes the corrupt one, never the verified fallback.
    While job 3 trains, a TERM reaches its job step only (`scancel --signal=TERM`, not the batch
    shell: issue 24's stray TERM): a stray stop, saved and requeued, and job 3 completes."""
    from dslurm.checkpoint import list_generations, read_pointer

    env = slurm_cluster.env()
    run = tmp_path / "cancel"
    spec = job_spec(tmp_path, "cancel", nodes=1, steps=40, interval=4, checkpoint={"keep": 2})
    job1 = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0, job1) >= 6, 240, "training in job 1")
    res = cli("cancel", str(job1), env=env)
    assert res.returncode == 0 and f"scancel {job1}" in res.stdout and "cancel.json" in res.stdout, res
    assert slurm.wait_job(job1, timeout=120, env=env) == "CANCELLED"
    wait_for(lambda: [e for e in events(run, "ending") if e["job_id"] == str(job1)], 60, "job 1's ending")
    saved = read_pointer(run).step
    e1 = [e for e in events(run, "ending") if e["job_id"] == str(job1)][0]
    assert (e1["cls"], e1["saved"], e1["step"]) == ("cancelled", True, saved), e1
    with open(run / "ledger.jsonl", "ab") as fh:
        fh.write(b'{"event":"steps","t":1,"job_id":"x","los')  # torn by a kill -9

    job2 = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0, job2) >= saved + 4, 240, "training in job 2")
    assert [e["step"] for e in events(run, "train_start") if e["job_id"] == str(job2)] == [saved]
    assert [e for e in events(run, "submit") if job2 in e["job_ids"]], "job 2's submit event was lost"
    res = cli("cancel", "--save", str(run), env=env)
    assert res.returncode == 0 and "scancel --signal=TERM" in res.stdout and "cancel.json" in res.stdout, res
    # The batch shell exits 143 after the save (FAILED to Slurm); the ending says who stopped it.
    assert slurm.wait_job(job2, timeout=120, env=env) in ("FAILED", "CANCELLED")
    wait_for(lambda: [e for e in events(run, "ending") if e["job_id"] == str(job2)], 60, "job 2's ending")
    e2 = [e for e in events(run, "ending") if e["job_id"] == str(job2)][0]
    assert (e2["cls"], e2["saved"]) == ("cancelled", True) and any("dslurm cancel --save" in x
                                                                   for x in e2["evidence"]), e2
    sm = summarize(ev.read(run))
    assert sm.skipped_lines == 0  # the torn line is finished with a newline, then skipped as garbage
    assert sm.starts[1].queue_wait_s < 60, [s.queue_wait_s for s in sm.starts]

    ptr = read_pointer(run)
    older = [g.name for g in list_generations(run) if g.committed and g.step < ptr.step]
    assert older, "retention must have kept a fallback"
    (run / "generations" / ptr.generation / ".metadata").write_bytes(b"rotten")
    job3 = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0, job3) >= 1 + max([e["step"] for e in events(run, "train_start")
                                                          if e["job_id"] == str(job3)], default=99), 240,
             "training in job 3")
    slurm.run_cmd(["scancel", "--signal=TERM", str(job3)], env=env)  # the job step only, not the batch shell
    assert slurm.wait_job(job3, timeout=400, env=env) == "COMPLETED", logs(run)
    stray = [e for e in events(run, "ending") if e["job_id"] == str(job3)][0]
    assert (stray["cls"], stray["saved"]) == ("stray_stop", True), stray
    assert any("batch shell got no TERM" in x for x in stray["evidence"]), stray
    rq3 = [e for e in events(run, "requeue") if e["job_id"] == str(job3)]
    assert [e["decision"] for e in rq3] == ["requeue", "end"] and "stray stop 1 of" in rq3[0]["reason"], rq3
    assert [e["step"] for e in events(run, "train_start") if e["job_id"] == str(job3)][1] == stray["step"]
    fb = events(run, "ckpt_fallback")
    assert fb and fb[0]["generation"] == older[-1] and ptr.generation in fb[0]["rejected"], fb
    assert "CHECKPOINT FALLBACK" in logs(run)
    left = {g.name for g in list_generations(run)}
    assert ptr.generation not in left  # the corrupt one is gone ...
    assert read_pointer(run).step == 40
    assert [e["cls"] for e in events(run, "ending")] == ["cancelled", "cancelled", "stray_stop", "completed"]
    record("dslurm cancel, resubmit, dslurm cancel --save; torn ledger line; corrupt .metadata; a TERM to the "
           "job step only", "resume at exactly the saved step; no event lost after a torn line; loud fallback "
           "to a verified generation, the corrupt one deleted; a stray TERM is saved and requeued, not a "
           "cancel (recovery here includes the test's own resubmissions)",
           f"job 2 resumed at {saved}; queue wait {sm.starts[1].queue_wait_s:.0f} s; job 3 fell back to step "
           f"{fb[0]['step']}, stray stop at {stray['step']}, requeued, completed", run)


# ---------------------------------------------------------------- SIGKILL of everything, node loss


@pytest.mark.timeout(600)
def test_sigkill_of_the_whole_job_during_an_async_save(slurm_cluster, cli, tmp_path):
    """Every process of the job is SIGKILLed while an async save is in flight (the knob holds the
    background write open for 8 s). No ending can be written by that start: the next job writes
    it late. The pointer stays on a verified generation and the next job resumes from it."""
    import signal

    from dslurm.checkpoint import read_pointer, verify_generation

    env = slurm_cluster.env()
    run = tmp_path / "sigkill"
    spec = job_spec(tmp_path, "sigkill", nodes=1, steps=24, interval=6, checkpoint={"async_save": True},
                    env={"DSLURM_FAULT_SAVE_SLEEP": "8"})
    job = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0, job) >= 14, 240, "the second async save in flight")
    assert [e["step"] for e in events(run, "ckpt_save")] == [6]  # 12 is in flight
    signal_pids(job_pids(job), signal.SIGKILL)
    slurm.wait_job(job, timeout=120, env=env)
    ptr = read_pointer(run)
    assert ptr.step == 6 and verify_generation(run / "generations" / ptr.generation) == []
    job2 = submit(cli, env, spec)
    assert slurm.wait_job(job2, timeout=300, env=env) == "COMPLETED", logs(run)
    ends = events(run, "ending")
    late = [e for e in ends if e.get("late")]
    assert len(late) == 1 and late[0]["job_id"] == str(job) and late[0]["cls"] == "crash", ends
    assert [e["step"] for e in events(run, "train_start") if e["job_id"] == str(job2)] == [6]
    record("SIGKILL of every process of the job during an async save", "pointer stays verified; the start's "
           "ending is written by the next job", f"pointer at 6 (12 in flight, never committed); late ending "
           f"{late[0]['cls']}; job 2 resumed at 6", run)


@pytest.mark.timeout(900)
def test_node_loss_is_requeued_and_its_ending_recorded(slurm_cluster, cli, tmp_path):
    """node2's slurmd and everything under it die mid-training. Slurm marks the node down and
    the job NODE_FAIL; the job is requeued onto healthy nodes and completes, and the lost
    start has its ending (node failure), written by whoever survived."""
    from dslurm import cluster

    env = slurm_cluster.env()
    run = tmp_path / "nodeloss"
    spec = job_spec(tmp_path, "nodeloss", steps=30, interval=5)
    job = submit(cli, env, spec)
    try:
        wait_for(lambda: _steps_in(run, 0, job) >= 7, 240, "training on two nodes")
        kill_node("node2")
        from dslurm.checkpoint import read_pointer

        at_kill = read_pointer(run).step
        assert slurm.wait_job(job, timeout=600, env=env) == "COMPLETED", logs(run)
    finally:
        cluster.up(nodes=3, accounting=True)  # node2 back for the tests after this one
    ends = events(run, "ending")
    assert [e["cls"] for e in ends] == ["node_failure", "completed"], ends
    assert ends[0]["restart"] == 0 and "node2" in json.dumps(ends[0]), ends[0]
    assert [e["step"] for e in events(run, "train_start")][1] == at_kill
    # requeued through the queue, away from the lost node (test_spares' swap-vs-requeue test asserted
    # this for its no-spares job before that measurement moved to bench/bench_warm_spare.py)
    assert "node2" not in events(run, "job_start")[-1]["hosts"] and slurm.job_info(job, env=env)["restarts"] == 1
    record("node loss (node2's slurmd and its processes killed)", "requeued on healthy nodes; the lost "
           "start's ending recorded", f"ending node_failure{' (late)' if ends[0].get('late') else ''}, then "
           f"completed; resumed at {at_kill}", run)


# ---------------------------------------------------------------- operator controls on an own script


@pytest.mark.timeout(600)
def test_ctl_save_and_stop_on_an_own_script_end_as_an_operators_stop(slurm_cluster, cli, tmp_path):
    """examples/jobs/own-safe.yaml (examples/own_script/train_safe.py: dslurm.runtime, the burn-in
    first), given more steps so the requests land mid-run. `dslurm ctl RUN save` is taken by the
    script's `dr.stop_requested` and saved through `ckpt.due`; `dslurm ctl RUN stop` saves and ends
    the run as an operator's stop: its own ending, not requeued, the job CANCELLED in Slurm (not
    FAILED 143), named so in the report; a later `ctl` on the ended run is refused at once."""
    import time
    from types import SimpleNamespace

    from dslurm.checkpoint import read_pointer

    env = slurm_cluster.env()
    run = tmp_path / "own-ctl"
    entry = (f"entry=[examples/own_script/train_safe.py, --steps, '400', --step-sleep, '0.3', --out, "
             f"{tmp_path / 'own-ctl.pt'}]")
    res = cli("submit", "--site", "site-configs/local.yaml", "--job", "examples/jobs/own-safe.yaml",
              "--set", f"checkpoint.run_dir={run}", "--set", entry, "--set", "checkpoint.interval=1000", env=env)
    assert res.returncode == 0, res.stderr
    job = int(res.stdout.split("submitted job ")[1].split()[0])
    wait_for(lambda: events(run, "steps"), 300, "the script's first logged step")

    t_save = time.time()
    res = cli("ctl", str(run), "save", env=env)
    assert res.returncode == 0 and f"for start {job}.0" in res.stdout, (res.stdout, res.stderr)
    (taken,) = wait_for(lambda: events(run, "operator_request"), 60, "the ctl save taken")
    # async_save: its ckpt_save event comes when the next save waits for it; the pointer says it now
    wait_for(lambda: (read_pointer(run) or SimpleNamespace(step=0)).step == taken["step"], 120, "the ctl save")
    save_s = time.time() - t_save
    t_stop = time.time()
    res = cli("ctl", str(run), "stop", env=env)
    assert res.returncode == 0, res.stderr
    assert slurm.wait_job(job, timeout=120, env=env) == "CANCELLED", logs(run)
    ops = [(e["action"], e["step"], e["recorded"]) for e in events(run, "operator_request")]
    assert [a for a, _, _ in ops] == ["save", "stop"] and ops[1][2], ops
    (end,) = events(run, "ending")
    stop_s = end["t"] - t_stop
    assert (end["cls"], end["saved"], end["step"]) == ("operator_stop", True, ops[1][1]), end
    assert stop_s < 60, stop_s
    assert [e["step"] for e in events(run, "ckpt_save")] == [ops[0][1], ops[1][1]]
    assert decisions(run) == ["stop"] and slurm.job_info(job, env=env)["restarts"] == 0
    report = cli("report", str(run), "--json", "--no-png", env=env)
    summary = json.loads(report.stdout)
    assert summary["status"] == "incomplete" and "operator_stop" in summary["why"], summary
    late = cli("ctl", str(run), "stop", env=env)  # nothing runs now: refused, no request left behind
    assert late.returncode != 0 and "no start of" in late.stderr and not (run / "ctl_request.json").exists()
    record("own script (examples/jobs/own-safe.yaml): dslurm ctl save, then ctl stop",
           "each taken at a step boundary within a poll (5 s) by dr.stop_requested; both saves commit",
           f"save committed at step {ops[0][1]} within {save_s:.1f} s of ctl; stop saved at step {ops[1][1]}, "
           f"ending recorded {stop_s:.1f} s after ctl", run, recovery=False)
    record("operator stop (dslurm ctl stop)", "its own ending, not requeued; the job ends CANCELLED (not FAILED "
           "143); the report names it; a later ctl is refused", f"ending operator_stop, decision stop, Slurm "
           f"CANCELLED, 0 restarts; report: status {summary['status']}, why '{summary['why'].split(':')[0]}'; a ctl "
           f"after the end refused", run,
           recovery=False)
