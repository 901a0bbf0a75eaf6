"""recovery.replicas (issue 50): the config's rules, the rendered script (Lighthouse beside the batch
shell, --no-kill, supervise), the group split and data slots, and the replica supervisor's loop
against a fake runner (the real one: tests/cluster/test_replica_groups.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dslurm import endings as E
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.errors import UserError
from dslurm.launch.slurm_env import GROUP_ENV, lighthouse_port, master_port
from dslurm.observe import events as ev
from dslurm.recover.lighthouse import address
from dslurm.recover.replicas import PROGRESS, ReplicaSupervisor, group_hosts, last_step, steps_on
from dslurm.render import RenderRefs, render_sbatch
from train.replicas import Context, agreed_flags, group_overrides

SITE = "site-configs/local.yaml"



def _supervisor(*args):
    """A supervisor that asks no Slurm (a unit test has none): the allocation unknown, no step to kill."""
    sup = ReplicaSupervisor(*args)
    sup.allocation = lambda: None
    sup.kill_steps = lambda hosts: None
    return sup

def _resolved(tmp_path: Path | None = None, **job):
    data = {"name": "rep", "nodes": 3, "procs_per_node": 1, "model": {"preset": "tiny"},
            "parallel": {"dp_replicate": 3}, "recovery": {"replicas": True}, "train": {"global_batch": 6},
            **({"checkpoint": {"run_dir": str(tmp_path)}} if tmp_path else {}), **job}
    return resolve(load_site(SITE), load_job(data=data))


@pytest.mark.parametrize("job,field,fix", [
    ({"parallel": {"dp_replicate": 1}}, "recovery.replicas", "dp_replicate: 2 or more"),
    ({"nodes": 4}, "nodes", "multiple of 3"),
    ({"recovery": {"replicas": True, "replicas_min": 4}}, "recovery.replicas_min", "between 1 and"),
    ({"launch": "srun"}, "launch", "launch: torchrun"),
    ({"recovery": {"replicas": True, "replica_timeout_s": 0.2}}, "recovery.replica_timeout_s", "(default 2.0)"),
    ({"recovery": {"replicas": True, "replica_timeout_s": 900}}, "recovery.replica_timeout_s", "at most 600"),
])
def test_replica_settings_that_cannot_work_are_refused_with_the_field_and_the_fix(job, field, fix):
    with pytest.raises(UserError) as err:
        _resolved(**job)
    assert field in str(err.value) and fix in str(err.value)


def test_the_script_starts_the_lighthouse_beside_itself_and_supervises_the_groups_with_no_kill():
    text = render_sbatch(_resolved(), RenderRefs(site=SITE, job="job.yaml"))
    assert "#SBATCH --no-kill" in text and "#SBATCH --nodes=3" in text
    start = text.index("-m dslurm.recover.lighthouse --heartbeat-timeout-s 2.0 )")
    sup = text.index("-m dslurm supervise")
    stop = text.index('kill "$lighthouse_pid"')
    assert start < sup < stop < text.index('exit "$rc"')
    assert "trap '' USR2; exec" in text[start - 40:start]  # USR2 is the batch shell's to forward
    res = subprocess.run(["shellcheck", "-"], input=text, text=True, capture_output=True)
    assert res.returncode == 0, res.stdout


def test_the_replica_timeout_reaches_the_lighthouse_and_the_groups_all_reduce():
    r = _resolved(recovery={"replicas": True, "replica_timeout_s": 0.75})
    assert "--heartbeat-timeout-s 0.75 )" in render_sbatch(r, RenderRefs(site=SITE, job="job.yaml"))
    assert Context.from_env(r.job, {GROUP_ENV: "1"}).timeout_s == 0.75


def test_a_plain_job_renders_no_lighthouse():
    text = render_sbatch(_resolved(recovery={}, parallel={"dp_replicate": 3}), RenderRefs(site=SITE, job="j.yaml"))
    assert "lighthouse" not in text and "--no-kill" not in text


def test_the_lighthouse_port_is_no_step_master_port():
    port = lighthouse_port("4242", 1)
    assert port not in {master_port("4242", 1, i) for i in range(200)}
    assert address("node1", "4242", 1) == f"http://node1:{port}"


def test_groups_are_whole_nodes_in_order():
    assert group_hosts(["a", "b", "c", "d"], 2) == [("a", "b"), ("c", "d")]
    with pytest.raises(UserError, match="multiple of parallel.dp_replicate"):
        group_hosts(["a", "b", "c"], 2)


def test_a_groups_data_slots_depend_on_step_group_and_rank_only():
    ctx = Context(group=2, groups=3, replicas_min=1)
    assert [ctx.data_slot(r, 2) for r in range(2)] == [(4, 6), (5, 6)]
    assert Context(group=0, groups=3, replicas_min=1).data_slot(1, 2) == (1, 6)
    assert sorted(Context(group=g, groups=3, replicas_min=1).replica_id for g in (2, 0, 1)) == [
        "dslurm_g0000", "dslurm_g0001", "dslurm_g0002"]  # torchft's replica ranks follow the groups


def test_a_group_trains_its_share_of_the_global_batch_on_its_own_world():
    r = _resolved()
    assert group_overrides(r.job) == ["parallel.dp_replicate=1", "train.global_batch=2", "recovery.replicas=false",
                                      "recovery.replicas_min=1"]
    g = resolve(load_site(SITE), load_job(data={"name": "rep", "nodes": 1, "procs_per_node": 1,
                                                "model": {"preset": "tiny"}, "parallel": {"dp_replicate": 3},
                                                "recovery": {"replicas": True}, "train": {"global_batch": 6}},
                                          overrides=group_overrides(r.job)))
    assert g.layout.dp == 1 and g.job.train.global_batch == 2


class FakeRunner:
    """What the supervisor asks of a group's runner around a loss (the srun steps themselves:
    tests/cluster/test_replica_groups.py)."""

    def __init__(self, probes: list[tuple[str, ...]] | None = None) -> None:
        self.env: dict[str, str] = {}
        self.probes = list(probes or [])  # what each probe finds gone, in turn (then: all answer)

    def signal(self, signum):
        pass

    def view(self, hosts):
        return E.SlurmView(state="RUNNING")

    def act(self, dec, ending, env, run_dir, chain):
        pass

    def drain(self, hosts, reason):
        pass

    def probe(self, hosts, timeout_s):
        return self.probes.pop(0) if self.probes else ()


def test_a_lost_group_is_recorded_and_started_again_while_another_trains(tmp_path):
    r = _resolved(tmp_path)
    env = {"SLURM_JOB_ID": "77", "DSLURM_RUN_DIR": str(tmp_path)}
    runners = [FakeRunner(), FakeRunner(), FakeRunner()]
    sup = _supervisor(r, runners, env, ["node1", "node2", "node3"])
    sup.running = {0: tmp_path}  # group 0 still trains while group 2 fails
    end = sup._restart(2, _failed_dir(tmp_path), E.Ending(cls=E.CRASH, reason="rank 0 killed"), 1.0)
    assert end is True and sup.hosts[2] == ("node3",) and runners[2].env["DSLURM_REPLICA_LOST_STEP"] == "15"
    lost = ev.of(ev.read(tmp_path), ev.ReplicaLost)
    assert [(e.group, e.step, e.cause, e.next_hosts) for e in lost] == [(2, 15, "crash", ["node3"])]
    sup.running = {}
    assert sup._restart(2, _failed_dir(tmp_path), E.Ending(cls=E.CRASH, reason="again"), 1.0) is False  # alone


def test_a_lost_node_is_swapped_for_a_spare_or_waited_for(tmp_path):
    r = _resolved(tmp_path, spares=1)
    env = {"SLURM_JOB_ID": "77", "DSLURM_RUN_DIR": str(tmp_path)}
    runners = [FakeRunner(), FakeRunner(), FakeRunner([("node3",), ("node3",)])]
    sup = _supervisor(r, runners, env, ["node1", "node2", "node3", "node4"])
    sup.running, sup.node_wait_s = {0: tmp_path}, 0.0
    assert sup._next_hosts(2, ("node3",)) == ("node4",)  # the spare
    assert (tmp_path / "blocklist.txt").read_text().split() == ["node3"]
    # No spare left: probed again until the node answers (here the third probe), the same node then.
    assert sup._next_hosts(2, ("node3",)) == ("node3",) and runners[2].probes == []
    sup.running = {}
    runners[2].probes = [("node3",)]
    assert sup._next_hosts(2, ("node3",)) is None  # nobody trains: no wait, the group stays out


class SignalRecorder(FakeRunner):
    def __init__(self) -> None:
        super().__init__()
        self.signals: list[int] = []

    def signal(self, signum):
        self.signals.append(signum)


def test_a_loss_below_replicas_min_stops_the_others_as_usr2_does_and_starts_none(tmp_path):
    import signal

    r = _resolved(tmp_path, recovery={"replicas": True, "replicas_min": 2})
    runners = [SignalRecorder() for _ in range(3)]
    sup = _supervisor(r, runners, {"SLURM_JOB_ID": "77"}, ["node1", "node2", "node3"])
    g0, g1 = tmp_path / "g0", tmp_path / "g1"
    g0.mkdir(), g1.mkdir()
    sup.running = {0: g0, 1: g1}  # group 2 lost: 2 left, not below 2
    assert sup._restart(2, _failed_dir(tmp_path), E.Ending(cls=E.CRASH, reason="killed"), 1.0) is True
    assert sup.stopping is None and runners[0].signals == []
    sup.running = {0: g0}  # then group 1 lost: 1 left, below 2
    assert sup._restart(1, _failed_dir(tmp_path), E.Ending(cls=E.CRASH, reason="killed"), 1.0) is False
    assert sup.stopping == "USR2" and runners[0].signals == [signal.SIGUSR2]
    assert (g0 / "batch.signals").read_text().startswith("USR2 ")  # on record for the stop's ending
    lost = list(ev.of(ev.read(tmp_path), ev.ReplicaLost))[-1]
    assert lost.group == 1 and lost.next_hosts == [] and "below recovery.replicas_min (2)" in lost.reason


def test_the_steps_requests_are_agreed_across_groups():
    # group 0's rank took `ctl stop` (stop, TERM, ctl) and a save; three groups, averaged by 3
    assert agreed_flags([0, 0, 0, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0, 1 / 3], 3, failed=False) == [1, 1, 1, 0, 1]
    assert agreed_flags([1, 0, 0, 5, 0], [2 / 3, 0, 0, 5 / 3, 0], 3, failed=False) == [2, 0, 0, 5, 0]
    assert agreed_flags([1, 1, 0, 0, 1], [0.0] * 5, 3, failed=True) == [1, 1, 0, 0, 1]  # nothing agreed


def test_no_group_starts_again_once_group_0_is_over(tmp_path):
    r = _resolved(tmp_path)
    sup = _supervisor(r, [FakeRunner() for _ in range(3)], {"SLURM_JOB_ID": "77"}, ["node1", "node2", "node3"])
    sup.running, sup.over = {1: tmp_path}, {0}
    assert sup._restart(2, _failed_dir(tmp_path), E.Ending(cls=E.CRASH, reason="x"), 1.0) is False


def _failed_dir(tmp_path: Path) -> Path:
    d = tmp_path / "starts" / "77.0.9"
    d.mkdir(parents=True, exist_ok=True)
    (d / PROGRESS).write_text("15\n")
    return d


def test_the_last_step_a_group_began_is_read_from_its_record(tmp_path):
    assert last_step(tmp_path) is None
    (tmp_path / PROGRESS).write_text("23\n")
    assert last_step(tmp_path) == 23


def test_the_report_gives_participants_per_step_and_each_groups_line_through_its_faults():
    from dslurm.observe.replica_lines import participants, replica_lines

    evs = [ev.ReplicaSteps(group=0, first=1, participants=[3, 3, 2, 2], discarded=1),
           ev.ReplicaSteps(group=1, first=1, participants=[3, 3, 2, 2]),
           ev.ReplicaSteps(group=0, first=5, participants=[3]),
           ev.ReplicaLost(group=2, step=3, cause="crash", next_hosts=["node3"], t=2.0),
           ev.ReplicaHealed(group=2, step=5, t=3.0, heal_s=0.5, bytes=2_800_000, peer="http://node1:1/checkpoint/",
                            missed_steps=2, missed_samples=4),
           *(ev.ReplicaEnd(group=g, step=5, params_crc="ab") for g in range(3))]
    assert participants(evs) == {1: 3, 2: 3, 3: 2, 4: 2, 5: 3}
    lines = replica_lines(evs)
    assert lines[0] == ("replica groups: 3; 5 step(s) committed, 2 with fewer groups (steps 3-4, as few as 2); "
                        "1 step attempt(s) discarded by the commit vote")
    assert lines[1] == ("  group 2: lost at step 3 (crash), again on node3; healed at step 5 in 0.50 s (2.8 MB from "
                        "http://node1:1/checkpoint/), missed 2 step(s) = 4 sample(s) untrained")
    assert lines[2] == "  ended: 3 group(s) at step(s) [5], identical parameters"
    assert replica_lines([ev.Steps(first=0, last=3)]) == []  # no replica groups: no lines


def test_a_fault_knob_aims_at_the_jobs_ranks():
    from dslurm.faults import RANK_ENV, parse_scoped

    ctx = Context(group=2, groups=3, replicas_min=1)
    assert [ctx.job_rank(r, 2) for r in range(2)] == [4, 5]
    knob = parse_scoped("15:4@0.2")  # group 2's rank 0 (2 ranks a group), in the group's first job step
    assert knob.applies({"RANK": "0", RANK_ENV: "4", "DSLURM_STEP_INDEX": "2"})
    assert not knob.applies({"RANK": "0", RANK_ENV: "0", "DSLURM_STEP_INDEX": "2"})  # group 0's rank 0



def test_a_group_that_begins_no_step_while_another_goes_on_is_ended_as_a_hang(tmp_path):
    r = _resolved(tmp_path)
    sup = _supervisor(r, [FakeRunner() for _ in range(3)], {"SLURM_JOB_ID": "77"}, ["node1", "node2", "node3"])
    d0, d2 = tmp_path / "g0", tmp_path / "g2"
    d0.mkdir(), d2.mkdir()
    stalled: list[float] = []
    abandon = sup._stalled(2, d2, stalled)
    sup.running, sup.stall_s = {0: d0, 2: d2}, 0.0
    assert abandon() is False  # begun none yet: starting or healing, never stalled
    (d2 / PROGRESS).write_text("15\n")
    (d0 / PROGRESS).write_text("15\n")
    assert abandon() is False  # it just began a step
    assert abandon() is False  # quiet, but nobody is ahead of it
    (d0 / PROGRESS).write_text("16\n")
    assert abandon() is True and len(stalled) == 1
    sup.stall_s = 3600.0
    assert sup._stalled(2, d2, [])() is False  # not quiet long enough


class DownRunner(FakeRunner):
    def view(self, hosts):
        return E.SlurmView(state="RUNNING", down_nodes=("node3",))


def test_a_quiet_group_on_a_node_slurm_says_is_down_is_ended_at_once(tmp_path):
    r = _resolved(tmp_path)
    sup = _supervisor(r, [FakeRunner(), FakeRunner(), DownRunner()], {"SLURM_JOB_ID": "77"},
                            ["node1", "node2", "node3"])
    d2 = tmp_path / "g2"
    d2.mkdir()
    (d2 / PROGRESS).write_text("15\n")
    stalled: list[float] = []
    abandon = sup._stalled(2, d2, stalled)
    sup.running, sup.node_check_s = {2: d2}, 0.0  # nobody ahead of it: not a hang, but its node is down
    sup.allocation = lambda: ["node1", "node2", "node3"]
    assert abandon() is False  # it just began a step
    assert abandon() is True and len(stalled) == 1


def test_a_node_slurm_took_out_of_the_allocation_is_lost_even_once_it_answers_again(tmp_path):
    r = _resolved(tmp_path, spares=1)
    runners = [FakeRunner() for _ in range(3)]  # every probe answers
    sup = _supervisor(r, runners, {"SLURM_JOB_ID": "77", "DSLURM_RUN_DIR": str(tmp_path)},
                            ["node1", "node2", "node3", "node4"])
    sup.running, sup.allocation = {0: tmp_path}, lambda: ["node1", "node2", "node4"]
    assert sup._left(("node3",)) == ["node3"] and sup._left(("node2",)) == []
    assert sup._next_hosts(2, ("node3",)) == ("node4",)  # to the spare, the node blocklisted
    assert (tmp_path / "blocklist.txt").read_text().split() == ["node3"]
    sup.allocation = lambda: None  # Slurm not answering: nothing is taken for gone
    assert sup._left(("node3",)) == []


def test_a_hung_groups_steps_are_found_by_their_nodes():
    out = "77.0|node1\n77.2|node3\n77.batch|node1\n77.5|node[2-3]\n"
    expand = {"node1": ["node1"], "node3": ["node3"], "node[2-3]": ["node2", "node3"]}.__getitem__
    assert steps_on(out, ("node3",), expand) == ["77.2"]
    assert steps_on(out, ("node1",), expand) == ["77.0"]  # never the batch step (the Lighthouse's shell)
    assert steps_on(out, ("node3", "node2"), expand) == ["77.5"]
