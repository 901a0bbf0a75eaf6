"""The frozen-rank scenario of issue 24, on the built-in local cluster: a 2-node x 2-rank run
whose rank 2 (on node2) is frozen with SIGSTOP at step 12 (between saves: during a save the
hang bound is the ceiling). The watchdog must catch the hang, every start after it must train,
and the run must complete. Run it N times:

    .venv/bin/python scripts/scenarios/frozen_rank.py --runs 3 [--out /tmp/frozen]

Prints one line per run: its endings, decisions and final step; exits 1 if any run did not
complete. Not part of the test suite (minutes per run: the hang bound, a requeue, a restart)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site-configs" / "local.yaml"


def job(out: Path, name: str) -> Path:
    spec = {"name": name, "nodes": 2, "time": "00:15:00", "model": {"preset": "tiny"}, "parallel": {"tp": 2},
            "preflight": {"enabled": False},
            "train": {"steps": 40, "global_batch": 8, "log_every": 1, "step_sleep_s": 0.5},
            "health": {"hang_floor_s": 30, "hang_k": 10},
            "checkpoint": {"run_dir": str(out / name), "interval": 5}}
    p = out / f"{name}.yaml"
    p.write_text(yaml.safe_dump(spec))
    return p


def ledger(run: Path) -> list[dict]:
    f = run / "ledger.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def rank_pid(run: Path, rank: int) -> int | None:
    """The training process of `rank` in this run (its environment names the run dir and rank)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if env.get("DSLURM_RUN_DIR") == str(run) and env.get("RANK") == str(rank) and "-m\0train" in cmd:
            return int(d.name)
    return None


def one(out: Path, n: int, dslurm: str) -> bool:
    name = f"frozen-{n}-{int(time.time())}"
    run = out / name
    res = subprocess.run([dslurm, "submit", "--site", str(SITE), "--job", str(job(out, name))],
                         capture_output=True, text=True, cwd=ROOT)
    jid = re.search(r"submitted job (\d+)", res.stdout)
    if not jid:
        print(res.stdout, res.stderr)
        return False
    frozen = False
    deadline = time.time() + 900
    while time.time() < deadline:
        evs = ledger(run)
        steps = [e["last"] for e in evs if e["event"] == "steps"]
        if not frozen and steps and max(steps) >= 11 and (pid := rank_pid(run, 2)):
            os.kill(pid, signal.SIGSTOP)
            frozen = True
            print(f"  run {n}: rank 2 (pid {pid}) frozen at step {max(steps) + 1}", flush=True)
        decided = [e for e in evs if e["event"] == "requeue"]
        if decided and decided[-1]["decision"] in ("end", "stop"):
            break
        time.sleep(1)
    evs = ledger(run)
    endings = [e["cls"] for e in evs if e["event"] == "ending"]
    decisions = [e["decision"] for e in evs if e["event"] == "requeue"]
    hangs = [e for e in evs if e["event"] == "hang"]
    last = max([e["last"] + 1 for e in evs if e["event"] == "steps"] or [0])
    ok = bool(endings) and endings[-1] == "completed" and last >= 40
    print(f"run {n}: job {jid.group(1)} endings {endings} decisions {decisions} hang events {len(hangs)} "
          f"reached step {last} of 40 -> {'COMPLETED' if ok else 'NOT COMPLETED'}", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="/tmp/frozen-rank")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dslurm = str(Path(sys.executable).with_name("dslurm"))
    subprocess.run([dslurm, "cluster", "up", "--nodes", "3", "--accounting"], check=True, cwd=ROOT)
    results = [one(out, n, dslurm) for n in range(1, args.runs + 1)]
    print(f"{sum(results)} of {len(results)} runs completed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
