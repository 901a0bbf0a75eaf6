"""The in-allocation recovery loop (dslurm/recover/supervise.py) against a fake of its Runner
interface only: the fake plays srun and the step's processes by writing the facts those would
write (rank and launcher reports) and plays Slurm's node states; classification, the restart
budget, the no-progress guard, the node plan, the blocklist and the ledger are the real code."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.endings import facts as F
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.observe.report import summarize
from dslurm.recover.srun import SrunRunner
from dslurm.recover.supervisor import Step, Supervisor
from dslurm.run import read_blocklist
from dslurm.submission import freeze_and_render

HOSTS = ["node1", "node2", "node3"]


class FakeCluster:
    """srun + Slurm as the loop sees them. `script[i]` plays job step i."""

    def __init__(self, run_dir: Path, script):
        self.run_dir, self.script = run_dir, script
        self.steps: list[Step] = []
        self.down: set[str] = set()
        self.acted: list = []
        self.drained: list = []
        self.signalled: list[int] = []
        self.on_run = None
        self.answers: dict[str, bool] = {}  # a probe's result per silent host (default: no answer)
        self.probed: list = []
        self.abandons: list = []

    def run(self, step: Step, abandon) -> int:
        self.abandons.append(abandon)
        self.steps.append(step)
        if self.on_run:
            self.on_run(step)
        return self.script[step.index](self, step)

    def signal(self, signum: int) -> None:
        self.signalled.append(signum)

    def view(self, hosts):
        down = [h for h in hosts if h in self.down]
        return E.SlurmView(state="RUNNING", down_nodes=tuple(down), node_states=tuple(f"{h}: DOWN" for h in down))

    def act(self, dec, ending, env, run_dir, chain) -> None:
        self.acted.append(dec)

    def drain(self, hosts, reason) -> None:
        self.drained.append((list(hosts), reason))

    def probe(self, hosts, timeout_s):
        self.probed.append((list(hosts), timeout_s))
        return tuple(h for h in hosts if not self.answers.get(h, False))

    # ---- what a step's processes would record

    def train(self, step: Step, resume: int, reached: int) -> None:
        """The step's node 0 launcher and rank 0 as they start and train (the ledger)."""
        led = Ledger(self.run_dir)
        led.append(ev.JobStart(hosts=list(step.hosts), mode="torchrun", nproc_per_node=2))
        led.append(ev.TrainStart(step=resume, layout={"dp_shard": len(step.hosts), "tp": 2}))
        for s in range(resume, reached):
            led.append(ev.Steps(first=s, last=s, loss=1.0, step_time_s=0.01, duration_s=0.01))

    def ranks(self, step: Step, kinds: dict[str, str], at: int, lost: tuple[str, ...] = ()) -> None:
        env = {F.ENV: str(step.facts_dir)}
        for i, host in enumerate(step.hosts):
            if host in lost:
                continue  # a lost node writes nothing
            for local in (0, 1):
                kind = kinds.get(f"{host}:{local}", kinds.get(host, "completed"))
                F.write_rank_report(F.RankReport(rank=2 * i + local, kind=kind, code=0 if kind == "completed" else 1,
                                                 step=at, host=host, error="boom" if kind == "crash" else ""), env)
            failed = any(kinds.get(f"{host}:{x}", kinds.get(host, "completed")) != "completed" for x in (0, 1))
            F.write_launcher_report(F.LauncherReport(host=host, node_rank=i, signals=[], torchrun_rc=1 if failed else 0,
                                                     worker_codes={}, silent_local_ranks=[], code=int(failed)), env)


def completes(c: FakeCluster, step: Step) -> int:
    c.train(step, resume=10 * step.index, reached=30)
    c.ranks(step, {}, 30)
    return 0


def crashes(c: FakeCluster, step: Step) -> int:
    """kill -9 / an exception on node1's rank 1: the others are victims; srun says 143."""
    c.train(step, resume=10 * step.index, reached=10 * step.index + 5)
    first = step.hosts[0]
    c.ranks(step, {f"{first}:1": "crash", **{h: "peer_lost" for h in step.hosts[1:]}, f"{first}:0": "peer_lost"},
            10 * step.index + 5)
    return 143


def loses(host: str):
    def play(c: FakeCluster, step: Step) -> int:
        c.train(step, resume=10 * step.index, reached=10 * step.index + 5)
        c.down.add(host)
        c.ranks(step, {h: "peer_lost" for h in step.hosts}, 10 * step.index + 5, lost=(host,))
        return 1
    return play


@pytest.fixture
def make(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr("dslurm.slurm.load_factor", lambda *a, **k: 1.0)  # probe timeouts as on an idle machine

    def build(script, *, spares=1, on_exhausted="requeue", requeue=None, allow_drain=False, nodes=2):
        site = load_site("site-configs/local.yaml", [f"burnin.allow_drain={str(allow_drain).lower()}"])
        job = load_job(data={"name": "sp", "nodes": nodes, "spares": spares, "on_spares_exhausted": on_exhausted,
                             "model": {"preset": "tiny"}, "parallel": {"tp": 2}, "train": {"global_batch": 8},
                             "requeue": requeue or {"max_restarts": 4, "no_progress_limit": 0},
                             "checkpoint": {"run_dir": str(tmp_path / "run")}})
        r = resolve(site, job)
        freeze_and_render(r)
        cluster = FakeCluster(r.run_dir, script)
        env = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "DSLURM_RUN_DIR": str(r.run_dir)}
        return Supervisor(r, cluster, env, HOSTS[: nodes + spares]), cluster, r.run_dir
    return build


def _events(run: Path, kind):
    return list(ev.of(ev.read(run), kind))


def test_a_killed_process_is_recovered_on_the_same_nodes_without_a_requeue(make):
    sup, c, run = make([crashes, completes])
    assert sup.loop() == X.OK
    assert [s.hosts for s in c.steps] == [("node1", "node2")] * 2
    rec, = _events(run, ev.Recovery)
    assert (rec.cause, rec.mode, rec.removed, rec.added) == ("crash", "same_nodes", [], [])
    assert [e.cls for e in _events(run, ev.Ending)] == ["crash", "completed"]
    assert [d.action for d in c.acted] == ["end"]  # one decision, at the end: no requeue
    assert [e.decision for e in _events(run, ev.Requeue)] == ["end"]
    assert read_blocklist(run) == []
    # each step has its own facts dir, each with its ending
    assert sorted(p.name for p in (run / "starts").iterdir()) == ["4242.0", "4242.0.1"]
    assert all((run / "starts" / n / "ending.json").exists() for n in ("4242.0", "4242.0.1"))


def test_a_lost_node_is_replaced_by_the_spare_and_blocklisted(make):
    sup, c, run = make([loses("node2"), completes], allow_drain=True)
    assert sup.loop() == X.OK
    assert [s.hosts for s in c.steps] == [("node1", "node2"), ("node1", "node3")]
    rec, = _events(run, ev.Recovery)
    assert (rec.cause, rec.mode, rec.removed, rec.added, rec.nodes) == (
        "node_failure", "spare", ["node2"], ["node3"], ["node1", "node3"])
    assert rec.failed_t and rec.failed_t <= rec.t and rec.step_index == 1
    assert read_blocklist(run) == ["node2"]
    assert c.drained == [(["node2"], "dslurm recovery: node_failure in job 4242")]
    assert [e.cls for e in _events(run, ev.Ending)] == ["node_failure", "completed"]


def test_spares_exhausted_shrink_goes_on_with_fewer_nodes_and_more_accumulation(make):
    sup, c, run = make([loses("node2"), loses("node3"), completes], on_exhausted="shrink")
    assert sup.loop() == X.OK
    assert [s.hosts for s in c.steps] == [("node1", "node2"), ("node1", "node3"), ("node1",)]
    assert [s.grad_accum for s in c.steps] == [None, None, 2]  # dp 2 -> 1, global batch 8 kept
    modes = [(e.mode, e.to_nodes, e.grad_accum) for e in _events(run, ev.Recovery)]
    assert modes == [("spare", 2, None), ("shrink", 1, 2)]
    assert read_blocklist(run) == ["node2", "node3"]
    sm = summarize(ev.read(run))
    assert [r.mode for r in sm.recoveries] == ["spare", "shrink"]
    assert all(r.resumed_s is not None and r.resumed_s >= 0 for r in sm.recoveries)
    assert [s.outcome for s in sm.starts] == ["recovered in the allocation (spare)",
                                              "recovered in the allocation (shrink)", "ended"]


def test_spares_exhausted_requeue_goes_through_the_queue_without_the_bad_nodes(make):
    sup, c, run = make([loses("node2"), loses("node3")], on_exhausted="requeue")
    assert sup.loop() == X.OK
    assert len(c.steps) == 2
    assert [d.action for d in c.acted] == ["requeue"]  # act_on requeues excluding the blocklist
    assert read_blocklist(run) == ["node2", "node3"]
    assert [e.cls for e in _events(run, ev.Ending)] == ["node_failure", "node_failure"]


def test_recoveries_spend_the_restart_budget(make):
    sup, c, run = make([crashes, crashes, crashes], requeue={"max_restarts": 2, "no_progress_limit": 0})
    assert sup.loop() == X.BUDGET
    assert len(c.steps) == 3 and len(_events(run, ev.Recovery)) == 2
    assert [d.action for d in c.acted] == ["stop"]


def test_the_no_progress_guard_stops_recoveries_that_resume_at_the_same_step(make):
    def stuck(c, step):  # every step starts at 0 (no checkpoint ever commits) and crashes
        Ledger(c.run_dir).append(ev.JobStart(hosts=list(step.hosts)))
        Ledger(c.run_dir).append(ev.TrainStart(step=0))
        c.ranks(step, {"node1": "crash"}, 3)
        return 1
    sup, c, run = make([stuck] * 5, requeue={"max_restarts": 9, "no_progress_limit": 2})
    assert sup.loop() == X.NO_PROGRESS
    assert len(c.steps) == 2


def test_a_preemption_during_a_step_is_not_recovered_here(make):
    def preempted(c, step):
        c.train(step, 0, 4)
        sup.on_signal("TERM")  # Slurm's TERM reached the supervisor (forwarded by the batch shell)
        F.write_rank_report(F.RankReport(rank=0, kind="terminated_saved", code=143, step=4, signal="SIGTERM"),
                            {F.ENV: str(step.facts_dir)})
        return 143
    sup, c, run = make([preempted, completes])
    assert sup.loop() == X.TERMINATED
    assert len(c.steps) == 1 and not _events(run, ev.Recovery)
    assert [e.cls for e in _events(run, ev.Ending)] == ["preempted"]
    assert F.read_start(run / "starts" / "4242.0").batch_signals[0][0] == "TERM"


def test_a_warning_before_the_first_step_goes_with_it_and_is_recorded_there(make, tmp_path):
    """Found by `dslurm selftest chaos` (seed 1): USR2 at the batch shell right after a requeue, before
    supervise had its handler, killed supervise and ended the job FAILED. The batch shell now starts it
    with USR2 ignored and records the signal; supervise takes it from the start's batch.signals, hands
    it to the first step (its launchers leave it for the trainer) and records it in that step's facts."""
    from dslurm.recover.supervise import early_signals

    start = tmp_path / "start"
    start.mkdir()
    (start / "batch.signals").write_text("USR2 1796302075.664214\n")
    assert early_signals({F.ENV: str(start)}) == ["USR2"] and early_signals({}) == []

    def warned(c, step):
        c.train(step, 0, 1)
        F.write_rank_report(F.RankReport(rank=0, kind="requeue", code=75, step=1, signal="SIGUSR2"),
                            {F.ENV: str(step.facts_dir)})
        return 75
    sup, c, run = make([warned, completes])
    for name in early_signals({F.ENV: str(start)}):
        sup.on_signal(name)  # before any step's facts dir exists
    sup.loop()
    assert [s.stop for s in c.steps] == ["SIGUSR2"]  # one step, carrying the warning; no recovery after it
    assert F.read_start(run / "starts" / "4242.0").batch_signals[0][0] == "USR2"
    assert [e.cls for e in _events(run, ev.Ending)] == ["warned_stop"]


def test_the_real_runner_hands_a_pending_stop_to_the_step(make, tmp_path, monkeypatch):
    from dslurm.launch.slurm_env import PENDING_STOP_ENV

    sup, _, run = make([completes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "${PENDING_STOP_ENV}" > "$DSLURM_FACTS_DIR/pending"\n')
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    runner = SrunRunner(sup.r, ["launch"], dict(__import__("os").environ))
    d = sup.step_dir(0)
    assert runner.run(Step(index=0, hosts=("node1",), facts_dir=d, stop="SIGUSR2"), lambda: False) == 0
    assert (d / "pending").read_text().strip() == "SIGUSR2"


def test_a_completed_run_ends_at_once(make):
    sup, c, run = make([completes])
    assert sup.loop() == X.OK and len(c.steps) == 1 and not _events(run, ev.Recovery)


def test_the_srun_line_names_the_training_nodes_and_a_shrinks_accumulation(make):
    sup, _, run = make([completes])
    runner = SrunRunner(sup.r, ["python", "-m", "dslurm", "launch", "--", "python", "-m", "train"], {})
    argv = runner.argv(Step(index=2, hosts=("node1", "node3"), facts_dir=run, grad_accum=None))
    assert argv[:8] == ["srun", "--kill-on-bad-exit=1", "--overlap", "--nodes=2", "--nodelist=node1,node3",
                        "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=2"]  # not the allocation's SLURM_NTASKS
    assert argv[-1] == "train"
    shrunk = runner.argv(Step(index=3, hosts=("node1",), facts_dir=run, grad_accum=2))
    assert shrunk[3:6] == ["--nodes=1", "--nodelist=node1", "--ntasks=1"]
    assert shrunk[-2:] == ["--set", "train.grad_accum=2"]


def test_the_real_runner_runs_a_step_with_its_own_facts_dir_and_forwards_signals(make, tmp_path, monkeypatch):
    """SrunRunner against a stand-in `srun` on PATH (a shell script that records its arguments and
    environment and waits for TERM)."""
    sup, _, run = make([completes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "$@" > "$DSLURM_FACTS_DIR/argv"\n'
                                  'echo "$DSLURM_STEP_INDEX" > "$DSLURM_FACTS_DIR/index"\n'
                                  "trap 'exit 143' TERM\nwhile :; do sleep 0.05; done\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    runner = SrunRunner(sup.r, ["launch"], dict(__import__("os").environ))
    d = sup.step_dir(1)
    import threading

    def stop():
        deadline = time.monotonic() + 10
        # Written, not only created: `echo > file` creates the file before it writes the line.
        while not ((d / "index").exists() and (d / "index").read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.02)
        runner.signal(signal.SIGTERM)
    threading.Thread(target=stop).start()
    assert runner.run(Step(index=1, hosts=("node1", "node3"), facts_dir=d), lambda: False) == 143
    assert (d / "index").read_text().strip() == "1" and "--nodelist=node1,node3" in (d / "argv").read_text()
    assert d.name == "4242.0.1" and F.parse_start_name(d.name) == ("4242", 0, 1)


def test_the_real_runner_kills_an_srun_that_waits_for_a_lost_node_once_abandoned(make, tmp_path, monkeypatch):
    """A stand-in srun that never returns (as srun waits for a lost node's tasks): the runner
    kills it once `abandon()` says so, and only then."""
    sup, _, run = make([completes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile :; do sleep 0.05; done\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    runner = SrunRunner(sup.r, ["launch"], dict(__import__("os").environ))
    asked = []

    def abandon():
        asked.append(time.monotonic())
        return len(asked) >= 2
    assert runner.run(Step(index=0, hosts=("node1", "node2"), facts_dir=sup.step_dir(0)), abandon) == 128 + 9
    assert len(asked) == 2


def _node1_failed_node2_silent(c, step, *, ago: float):
    c.train(step, 0, 5)
    c.ranks(step, {"node1": "peer_lost"}, 5, lost=("node2",))
    rep = step.facts_dir / "launcher-node1.json"
    rec = json.loads(rep.read_text())
    rec["t"] = time.time() - ago
    rep.write_text(json.dumps(rec))


@pytest.mark.parametrize("alive", [False, True])
def test_a_step_is_abandoned_only_when_its_silent_nodes_are_gone(make, alive):
    """While srun still runs: node1's launcher reported a failure, node2 nothing. Before the grace
    the step is not abandoned (node2's report may be on its way) and nothing is probed; after it,
    node2 is probed once: gone -> abandon, and the ending is a node failure without a second
    probe; alive -> srun is left to end the step, and it is read as a crash."""
    seen = {}

    def play(c, step):
        c.answers = {"node2": alive}
        _node1_failed_node2_silent(c, step, ago=0.0)
        abandon = c.abandons[-1]
        seen["early"] = (abandon(), list(c.probed))
        _node1_failed_node2_silent(c, step, ago=5.0)
        seen["late"] = (abandon(), abandon(), list(c.probed))
        return 137 if not alive else 1
    sup, c, run = make([play, completes])
    assert sup.loop() == X.OK
    assert seen["early"] == (False, [])
    assert seen["late"] == (not alive, False, [(["node2"], sup.probe_s())])
    assert len(c.probed) == (1 if not alive else 2)  # the alive node is probed again once srun returned
    ends = [e.cls for e in _events(run, ev.Ending)]
    assert ends == (["node_failure", "completed"] if not alive else ["crash", "completed"])
    assert c.steps[1].hosts == (("node1", "node3") if not alive else ("node1", "node2"))


def test_start_names_with_steps_sort_and_parse():
    assert F.start_name("7", 2) == "7.2" and F.start_name("7", 2, 3) == "7.2.3"
    assert F.parse_start_name("7.2") == ("7", 2, 0) and F.parse_start_name("local-9.0.4") == ("local-9", 0, 4)


def test_ledger_recovery_event_round_trips(tmp_path):
    Ledger(tmp_path).append(ev.Recovery(cause="crash", mode="spare", removed=["n2"], added=["n3"], grad_accum=None))
    rec, = ev.read(tmp_path)
    assert isinstance(rec, ev.Recovery) and rec.removed == ["n2"]
    assert json.loads((tmp_path / "ledger.jsonl").read_text())["event"] == "recovery"


def _lost_late(alive: bool):
    """srun ended before Slurm marked node2 down (node2's launcher left no report): the loop
    probes node2 at once instead of waiting for Slurm's word."""
    def play(c, step):
        c.train(step, 0, 5)
        c.ranks(step, {"node1": "peer_lost"}, 5, lost=("node2",))
        c.answers = {"node2": alive}
        return 1
    return play


def test_a_silent_node_that_does_not_answer_a_probe_is_lost_without_waiting_for_slurm(make):
    sup, c, run = make([_lost_late(alive=False), completes])
    assert sup.loop() == X.OK
    assert c.probed == [(["node2"], sup.probe_s())]
    end = _events(run, ev.Ending)[0]
    assert end.cls == "node_failure" and "no answer to a probe step" in end.reason
    assert c.steps[1].hosts == ("node1", "node3") and read_blocklist(run) == ["node2"]


def test_a_silent_node_that_answers_the_probe_is_alive_and_the_step_a_crash(make):
    sup, c, run = make([_lost_late(alive=True), completes])
    assert sup.loop() == X.OK
    assert [e.cls for e in _events(run, ev.Ending)] == ["crash", "completed"]
    assert c.steps[1].hosts == ("node1", "node2") and read_blocklist(run) == []


def test_the_probe_waits_longer_on_a_loaded_machine(make, monkeypatch):
    """`dslurm selftest chaos` (seed 1): on 2 cores at load 14 a node holding a SIGSTOPped rank did not
    answer `srun true` within 8 s and was swapped out as lost."""
    sup, c, run = make([completes])
    monkeypatch.setattr("dslurm.slurm.load_factor", lambda *a, **k: 3.0)
    assert sup.probe_s() == 24.0


def test_a_node_slurm_already_reports_down_is_not_probed(make):
    sup, c, run = make([loses("node2"), completes])
    assert sup.loop() == X.OK
    assert c.probed == []


def test_the_real_probe_names_hosts_that_fail_or_do_not_answer_in_time(make, tmp_path, monkeypatch):
    """SrunRunner.probe with srun and scontrol replaced by scripts on PATH (no Slurm here). node1's
    slurmd port (a real listening socket) accepts and srun answers; node4's port refuses (nothing
    listens there), so node4 is gone without an srun (the fake srun would say it answers); node2
    and node3 have no address (scontrol says nothing) and go to srun: node2 fails at once, node3's
    step is launched and hangs past the timeout (killed); node5's step is never created (it pends
    at slurmctld, as after its restart): no node was asked, so node5 is not lost."""
    import socket

    import dslurm.recover.srun as S
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\ncase "$*" in *node1*|*node4*) exit 0;; *node2*) exit 1;; '
                                  '*node5*) sleep 30;; '
                                  '*) echo "srun: launching StepId=1.1 on host node3" >&2; sleep 30;; esac\n')
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\necho 'NodeName=node1 Arch=x86_64 NodeAddr=127.0.0.1 Port={live.getsockname()[1]}'\n"
        f"echo 'NodeName=node4 NodeAddr=127.0.0.1 Port={closed.getsockname()[1]}'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    sup, c, run = make([completes])
    runner = S.SrunRunner(sup.r, ["true"], {"PATH": f"{bin_dir}:/usr/bin:/bin"})
    t0 = time.monotonic()
    try:
        assert runner.probe(["node1", "node2", "node3", "node4", "node5"], 1.0) == ("node2", "node3", "node4")
    finally:
        live.close()
        closed.close()
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("ctld, sacct, want", [
    (["4242 RUNNING"], "CANCELLED", "RUNNING"),            # slurmctld's RUNNING: accounting is not asked
    (["4242 COMPLETING"], "TIMEOUT", "TIMEOUT"),           # a stop under way: accounting names it
    (None, "PREEMPTED", "PREEMPTED"),                      # scontrol failed: accounting
    # the array task that kept the array's id: scontrol lists its siblings too, RUNNING ones first
    (["4243 RUNNING", "4242 COMPLETING"], "TIMEOUT", "TIMEOUT"),
])
def test_the_runners_job_state_is_slurmctlds_running_else_accountings(make, tmp_path, monkeypatch, ctld, sacct, want):
    """Stand-in scontrol and sacct on PATH (sacct's answer differs from scontrol's on purpose, so
    the test sees which was used); sacct records that it was asked."""
    sup, _, _ = make([completes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    show = ("\n".join(f'echo "JobId={r.split()[0]} JobName=x JobState={r.split()[1]} Reason=None NodeList=node1"'
                      for r in ctld) if ctld
            else 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1')
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\n{show}\n")
    rec = {"jobs": [{"job_id": 4242, "state": {"current": [sacct]}, "nodes": "node1", "time": {"start": 1, "end": 0}}]}
    (bin_dir / "sacct").write_text(f"#!/bin/bash\ntouch {tmp_path}/sacct-asked\necho '{json.dumps(rec)}'\n")
    (bin_dir / "sinfo").write_text('#!/bin/bash\necho \'{"nodes": []}\'\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    runner = SrunRunner(sup.r, ["launch"], {**__import__("os").environ, "SLURM_JOB_ID": "4242"})
    assert runner.view(["node1"]).state == want
    assert (tmp_path / "sacct-asked").exists() == (want != "RUNNING")


REFUSED = "srun: error: Unable to create step for job 4242: Memory required by task is not available"


def refused_then(then):
    """slurmctld refuses the step (as after its restart, chaos seed 4444) the first time, then `then` plays."""
    calls = []

    def play(c: FakeCluster, step: Step) -> int:
        calls.append(step.index)
        if len(calls) == 1:
            assert F.write_refusal(step.facts_dir, REFUSED)
            return 1
        return then(c, step)
    return play


def test_a_step_slurmctld_refused_is_started_again_and_spends_nothing(make):
    sup, c, run = make([refused_then(completes)])
    sup.refused_pause_s = 0.01
    assert sup.loop() == 0
    assert [s.index for s in c.steps] == [0, 0]  # the same step again, no recovery
    assert c.probed == [] and not _events(run, ev.Recovery) and read_blocklist(run) == []
    assert [e.cls for e in _events(run, ev.Ending)] == [E.COMPLETED]
    assert F.read_start(sup.step_dir(0)).refused is None  # the retry's facts are its own


def test_a_step_refused_for_longer_than_the_wait_is_a_crash_in_srun_s_words_with_no_node_blamed(make):
    def refused(c, step):
        F.write_refusal(step.facts_dir, REFUSED)
        return 1
    sup, c, run = make([refused, completes])
    sup.refused_base_s, sup.refused_pause_s = 0.3, 0.01
    sup.loop()
    assert len([s for s in c.steps if s.index == 0]) >= 2 and c.probed == []  # nobody asked a node
    end = _events(run, ev.Ending)[0]
    assert end.cls == E.CRASH and "Slurm would not create the job step" in end.reason and "Memory" in end.reason
    assert read_blocklist(run) == []  # no node at fault
    assert [(r.mode, r.removed) for r in _events(run, ev.Recovery)] == [("same_nodes", [])]


def test_srun_s_refusals_that_say_nothing_about_the_nodes():
    from dslurm.recover.srun import refusal

    assert refusal(f"some task output\n{REFUSED}\n") == REFUSED
    assert refusal("srun: error: Unable to confirm allocation for job 7: Job is pending execution")
    assert refusal("srun: error: Unable to create step for job 7: Required node not available (down, drained "
                   "or reserved)") is None  # about the node: its loss is the probe's to settle
    assert refusal("Memory required by task is not available") is None  # a task's own line, not srun's
    assert refusal("") is None


def test_the_real_runner_relays_srun_s_stderr_and_records_a_refusal(make, tmp_path, monkeypatch, capfd):
    sup, _, run = make([completes])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "a task said this" >&2\necho "{REFUSED}" >&2\nexit 1\n')
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    runner = SrunRunner(sup.r, ["launch"], dict(__import__("os").environ))
    d = sup.step_dir(0)
    assert runner.run(Step(index=0, hosts=("node1", "node2"), facts_dir=d), lambda: False) == 1
    assert F.read_start(d).refused == REFUSED
    err = capfd.readouterr().err
    assert "a task said this" in err and REFUSED in err  # the job's log keeps every line


def test_the_real_probe_asks_again_while_slurmctld_refuses_and_blames_no_node_for_it(make, tmp_path):
    """Stand-in srun: node1's probe is refused twice then answers; node2's is refused throughout
    (its slurmd listens: not counted lost); node3's step is created and fails: lost."""
    import dslurm.recover.srun as S
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\ncase "$*" in\n*node1*) n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n+1)) > {tmp_path}/n\n'
        f'  [ "$n" -ge 2 ] && exit 0; echo "{REFUSED}" >&2; exit 1;;\n'
        f'*node2*) echo "{REFUSED}" >&2; exit 1;;\n*) echo "srun: error: node3: task 0: Exited with exit code 1" >&2; '
        'exit 1;;\nesac\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    sup, c, run = make([completes])
    runner = S.SrunRunner(sup.r, ["true"], {"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert runner.probe(["node1", "node2", "node3"], 4.0) == ("node3",)
    assert (tmp_path / "n").read_text().strip() == "3"
