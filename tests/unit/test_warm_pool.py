"""The warm pool (dslurm/launch/warm.py) for real, without torch: a pool process that preloads
nothing forks stand-in workers (a tiny `python -m` module). Each worker is a fresh process with one
thread, its own session, the rank's environment and the launcher's stdout; the pool reports each
exit code; and when the launcher's connection closes, workers that ignore TERM or are stopped
are SIGKILLed and reaped before the pool starts the next attempt's workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslurm.launch import warm

ROOT = Path(__file__).resolve().parents[2]

WORKER = """\
import json, os, signal, sys, time
out = os.environ["OUT"]
rank = int(os.environ["RANK"])
mode = sys.argv[1]
rec = dict(pid=os.getpid(), rank=rank, local=os.environ["LOCAL_RANK"], world=os.environ["WORLD_SIZE"],
           tasks=len(os.listdir("/proc/self/task")), sid=os.getsid(0), argv=sys.argv[1:], born=time.time(),
           omp=os.environ.get("OMP_NUM_THREADS"))
if mode != "save":
    with open(f"{out}/{mode}.{rank}.json", "w") as fh:
        json.dump(rec, fh)
print(f"hello from rank {rank}", flush=True)
if mode == "save":  # a stop save on TERM: seconds of work, then the trainer's 143
    def on_term(*_):
        time.sleep(1.0)
        with open(f"{out}/saved.{rank}", "w") as fh:
            fh.write("saved")
        os._exit(143)
    signal.signal(signal.SIGTERM, on_term)
    rec["usr2_ignored"] = signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    with open(f"{out}/save.{rank}.json", "w") as fh:
        json.dump(rec, fh)
    while True:
        time.sleep(0.05)
if mode == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
sys.exit(3 if rank == 1 else 0)
"""


POOLS: dict[Path, subprocess.Popen[bytes]] = {}


@pytest.fixture
def pool(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "warm_stub.py").write_text(WORKER)
    sock, ready = tmp_path / "pool.sock", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'mods'}:{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "dslurm.launch.warm", "--job", "1", "--host", "h",
                             "--socket", str(sock), "--base", "", "--ready", str(ready)], env=env, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the pool did not come up"
        time.sleep(0.05)
    POOLS[sock] = proc  # the save test signals the pool itself
    yield sock
    POOLS.pop(sock, None)
    if proc.poll() is None:
        proc.terminate()  # waits for an attempt's workers: a failed test may leave some running
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()  # its workers die with it (PDEATHSIG)
            proc.wait(10)


def _envs(out: Path, n: int = 2) -> list[dict[str, str]]:
    return warm.worker_envs({"OUT": str(out), "PATH": os.environ["PATH"]}, n, node_rank=0, world=n)


def test_warm_pool_forks_fresh_workers_and_reports_their_codes(pool, tmp_path, capfd):
    att = warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "ok"], _envs(tmp_path), str(tmp_path))
    assert att.tasks >= 1 and len(att.pids) == 2
    codes = att.wait(lambda lr: None)
    assert codes == {0: 0, 1: 3}
    recs = [json.loads((tmp_path / f"ok.{r}.json").read_text()) for r in (0, 1)]
    assert [r["pid"] for r in recs] == att.pids
    assert all(r["tasks"] == 1 and r["sid"] == r["pid"] for r in recs)  # one thread, own session
    assert [(r["rank"], r["local"], r["world"], r["argv"]) for r in recs] == [
        (0, "0", "2", ["ok"]), (1, "1", "2", ["ok"])]
    assert "hello from rank 1" in capfd.readouterr().out  # the launcher's stdout, passed by SCM_RIGHTS


def test_warm_pool_kills_a_hung_attempt_before_the_next_starts(pool, tmp_path):
    """Rank 0 ignores TERM, rank 1 is stopped (SIGSTOP): the launcher goes away (its connection
    closes, as when srun kills it -9); the pool SIGKILLs and reaps both before the next
    attempt's workers are born."""
    old = warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "hang"], _envs(tmp_path), str(tmp_path))
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"hang.{r}.json").exists() for r in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(old.pids[0], signal.SIGTERM)  # ignored
    os.kill(old.pids[1], signal.SIGSTOP)
    time.sleep(0.3)
    assert all(Path(f"/proc/{p}").exists() for p in old.pids)
    old.sock.close()  # the launcher is gone
    new = warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "ok"], _envs(tmp_path), str(tmp_path))
    assert not any(Path(f"/proc/{p}").exists() for p in old.pids)  # killed and reaped, not zombies
    assert new.wait(lambda lr: None) == {0: 0, 1: 3}


def test_warm_pool_outlives_usr2_and_lets_a_terms_stop_save_finish(pool, tmp_path):
    """Slurm signals every step (time limit, preemption, scancel --signal): USR2 reaches the pool
    and the workers, then TERM. The pool ignores USR2 (so do the workers, until the trainer installs
    its handler); on TERM it takes no new attempt, but watches the workers save (1 s) and exit 143,
    reports their codes, and only then exits: its death would SIGKILL them mid-save (PDEATHSIG)."""
    att = warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "save"], _envs(tmp_path), str(tmp_path))
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"save.{r}.json").exists() for r in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert {json.loads((tmp_path / f"save.{r}.json").read_text())["usr2_ignored"] for r in (0, 1)} == {True}
    proc = POOLS[pool]
    for pid in (proc.pid, *att.pids):
        os.kill(pid, signal.SIGUSR2)
    time.sleep(0.3)
    assert proc.poll() is None and all(Path(f"/proc/{p}").exists() for p in att.pids)
    for pid in (proc.pid, *att.pids):
        os.kill(pid, signal.SIGTERM)
    assert att.wait(lambda lr: None) == {0: 143, 1: 143}
    assert all((tmp_path / f"saved.{r}").read_text() == "saved" for r in (0, 1))
    assert proc.wait(10) == 0  # then the pool exits, its socket gone: no new attempt finds it
    assert not pool.exists()
    with pytest.raises(warm.PoolUnavailable):
        warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "ok"], _envs(tmp_path), str(tmp_path))


def test_warm_pool_survives_a_request_without_envs(pool, tmp_path):
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(pool))
        body = json.dumps({"argv": ["x"]}).encode()
        socket.send_fds(s, [warm._HEADER.pack(len(body))], [1, 2])
        s.sendall(body)
        assert "error" in json.loads(s.makefile().readline())
    att = warm.Attempt(pool, [sys.executable, "-m", "warm_stub", "ok"], _envs(tmp_path), str(tmp_path))
    assert att.wait(lambda lr: None) == {0: 0, 1: 3}


def test_warm_pool_unavailable_is_reported_not_raised_elsewhere(tmp_path):
    with pytest.raises(warm.PoolUnavailable):
        warm.Attempt(tmp_path / "missing.sock", [sys.executable, "-m", "x"], _envs(tmp_path), str(tmp_path))


def test_warm_worker_envs_number_ranks_like_torchrun():
    envs = warm.worker_envs({"A": "1"}, 2, node_rank=1, world=6)
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("2", "0", "1", "6", "2"), ("3", "1", "1", "6", "2")]
    assert warm.entry_module(["python", "-m", "train", "--site", "s"]) == "train"
    assert warm.entry_module(["my_train.py"]) is None
    assert len(str(warm.socket_path("123456789", "node-with-a-long-name-0001", "/tmp"))) < 100
    assert envs[0]["OMP_NUM_THREADS"] == "1"  # as torchrun sets it with several workers, unless set
    assert warm.worker_envs({"OMP_NUM_THREADS": "4"}, 2, 0, 2)[1]["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in warm.worker_envs({}, 1, 0, 1)[0]
