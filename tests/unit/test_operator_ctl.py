"""`dslurm ctl` requests that used to go nowhere or be told wrong (issue 38): a script that cannot
take one is refused at once; a request is for the start that runs when it is written (a stale one
is dropped, by name); a `ctl stop` is an operator's stop, its own ending, and the job ends
CANCELLED (not FAILED 143); `dslurm.runtime.stop_requested` takes save and stop as the trainer
does. Slurm commands are stubbed at `slurm.run_cmd` here; tests/cluster/test_fault_matrix.py runs
the real thing."""

from __future__ import annotations

import json
import subprocess
import time
from types import SimpleNamespace

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm import slurm
from dslurm.cli import main
from dslurm.endings import facts as F
from dslurm.errors import SlurmError
from dslurm.observe import ctl
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.requeue import act_on, decide

SAFE = "import dslurm.runtime as dr\n...\nif dr.stop_requested(step + 1):\n    pass\n"
PLAIN = "import torch\nfor step in range(10):\n    pass\n"


def _run(tmp_path, entry="[train.py]"):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(f"name: x\nnodes: 1\nentry: {entry}\n")
    return run


def test_a_request_for_another_start_or_too_old_is_dropped_by_name(tmp_path):
    run = _run(tmp_path)
    poller = ctl.Poller(run, every_s=0, start="41.1")
    ctl.write_request(run, "stop", user="ana", start="41.0")  # left for the start before this one
    assert poller.take() is None
    (req, why), = poller.dropped
    assert req.action == "stop" and "written for start 41.0, this is start 41.1" in why
    assert (run / ctl.STALE).exists() and not (run / ctl.TAKEN).exists()
    assert ctl.write_request(run, "save", start="41.1") == poller.take()  # its own start's: taken
    # No start known on one side (a run outside Slurm): an old request expires.
    old = ctl.Request(action="save", id="1", t=time.time() - ctl.MAX_AGE_S - 5)
    assert "over 600 s" in (ctl.stale_reason(old, "41.1", time.time()) or "")
    assert ctl.stale_reason(ctl.Request(action="save", id="2", t=time.time()), "", time.time()) is None
    assert ctl.this_start({"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}) == "41.2" and ctl.this_start({}) == ""


def test_ctl_refuses_at_once_a_script_that_never_takes_requests(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run = _run(tmp_path)
    (tmp_path / "train.py").write_text(PLAIN)
    assert main(["ctl", str(run), "stop"]) != 0
    err = capsys.readouterr().err
    assert "train.py never calls dslurm.runtime.stop_requested" in err and "dslurm cancel --save" in err
    assert not (run / ctl.REQUEST).exists()
    (tmp_path / "train.py").write_text(SAFE)  # a dslurm.runtime script: taken at its stop_requested
    assert main(["ctl", str(run), "save"]) == 0
    assert json.loads((run / ctl.REQUEST).read_text())["action"] == "save"
    # A snapshot's copy is the one that runs (docs/remote.md): it is read first.
    (run / "code" / "abc").mkdir(parents=True)
    (run / "code" / "abc" / "train.py").write_text(PLAIN)
    assert main(["ctl", str(run), "save"]) != 0 and "code/abc/train.py" in capsys.readouterr().err


def test_ctl_names_the_running_start_and_refuses_when_none_runs(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, entry="train")
    Ledger(run).append(ev.Submit(job_ids=[41]))
    state = ["PENDING"]

    def run_cmd(args, **k):
        if args[0] == "squeue":
            if state[0] == "ERROR":
                raise SlurmError("squeue: error: slurm_load_jobs error: Unable to contact slurm controller")
            return subprocess.CompletedProcess(args, 0, f"41|x|{state[0]}|1|node1|u|0:05\n", "")
        return subprocess.CompletedProcess(args, 0, "JobId=41 JobState=RUNNING Restarts=2\n", "")

    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    assert main(["ctl", str(run), "stop"]) != 0
    assert "no start of" in capsys.readouterr().err and not (run / ctl.REQUEST).exists()
    state[0] = "RUNNING"
    assert main(["ctl", str(run), "stop"]) == 0
    assert json.loads((run / ctl.REQUEST).read_text())["start"] == "41.2"
    state[0] = "ERROR"  # Slurm unreachable: no refusal on a guess; the request expires instead
    assert main(["ctl", str(run), "stop"]) == 0
    assert json.loads((run / ctl.REQUEST).read_text())["start"] == ""


def _operator_stopped(d):
    F.write_cancel_request(d, save=True, user="ana (dslurm ctl stop)", via="ctl")
    for r in (0, 1):
        F.write_rank_report(F.RankReport(rank=r, kind="terminated_saved", code=143, step=17, error="",
                                         t=time.time(), signal=None), env={F.ENV: str(d)})
    return F.read_start(d)


def test_a_ctl_stop_is_an_operators_stop_and_the_job_ends_cancelled(tmp_path, monkeypatch):
    d = tmp_path / "starts" / "41.0"
    d.mkdir(parents=True)
    e = E.classify(_operator_stopped(d), E.SlurmView(state="RUNNING"), step_rc=143)
    assert (e.cls, e.saved, e.step) == (E.OPERATOR_STOP, True, 17), e
    assert "dslurm ctl stop` by ana" in e.reason and "cancel" not in e.reason
    dec = decide(ending=e.cls, failures=0, max_restarts=3, no_progress_limit=2, start_steps=[0], pointer_step=17)
    assert (dec.action, dec.exit_code) == ("stop", X.OK) and "not requeued" in dec.reason
    # Acting on it: a chain's later links, then the job itself (the last act: CANCELLED, not FAILED 143).
    calls: list[list[str]] = []
    monkeypatch.setattr(slurm, "run_cmd", lambda args, **k: calls.append(list(args)) or
                        subprocess.CompletedProcess(args, 0, "", ""))
    act_on(dec, e, {"SLURM_JOB_ID": "41"}, tmp_path, [40, 41, 42])
    assert calls == [["scancel", "42"], ["scancel", "41"]]
    chain = [x for x in ev.read(tmp_path) if isinstance(x, ev.ChainCancel)]
    assert chain and chain[0].reason == "operator stop"
    # `dslurm cancel --save` (no via) stays a cancel.
    F.write_cancel_request(d, save=True, user="ada")
    assert E.classify(F.read_start(d), E.SlurmView(state="RUNNING"), step_rc=143).cls == E.CANCELLED


def test_report_and_doctor_name_an_operators_stop(tmp_path):
    from dslurm.observe import doctor
    from dslurm.observe.report import summarize
    from dslurm.observe.starts import OPERATOR

    led = Ledger(tmp_path)
    led.append(ev.TrainStart(step=0))
    led.append(ev.OperatorRequest(action="stop", request_id="1", user="ana", step=5, recorded=True))
    led.append(ev.Exit(reason="terminated", step=5, code=143))
    led.append(ev.Ending(cls=E.OPERATOR_STOP, reason="operator stop: `dslurm ctl stop` by ana; saved at step 5",
                         step=5, saved=True, evidence=["`dslurm ctl stop` requested by ana"]))
    led.append(ev.Requeue(decision="stop", step_rc=143, exit_code=0, reason="operator stop", ending=E.OPERATOR_STOP))
    s = summarize(ev.read(tmp_path))
    assert s.starts[-1].exit_reason == OPERATOR and "terminated" not in s.starts[-1].exit_reason
    assert "operator stop" in (s.completion.why or "") and "cancel" not in (s.completion.why or "").split(":")[0]
    found = [f for f in doctor.diagnose(ev.read(tmp_path)) if "operator stop" in f.symptom]
    assert found and "dslurm ctl stop" in found[0].cause


def test_own_script_stop_requested_takes_ctl_save_and_stop(tmp_path, monkeypatch):
    """dslurm.runtime on one process (no process group: the agreement is this rank's own)."""
    from dslurm.runtime import Runtime
    from dslurm.runtime.checkpoint import Checkpoint

    run = _run(tmp_path)
    facts_dir = run / "starts" / "41.0"
    facts_dir.mkdir(parents=True)
    monkeypatch.setenv(F.ENV, str(facts_dir))
    rt = Runtime(run_dir=run, site=None, job=None, t_start=time.time())
    rt.device, rt.ledger, rt.ctl = "cpu", Ledger(run), ctl.Poller(run, every_s=0, start="41.0")
    ck = SimpleNamespace(rt=rt, interval=10)
    import torch

    ride = torch.tensor([1.5, 2.5])  # a script's own values ride in the same collective, unchanged here
    assert not rt.stop_requested(3, ride=ride) and not Checkpoint.due(ck, 3)  # nothing asked
    assert ride.tolist() == [1.5, 2.5]
    ctl.write_request(run, "save", user="ana")
    assert not rt.stop_requested(4) and Checkpoint.due(ck, 4) and not Checkpoint.due(ck, 5)
    ctl.write_request(run, "stop", user="ana")
    assert rt.stop_requested(5) and rt.terminated
    rec = json.loads((facts_dir / F.CANCEL).read_text())
    assert rec["via"] == "ctl" and "ana" in rec["user"]
    ops = [(o.action, o.step, o.recorded) for o in ev.of(ev.read(run), ev.OperatorRequest)]
    assert ops == [("save", 4, False), ("stop", 5, True)]
    ctl.write_request(run, "stop", start="40.0")  # stale: dropped, said in the ledger, not acted on
    rt.flags.stop_requested = rt.flags.stop_terminated = False
    assert not rt.stop_requested(6)
    assert [o.dropped for o in ev.of(ev.read(run), ev.OperatorRequest)][-1].startswith("written for start 40.0")


@pytest.mark.parametrize("entry", ["train", "[-m, my.module]"])
def test_module_entries_are_not_refused(tmp_path, entry):
    assert ctl.script_refusal(tmp_path, entry if entry == "train" else ["-m", "my.module"], [tmp_path]) is None


def test_a_ddp_model_that_rebuilds_its_buckets_is_named_as_an_inexact_resume():
    from torch.nn.parallel import DistributedDataParallel

    from dslurm.runtime.state import inexact_resumes

    ddp = object.__new__(DistributedDataParallel)  # only its two flags are read: no process group needed
    object.__setattr__(ddp, "__dict__", {"find_unused_parameters": False, "static_graph": False})
    (why,), = [inexact_resumes({"model": ddp}, 3)]
    assert "'model'" in why and "find_unused_parameters=True" in why
    assert inexact_resumes({"model": ddp}, 2) == []  # 2 ranks: a sum of two rounds the same either way
    ddp.__dict__["find_unused_parameters"] = True
    assert inexact_resumes({"model": ddp}, 3) == []


def test_a_resume_at_another_world_size_names_the_rng_streams_not_restored(tmp_path):
    from dslurm.observe import doctor

    led = Ledger(tmp_path)
    led.append(ev.TrainStart(step=0, layout={"world_size": 4}, job_id="7", restart=0))
    led.append(ev.Steps(first=0, last=5, loss=1.0, job_id="7", restart=0))
    led.append(ev.CkptRestore(step=6, generation="g6", rng_restored=False, saved_world_size=4, job_id="7", restart=1))
    led.append(ev.TrainStart(step=6, layout={"world_size": 2}, job_id="7", restart=1))
    (f,) = [f for f in doctor.diagnose(ev.read(tmp_path)) if "RNG" in f.symptom]
    assert "world size 2 (saved with 4)" in f.evidence[0] and "saved world size" in f.action
    led.append(ev.CkptRestore(step=8, generation="g8", rng_restored=True, saved_world_size=2, job_id="7", restart=2))
    assert len([f for f in doctor.diagnose(ev.read(tmp_path)) if "RNG" in f.symptom][0].evidence) == 1


def test_scancel_signal_term_is_a_stray_stop_requeued_as_documented(tmp_path):
    """The decision docs/requeue.md states: `scancel --signal=TERM JOB` (no --full) TERMs the job
    step only, like the field's stray TERM; with no request on record and Slurm still running the
    job it is a stray stop, requeued (saved, no restart budget), and the reason names the
    commands that end a run on purpose."""
    from pathlib import Path

    d = tmp_path / "starts" / "41.0"
    d.mkdir(parents=True)
    t = time.time()
    for host, ranks in (("node1", (0, 1)), ("node2", (2, 3))):
        F.write_launcher_report(F.LauncherReport(host=host, node_rank=ranks[0] // 2, signals=[("SIGTERM", t)],
                                                 torchrun_rc=143, worker_codes={"0": 143, "1": 143},
                                                 silent_local_ranks=[], code=143), env={F.ENV: str(d)})
        for r in ranks:
            F.write_rank_report(F.RankReport(rank=r, kind="terminated_saved", code=143, step=9, signal="SIGTERM",
                                             host=host, t=t + 0.5), env={F.ENV: str(d)})
    e = E.classify(F.read_start(d), E.SlurmView(state="RUNNING"), step_rc=143)
    assert (e.cls, e.saved, e.step) == (E.STRAY_STOP, True, 9), e
    dec = decide(ending=e.cls, failures=0, max_restarts=3, no_progress_limit=2, start_steps=[0], pointer_step=9,
                 max_stray_stops=3)
    assert dec.action == "requeue" and all(w in dec.reason for w in ("scancel JOB", "dslurm cancel", "ctl stop"))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "requeue.md").read_text()
    assert "**`scancel --signal=TERM JOB` is a stray stop, requeued: a decision.**" in doc


def test_a_run_started_by_hand_is_found_by_its_takers_note(tmp_path, capsys):
    """No job.yaml (torchrun -m train by hand): rank 0's Poller leaves ctl_taker.json, and ctl
    writes the request for the start it names; a dslurm.runtime script's note refuses `profile`;
    a run whose ledger has exited since is refused (tests/integration/test_ctl_trackers.py runs
    the trainer)."""
    run = tmp_path / "hand"
    run.mkdir()
    assert main(["ctl", str(run), "save"]) == 2 and "ctl_taker.json" in capsys.readouterr().err
    ctl.Poller(run, start="77.0")
    assert json.loads((run / "ctl_taker.json").read_text())["takes"] == ["save", "stop", "profile"]
    assert main(["ctl", str(run), "save"]) == 0
    assert json.loads((run / ctl.REQUEST).read_text())["start"] == "77.0"
    ctl.Poller(run, start="", takes=("save", "stop"))  # a dslurm.runtime script
    assert main(["ctl", str(run), "profile"]) == 2 and "takes save, stop only" in capsys.readouterr().err
    Ledger(run).append(ev.Exit(reason="completed", step=9))
    assert main(["ctl", str(run), "stop"]) == 2 and "ended (completed at step 9)" in capsys.readouterr().err
