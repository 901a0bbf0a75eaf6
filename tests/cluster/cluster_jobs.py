"""Helpers shared by the cluster tests: a tiny training job spec, submit, waits, and readers
of what a run recorded (ledger events, endings, per-start facts)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dslurm.cluster.conf import NodeShape
from dslurm.cluster.disrupt import kill_node  # noqa: F401 - re-exported for the cluster tests
from dslurm.observe.ledger import read_events
from testkit import wait_for  # noqa: F401 - re-exported for the cluster tests

if TYPE_CHECKING:
    import torch

SITE = "site-configs/local.yaml"
SCRATCH = Path("/tmp/dslurm-cluster/scratch")  # local.yaml's storage.scratch; %n: each slurmd its own
ROOT = Path(__file__).resolve().parents[2]
GPUS = 2  # placeholder GPUs per node of the session cluster = site-configs/local-gpu.yaml's node.gpus
# The shipped GPU sites, each a never-started --test-only partition of the session cluster.
GPU_SITES = ("site-configs/h100-ib.yaml", "site-configs/a100-eth.yaml")


def session_shapes() -> tuple[NodeShape, ...]:
    from dslurm.cluster import parse_site_shape

    return tuple(parse_site_shape(str(ROOT / s)) for s in GPU_SITES)


def job_spec(tmp_path: Path, name: str, *, steps: int = 30, nodes: int = 2, tp: int = 2, interval: int = 10,
             sleep: float = 0.4, run_dir: Path | None = None, train: dict | None = None,
             checkpoint: dict | None = None, **extra: Any) -> str:
    job = {"name": name, "nodes": nodes, "time": "00:10:00", "model": {"preset": "tiny"},
           "parallel": {"tp": tp}, "preflight": {"enabled": False},
           "train": {"steps": steps, "global_batch": 8, "log_every": 1, "step_sleep_s": sleep, **(train or {})},
           "checkpoint": {"run_dir": str(run_dir or tmp_path / name), "interval": interval, **(checkpoint or {})},
           **extra}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(job))
    return str(p)


def probe_job(tmp_path: Path, mode: str) -> str:
    """A 2-node job that runs the connectivity probe (dslurm/launch/probe.py) in place of the trainer;
    its records land in tmp_path/run/probe."""
    job = {"name": f"probe-{mode}", "nodes": 2, "time": "00:05:00", "launch": mode,
           "entry": "dslurm.launch.probe", "preflight": {"enabled": False},
           "checkpoint": {"run_dir": str(tmp_path / "run")}}
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return str(p)


def submit(cli, env, spec: str, *args: str) -> int:
    res = cli("submit", "--site", SITE, "--job", spec, *args, env=env)
    assert res.returncode == 0, res.stderr
    return int(re.search(r"submitted job (\d+)", res.stdout).group(1))


def events(run: Path, name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_events(run) if name is None or e["event"] == name]


def endings(run: Path) -> list[str]:
    return [e["cls"] for e in events(run, "ending")]


def decisions(run: Path) -> list[str]:
    return [e["decision"] for e in events(run, "requeue")]


def logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*")))


def trained_steps(run: Path) -> dict[int, int]:
    """How often each step was trained (log_every=1)."""
    out: dict[int, int] = {}
    for e in events(run, "steps"):
        out[e["last"]] = out.get(e["last"], 0) + 1
    return out


# -- the two-tier scenarios (test_two_tier.py, test_partner.py): one uninterrupted reference run

TWO_TIER = {"steps": 16, "interval": 4}  # both scenarios and their reference train the same steps


@dataclass(frozen=True)
class Reference:
    """A submitted uninterrupted run: its run dir and job id (conftest's `two_tier_reference`)."""

    run: Path
    job: int


def submit_reference(cli, env, tmp_path: Path) -> Reference:
    return Reference(tmp_path / "ref2t", submit(cli, env, job_spec(tmp_path, "ref2t", sleep=0.3, **TWO_TIER)))


def losses(run: Path) -> dict[int, float]:
    return {e["last"]: e["loss"] for e in events(run, "steps")}


def final_tensors(run: Path, tmp: Path, step: int) -> dict[str, torch.Tensor]:
    """The tensors of the run's durable generation at `step` (the pointer's), flattened by name."""
    import torch  # here: conftest imports this module, and most cluster tests never need torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dslurm import checkpoint as ck
    ptr = ck.read_pointer(run)
    assert ptr is not None and ptr.step == step
    out = tmp / f"{run.name}.pt"
    dcp_to_torch_save(ck.generations_dir(run) / ptr.generation, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix.rstrip(".")] = obj
    walk("", torch.load(out, weights_only=False))
    return flat


def same_as_reference(ref: Reference, run: Path, env: dict[str, str], tmp: Path) -> None:
    """Every step's loss and the final checkpoint's tensors equal the reference's, bit for bit."""
    import torch

    from dslurm import slurm
    assert slurm.wait_job(ref.job, timeout=300, env=env) == "COMPLETED", logs(ref.run)
    got, want = losses(run), losses(ref.run)
    assert sorted(got) == list(range(TWO_TIER["steps"])) and got == want  # bit-identical, every step
    a, b = final_tensors(ref.run, tmp, TWO_TIER["steps"]), final_tensors(run, tmp, TWO_TIER["steps"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
