"""The two jobs of a chaos soak -- the one under faults (on the local cluster, its run dir on the
size-limited durable path) and the same training uninterrupted (torchrun on this machine, the same
world and layout) -- and the final parameters each leaves. Torch only inside `final_params`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dslurm.errors import UserError
from dslurm.run import RunDir

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "own_script" / "train_safe.py"
NODES, PROCS = 2, 2  # 2 training nodes x 2 processes (site-configs/local.yaml), tp 2 x dp 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    mode: str
    """builtin (the trainer) | script (examples/own_script/train_safe.py on dslurm.runtime)"""
    steps: int
    step_sleep_s: float
    interval: int
    spares: bool
    minutes: float


def job(p: Plan, run_dir: Path, out_pt: Path | None, *, chaos: bool) -> dict[str, Any]:
    """The job file's content. `chaos`: the job under faults (spares, warm restarts, budgets that
    only a broken promise can spend); else the reference (no spare, no sleep: the same numbers)."""
    spec: dict[str, Any] = {
        "name": "chaos", "nodes": NODES if chaos else 1,
        "time": f"00:{int(p.minutes) + 20:02d}:00" if p.minutes < 40 else "02:00:00",
        "parallel": {"tp": 2}, "preflight": {"enabled": False},
        "checkpoint": {"run_dir": str(run_dir), "interval": p.interval, "keep": 2, "on_error": "continue"},
    }
    if p.mode == "builtin":
        spec["model"] = {"preset": "tiny"}
        spec["train"] = {"steps": p.steps, "global_batch": 8, "log_every": 1,
                         "step_sleep_s": p.step_sleep_s if chaos else 0.0}
    else:
        spec["entry"] = [str(SCRIPT), "--steps", str(p.steps), "--step-sleep", str(p.step_sleep_s if chaos else 0.0),
                         "--out", str(out_pt)]
    if chaos:
        spec["requeue"] = {"max_restarts": 100000, "no_progress_limit": 0, "max_stray_stops": 100000}
        # A frozen rank is caught by its peers' watchdog: the bound is short so a soak sees it end.
        spec["health"] = {"hang_k": 5, "hang_floor_s": 10, "hang_ceiling_s": 90}
        if p.spares:
            spec |= {"spares": 1, "on_spares_exhausted": "requeue", "recovery": {"warm": True}}
    return spec


def write_job(spec: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def marker(p: Plan, run_dir: Path) -> str:
    """What every training process of the chaos job names on its command line."""
    return str(SCRIPT) if p.mode == "script" else str(RunDir(run_dir).job_yaml)


@dataclass(frozen=True, slots=True)
class Reference:
    run_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path


def start_reference(p: Plan, site: Path, work: Path) -> Reference:
    """Start the uninterrupted reference with torchrun here (4 processes: the chaos job's world and
    layout; no step sleep: a sleep changes no number). It runs beside the soak, off the cluster, at a
    low priority: the job under faults keeps the cores it would have."""
    run = work / "ref"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec = job(p, run, work / "ref.pt", chaos=False)
    path = write_job(spec, work / "ref.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    nproc = str(NODES * PROCS)
    if p.mode == "builtin":
        cmd = ["nice", "-n", "15", sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", nproc, "-m", "train", "--site", str(site), "--job", str(path)]
    else:  # a script finds its frozen config in the run dir, as `dslurm submit` leaves it
        shutil.copy(site, RunDir(run).site_yaml)
        shutil.copy(path, RunDir(run).job_yaml)
        env["DSLURM_RUN_DIR"] = str(run)
        cmd = ["nice", "-n", "15", sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", nproc, *[str(x) for x in spec["entry"]]]
    log = work / "ref.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return Reference(run, proc, log)


def stop_reference(ref: Reference) -> None:
    """TERM to torchrun (it tears its workers down: they run in sessions of their own), then KILL."""
    ref.proc.terminate()
    try:
        ref.proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        ref.proc.kill()
        ref.proc.wait()


def finish_reference(ref: Reference, timeout_s: float) -> Path:
    """Wait for the reference; -> its run dir. UserError naming its log when it failed."""
    try:
        code = ref.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_reference(ref)
        code = -1
    if code != 0:
        raise UserError(f"the uninterrupted reference failed (exit {code}); its output: {ref.log}")
    return ref.run_dir


def final_params(p: Plan, run_dir: Path, out_pt: Path | None, scratch: Path) -> dict[str, Any]:
    """The final parameters: the pointer's generation (builtin) or the script's --out file."""
    import torch

    if p.mode == "script":
        assert out_pt is not None
        loaded: dict[str, Any] = torch.load(out_pt, weights_only=True)
        return loaded
    from dslurm.checkpoint import export, read_pointer

    ptr = read_pointer(run_dir)
    if ptr is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint pointer")
    # The model's tensors through the checkpoint's one restricted reader (export's: .metadata by
    # dslurm.checkpoint.unpickle, nothing unpickled with weights_only=False), not dcp_to_torch_save.
    gen = run_dir / "generations" / ptr.generation
    items = export.plan_items(export.entries(gen), "model", None, None)
    return {k: v for k, v in export.load_items(gen, items).items() if isinstance(v, torch.Tensor)}


def differ(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when every tensor is equal bit for bit, else which differ."""
    import torch

    if a.keys() != b.keys():
        return f"different parameter names: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    return None if not bad else (f"{len(bad)} of {len(a)} tensors differ from the uninterrupted run's "
                                 f"(first: {bad[0]}, max |diff| {float((a[bad[0]] - b[bad[0]]).abs().max()):.3g})")
