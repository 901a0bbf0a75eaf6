"""The launcher: torchrun command line, exit-code agreement, signal forwarding (real
processes, no Slurm needed: the SLURM_* variables are set by hand)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dslurm.launch import agreed_exit_code, torchrun_argv
from dslurm.launch.slurm_env import derive

ENV = {"SLURM_JOB_ID": "99", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}


def test_torchrun_argv_c10d():
    info = derive(ENV, nproc_per_node=2)
    argv = torchrun_argv(info, ["python", "-m", "train"], python="py")
    assert argv[:3] == ["py", "-m", "dslurm.launch.torchrun"]
    assert "--nnodes=2" in argv and "--nproc-per-node=2" in argv and "--node-rank=1" in argv
    assert f"--rdzv-endpoint=node1:{info.master_port}" in argv
    assert "--rdzv-conf=is_host=false" in argv and "--local-addr=node2" in argv
    assert "--rdzv-id=99-0" in argv
    assert argv[-4:] == ["--no-python", "python", "-m", "train"]
    host = torchrun_argv(derive({**ENV, "SLURM_NODEID": "0"}, nproc_per_node=2), ["x"])
    assert "--rdzv-conf=is_host=true" in host


def test_exit_code_agreement():
    assert agreed_exit_code(1, [75, 75]) == 75  # requeue request survives torchrun's generic 1
    assert agreed_exit_code(0, [0, 0]) == 0
    assert agreed_exit_code(1, [75, 3]) == 3  # a real failure beats a requeue request
    assert agreed_exit_code(1, []) == 1  # workers died before reporting
    assert agreed_exit_code(1, [0, 75]) == 75  # a rank that finished plus ranks that saved


def test_env_cli_outside_allocation_names_the_variable(cli):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    res = subprocess.run([sys.executable, "-m", "dslurm", "env", "--json"], env=env, capture_output=True,
                         text=True)
    assert res.returncode == 2
    assert "SLURM_JOB_ID" in res.stderr and "Traceback" not in res.stderr


def test_env_cli_issue_example(cli):
    res = cli("env", "--json", env={"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-003,010]",
                                    "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_GPUS_ON_NODE": "8"})
    assert res.returncode == 0, res.stderr
    import json

    out = json.loads(res.stdout)
    assert out["node_rank"] == 3 and out["master_addr"] == "gpu001" and out["nproc_per_node"] == 8


def test_launch_srun_mode_forwards_usr2_and_returns_worker_code(tmp_path):
    """A real worker: the launcher forwards USR2, the worker's handler records it, and the
    launcher returns the worker's exit code."""
    worker = tmp_path / "worker.py"
    marker = tmp_path / "got"
    worker.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        got = []
        signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
        Path("{tmp_path}/ready").write_text(os.environ["RANK"])
        for _ in range(200):
            if got:
                Path("{marker}").write_text("USR2 rank=" + os.environ["RANK"])
                sys.exit(75)
            time.sleep(0.05)
        sys.exit(9)
    """))
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "SLURM_TASKS_PER_NODE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dslurm", "launch", "--mode", "srun", "--",
                             sys.executable, str(worker)], env=env, cwd=Path(__file__).parents[2])
    deadline = time.time() + 20
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=20) == 75
    assert marker.read_text() == "USR2 rank=0"


def test_a_stop_pending_from_supervise_is_left_for_the_worker(tmp_path):
    """DSLURM_PENDING_STOP (supervise starts a step after Slurm's warning came): the worker finds it
    in its status dir's stop file, as it finds a signal that came during its start-up."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import os, sys
        from pathlib import Path
        sys.exit(75 if (Path(os.environ["DSLURM_STATUS_DIR"]) / "stop").read_text() == "SIGUSR2" else 9)
    """))
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "SLURM_TASKS_PER_NODE": "1", "DSLURM_PENDING_STOP": "SIGUSR2"}
    res = subprocess.run([sys.executable, "-m", "dslurm", "launch", "--mode", "srun", "--", sys.executable,
                          str(worker)], env=env, cwd=Path(__file__).parents[2], timeout=60)
    assert res.returncode == 75


def test_usr2_reaches_workers_that_torchrun_put_in_sessions_of_their_own(tmp_path):
    """torchrun starts workers with start_new_session=True; the launcher must still reach
    them. A stand-in 'torchrun' starts its worker in a new session, like the real one."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        got = []
        signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
        Path("{tmp_path}/ready").write_text("1")
        for _ in range(400):
            if got:
                Path("{tmp_path}/got").write_text("1")
                sys.exit(0)
            time.sleep(0.05)
        sys.exit(9)
    """))
    fake_torchrun = tmp_path / "fake_torchrun.py"
    fake_torchrun.write_text(textwrap.dedent(f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "{worker}"], start_new_session=True)
        sys.exit(p.wait())
    """))
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "SLURM_TASKS_PER_NODE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dslurm", "launch", "--mode", "srun", "--",
                             sys.executable, str(fake_torchrun)], env=env, cwd=Path(__file__).parents[2])
    deadline = time.time() + 20
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=20) == 0
    assert (tmp_path / "got").exists()


def test_env_cli_user_mistakes_exit_2_naming_variable_and_fix(cli):
    """What `dslurm launch` reads from SLURM_*: a clear message and exit 2, never a traceback."""
    base = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu1", "SLURM_NNODES": "1", "SLURM_NODEID": "0"}
    for change, expect in [({"SLURM_GPUS_ON_NODE": "0"}, "allocated no GPUs on this node"),
                           ({"SLURM_GPUS_ON_NODE": "8", "DSLURM_MASTER_PORT": "70000"}, "DSLURM_MASTER_PORT=70000"),
                           ({"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'")]:
        res = cli("env", "--json", env={**base, **change})
        assert res.returncode == 2 and expect in res.stderr and "Fix:" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    res = cli("env", "--json", env={**base, "SLURM_GPUS_PER_NODE": "a100:2,v100:2"})
    assert res.returncode == 0 and '"nproc_per_node": 4' in res.stdout, res.stderr


def test_a_signal_while_the_pool_forks_reaches_the_warm_workers_once(monkeypatch, tmp_path):
    """TERM comes after the pool forked but before the pids arrived: recorded then, forwarded once
    the attempt is known; a TERM after that is forwarded by the handler only (never twice)."""
    import signal as sg

    import dslurm.launch as L
    from dslurm.launch import warm

    sent: list[int] = []

    class FakeAttempt:
        def __init__(self, path, argv, envs, cwd):
            self.pids, self.tasks = [1234], 1
            L.FORWARDER._on_signal(sg.SIGTERM, None)  # while the pool forks: no attempt known yet

        def signal_all(self, signum):
            sent.append(signum)

        def wait(self, on_failure):
            L.FORWARDER._on_signal(sg.SIGTERM, None)  # after: the handler forwards it itself
            return {0: 0}

    monkeypatch.setattr(warm, "Attempt", FakeAttempt)
    monkeypatch.setattr(L.FORWARDER, "install", lambda: None)
    L.reset_stop()
    try:
        info = derive({**ENV, "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1"},
                      nproc_per_node=1)
        assert L._run_warm(tmp_path / "s.sock", info, ["python", "-m", "x"], {}) == 0
        assert sent == [sg.SIGTERM, sg.SIGCONT] * 2  # a TERM wakes a frozen worker (with_cont)
    finally:
        L.reset_stop()
        L.FORWARDER.attempt = None


def test_a_forwarded_term_wakes_a_frozen_worker_in_a_session_of_its_own(tmp_path):
    """torchrun's workers lead sessions of their own (as torchrun itself does under the launcher):
    slurmstepd's SIGCONT + TERM + KILL reach only the launcher's group. A worker frozen by SIGSTOP
    (chaos seed 4444) would keep its TERM pending for ever, and the step's output open: the
    launcher sends a SIGCONT with each TERM it forwards, so the worker acts on it."""
    from dslurm.launch import FORWARDER

    pidfile = tmp_path / "worker.pid"
    agent = textwrap.dedent(f"""
        import subprocess, sys, time
        w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        open({str(pidfile)!r}, "w").write(str(w.pid))
        sys.exit(w.wait() and 0)  # like torchrun: outlives its worker only briefly
        """)
    proc = subprocess.Popen([sys.executable, "-c", agent], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = int(pidfile.read_text())
        os.kill(worker, signal.SIGSTOP)
        FORWARDER.proc = proc
        FORWARDER._on_signal(signal.SIGTERM, None)
        proc.wait(timeout=20)  # the agent ends of its TERM (torchrun would TERM its workers and wait)

        def gone() -> bool:
            try:
                return Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
            except OSError:
                return True
        deadline = time.monotonic() + 10
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(), "the frozen worker still holds on: its TERM never acted"
    finally:
        FORWARDER.proc = None
        proc.kill()


def _sig_masks(pid: int) -> tuple[int, int, str]:
    """(SigIgn, SigCgt, the executable's name) of a live process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = {k: v.strip() for k, v in (ln.split(":", 1) for ln in status.splitlines() if ":" in ln)}
    return int(field["SigIgn"], 16), int(field["SigCgt"], 16), field["Name"]


def test_a_warning_before_the_launchers_handler_is_dropped_not_fatal_and_taken_from_batch_signals(tmp_path):
    """Chaos seed 4444 (+137 s): supervise forwarded Slurm's warning to a launcher still starting,
    which died of it (exit 140, no facts: read as a crash that spent a restart). The rendered
    wrapper (dslurm.render.LAUNCHER_WRAP) starts it with USR2 ignored; the stop, which the batch
    shell (or supervise) recorded in batch.signals before forwarding it, is taken once the
    handlers are set: training is not started, exit 75, the signal in the launcher's facts.
    The USR2 is sent exactly in the window: the process has exec'd Python, USR2 ignored, no
    handler yet (read from /proc)."""
    import json
    import shlex

    from dslurm.render import LAUNCHER_WRAP

    usr2 = 1 << (signal.SIGUSR2 - 1)
    facts = tmp_path / "starts" / "5.0"
    facts.mkdir(parents=True)
    (facts / "batch.signals").write_text(f"USR2 {time.time():.6f}\n")
    env = {**os.environ, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1",
           "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
           "SLURM_TASKS_PER_NODE": "1", "DSLURM_FACTS_DIR": str(facts)}
    argv = [sys.executable, "-m", "dslurm", "launch", "--mode", "srun", "--", sys.executable, "-c",
            "import sys; sys.exit(9)"]  # 9: training was started
    root = Path(__file__).parents[2]
    # the premise: a bare launcher dies of a USR2 that comes this early
    bare = subprocess.Popen(argv, env=env, cwd=root)
    bare.send_signal(signal.SIGUSR2)
    assert bare.wait(timeout=60) == -signal.SIGUSR2
    wrapped = subprocess.Popen([*shlex.split(LAUNCHER_WRAP), *argv], env=env, cwd=root)
    deadline = time.time() + 30
    while True:
        ign, cgt, name = _sig_masks(wrapped.pid)
        if name.startswith("python") and ign & usr2 and not cgt & usr2:
            break
        assert not cgt & usr2 and time.time() < deadline, "missed the window before the launcher's handler"
        time.sleep(0.001)
    wrapped.send_signal(signal.SIGUSR2)
    assert wrapped.wait(timeout=60) == 75
    (report,) = [json.loads(p.read_text()) for p in facts.glob("launcher-*.json")]
    assert [s[0] for s in report["signals"]] == ["SIGUSR2"] and report["code"] == 75, report
